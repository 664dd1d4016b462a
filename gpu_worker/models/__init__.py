"""Model code (torch): shared blocks, tensor-parallel layers that load their own shard, and
the one switchable decoder every architecture (``gpu_worker/architectures/``) configures."""
