"""The one place GGUF blocks become fp32 weights.

A GGUF tensor a dense layer reads (a float tensor, a norm) goes through
``dequantize_fp32`` on its way to the weight loaders, with ``gguf.quants.dequantize``
(llama.cpp's own numpy code, what transformers' GGUF loader uses too, so both compute
with the same values). A quantized linear method
that keeps the blocks takes ``GGUFTensor.rows`` instead of calling this.
"""

from __future__ import annotations

import numpy as np
from gguf.quants import dequantize

from gpu_worker.gguf.tensors import GGUFTensor


def dequantize_fp32(tensor: GGUFTensor, start: int = 0, stop: int | None = None) -> np.ndarray:
    """Rows ``start:stop`` (output features) of ``tensor`` as fp32, HF's shape. Rows are
    whole blocks, so a rank dequantizes only the rows it holds."""
    rows = tensor.rows[start:stop]
    out = dequantize(np.ascontiguousarray(rows), tensor.ggml_type).astype(np.float32, copy=True)
    if tensor.value_offset:
        out += np.float32(tensor.value_offset)
    return out.reshape(len(rows), *tensor.shape[1:]) if len(tensor.shape) > 1 else out.reshape(-1)
