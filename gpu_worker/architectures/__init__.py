"""One module per architecture family: how its ``config.json`` reads into the decoder's
switches and how its checkpoint names map onto the decoder's parameters, declared
together as an ``hf_config.Architecture``; ``model_config.ARCHITECTURES`` registers each
``model_type`` once. Torch-free, so the launcher can refuse a checkpoint before any
process starts.

Adding a model: a module here whose ``Architecture`` sets the switches its HF class
hard-codes (``ModelConfig``'s fields; a behaviour the decoder lacks is a new switch and
a block in ``models/``), and one line per model_type in ``model_config.ARCHITECTURES``;
then a tiny checkpoint of it in ``tests/support/model_zoo.py`` checks it against HF.
"""
