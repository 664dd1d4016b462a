"""A checkpoint tensor as the layers see it while loading: shape known, data read lazily.

A sharded layer's ``weight_loader(param, source, *ids)`` narrows ``source`` to the rows
or columns its rank holds and copies them into (a part of) ``param``; only those are
read from the file (safetensors' ``get_slice``), so no rank ever reads more than its
shard. It returns how many elements of ``param`` it wrote, so the loader can prove that
every parameter was written exactly once. A module without a ``weight_loader`` takes
the whole tensor (``copy_into``).
"""

from __future__ import annotations

import copy

import torch


class CheckpointTensor:
    def __init__(self, file, name: str) -> None:
        self.file, self.name = file, name
        self.full_shape = tuple(file.get_slice(name).get_shape())
        self.cuts = tuple((0, n) for n in self.full_shape)  # (start, size) per dimension
        self.read_bytes = [0]  # shared with every view: what was read through any of them

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(size for _, size in self.cuts)

    @property
    def bytes_read(self) -> int:
        return self.read_bytes[0]

    def narrow(self, dim: int, start: int, size: int) -> CheckpointTensor:
        """Rows/columns ``start .. start + size`` of dimension ``dim`` (of this view)."""
        offset, have = self.cuts[dim]
        if start < 0 or start + size > have:
            raise ValueError(f"{self.name}: [{start}, {start + size}) of dimension {dim} is outside "
                             f"its {have} (shape {self.shape})")
        view = copy.copy(self)
        view.cuts = self.cuts[:dim] + ((offset + start, size),) + self.cuts[dim + 1:]
        return view

    def read(self) -> torch.Tensor:
        if self.shape == self.full_shape:
            tensor = self.file.get_tensor(self.name)
        else:
            tensor = self.file.get_slice(self.name)[tuple(slice(s, s + n) for s, n in self.cuts)]
        self.read_bytes[0] += tensor.numel() * tensor.element_size()
        return tensor


class Repeated:
    """A one-element checkpoint tensor read as ``shape`` copies of itself (a per-tensor
    scale spread over the rows of its part), sliced like any other."""

    def __init__(self, source: CheckpointTensor, shape: tuple[int, ...]) -> None:
        self.source, self.name, self.shape = source, source.name, tuple(shape)

    @property
    def bytes_read(self) -> int:
        return self.source.bytes_read

    def narrow(self, dim: int, start: int, size: int) -> Repeated:
        if start < 0 or start + size > self.shape[dim]:
            raise ValueError(f"{self.name}: [{start}, {start + size}) of dimension {dim} is outside "
                             f"its {self.shape[dim]} (repeated from one value)")
        return Repeated(self.source, self.shape[:dim] + (size,) + self.shape[dim + 1:])

    def read(self) -> torch.Tensor:
        return self.source.read().reshape(()).expand(self.shape)


def copy_into(dst: torch.Tensor, source: CheckpointTensor) -> int:
    """Write ``source`` into ``dst`` (same shape); the elements written."""
    if tuple(dst.shape) != source.shape:
        raise ValueError(f"{source.name}: checkpoint shape {source.shape} (this rank's part) "
                         f"!= {tuple(dst.shape)}")
    data = source.read()
    if data.dtype != dst.dtype and data.element_size() == dst.element_size() == 1 and not dst.is_floating_point():
        data = data.view(dst.dtype)  # bytes kept as bytes (an FP8 weight held as uint8)
    dst.copy_(data)
    return dst.numel()
