"""A GGUF checkpoint opened the way the loader opens a safetensors file.

``GGUFWeights`` answers ``keys()`` (HF names), ``get_slice(name)`` and
``get_tensor(name)`` as ``safetensors.safe_open`` does, so ``loader.load_weights`` and
every layer's ``weight_loader`` (``models.weights.CheckpointTensor``: fused parts, TP
shards) read it unchanged. Reads dequantize to fp32 (``dequant.dequantize_fp32``; a
column shard dequantizes only its rows). ``tensor(name)`` hands out the raw blocks
(``GGUFTensor``) for a linear method that keeps them quantized.
"""

from __future__ import annotations

from math import prod
from pathlib import Path

import torch

from gpu_worker.gguf.dequant import dequantize_fp32
from gpu_worker.gguf.tensors import GGUFCheckpoint, GGUFTensor


class _Slice:
    def __init__(self, tensor: GGUFTensor) -> None:
        self.tensor = tensor

    def get_shape(self) -> list[int]:
        return list(self.tensor.shape)

    def __getitem__(self, index: tuple[slice, ...]) -> torch.Tensor:
        index = index if isinstance(index, tuple) else (index,)
        if len(self.tensor.shape) > 1 and index and index[0].step is None:
            first, rest = index[0], (slice(None), *index[1:])
            rows = dequantize_fp32(self.tensor, first.start or 0, first.stop)
        else:
            rows, rest = dequantize_fp32(self.tensor), index
        return torch.from_numpy(rows[rest] if rest else rows)


class GGUFWeights:
    def __init__(self, path: str | Path) -> None:
        self.checkpoint = GGUFCheckpoint.open(path)

    def __enter__(self) -> GGUFWeights:
        return self

    def __exit__(self, *exc) -> None:
        return None

    @property
    def dequantized_bytes(self) -> int:
        """What reading every tensor once yields, in fp32 bytes (the progress total)."""
        return sum(4 * prod(t.shape) for t in self.checkpoint.tensors.values())

    def keys(self) -> list[str]:
        return list(self.checkpoint.tensors)

    def tensor(self, name: str) -> GGUFTensor:
        return self.checkpoint.tensors[name]

    def get_slice(self, name: str) -> _Slice:
        return _Slice(self.checkpoint.tensors[name])

    def get_tensor(self, name: str) -> torch.Tensor:
        return torch.from_numpy(dequantize_fp32(self.checkpoint.tensors[name]))

