"""Phi-3: a Llama-shaped model whose checkpoints already hold the fused ``qkv_proj`` and
``gate_up_proj`` ([q; k; v] and [gate; up] rows), so no tensor is packed on loading;
RoPE is often longrope (read by ``common_fields``)."""

from gpu_worker.architectures.hf_config import Architecture, WeightNames, common_fields

PHI3 = Architecture(common_fields, WeightNames(packed={}))
