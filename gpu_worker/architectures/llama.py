"""Llama and Mistral: the shape every other family varies (pre-norm RMS, SwiGLU MLP,
separate q/k/v and gate/up tensors fused here); Mistral's sliding window is read by
``common_fields``."""

from gpu_worker.architectures.hf_config import Architecture, common_fields

LLAMA = Architecture(common_fields)
