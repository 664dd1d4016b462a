"""A GGUF checkpoint opened the way the loader opens a safetensors file.

``GGUFWeights`` answers ``keys()`` (HF names), ``get_slice(name)`` and
``get_tensor(name)`` as ``safetensors.safe_open`` does, so ``loader.load_weights`` and
every layer's ``weight_loader`` (``models.weights.CheckpointTensor``: fused parts, TP
shards) read it unchanged. Reads dequantize to fp32 (``dequant.dequantize_fp32``; a
column shard dequantizes only its rows): float tensors and norms. ``blocks()`` is the
same file read as raw blocks, which a quantized layer (``GgmlLinear``) reads instead.
"""

from __future__ import annotations

from math import prod
from pathlib import Path

import numpy as np
import torch

from gpu_worker.gguf.dequant import dequantize_fp32
from gpu_worker.gguf.tensors import GGUFCheckpoint, GGUFTensor
from gpu_worker.quantization.spec import GGML_TYPES


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


class _RawSlice:
    def __init__(self, tensor: GGUFTensor) -> None:
        self.tensor = tensor

    def get_shape(self) -> list[int]:
        return list(self.tensor.rows.shape)

    def __getitem__(self, index: tuple[slice, ...]) -> torch.Tensor:
        return torch.from_numpy(np.array(self.tensor.rows[index]))  # a copy: the file is mapped read-only


class GGUFBlocks:
    """The same file's tensors as their raw blocks ([out_features, row bytes] uint8), for
    a layer that keeps them quantized (``GgmlLinear.source``)."""

    def __init__(self, weights: GGUFWeights) -> None:
        self.weights = weights

    def get_slice(self, name: str) -> _RawSlice:
        return _RawSlice(self.weights.tensor(name))

    def get_tensor(self, name: str) -> torch.Tensor:
        return self.get_slice(name)[:]


class GGUFWeights:
    def __init__(self, path: str | Path) -> None:
        self.checkpoint = GGUFCheckpoint.open(path)

    def __enter__(self) -> GGUFWeights:
        return self

    def __exit__(self, *exc) -> None:
        return None

    @property
    def read_bytes(self) -> int:
        """What reading every tensor once yields (the progress total): quantized ones as
        their blocks, float ones as fp32."""
        return sum(t.n_bytes if t.ggml_type.name in GGML_TYPES else 4 * prod(t.shape)
                   for t in self.checkpoint.tensors.values())

    def keys(self) -> list[str]:
        return list(self.checkpoint.tensors)

    def tensor(self, name: str) -> GGUFTensor:
        return self.checkpoint.tensors[name]

    def blocks(self) -> GGUFBlocks:
        return GGUFBlocks(self)

    def get_slice(self, name: str) -> _Slice:
        return _Slice(self.checkpoint.tensors[name])

    def get_tensor(self, name: str) -> torch.Tensor:
        return torch.from_numpy(dequantize_fp32(self.checkpoint.tensors[name]))

