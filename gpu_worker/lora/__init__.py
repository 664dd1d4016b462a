"""LoRA adapters over the base model: reading a PEFT adapter directory and checking it
against the base (``peft_files``, torch-free, so the launcher refuses a bad adapter
before any process starts), loading this rank's slice of it (``weights``), and adding
each row's adapter delta to the adapted layers (``batch``, ``store``)."""
