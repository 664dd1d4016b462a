"""How a linear layer holds and multiplies its weight: the ``LinearMethod`` seam.

A parallel layer (``parallel.py``) owns *which part* of a weight its rank holds (its
output rows, its input columns, the parts of a fused q|k|v); its method owns *how* that
part is stored and multiplied: ``Dense`` (a float matrix through ``Numerics``, as every
layer computed before quantized weights existed) or a quantized one
(``gpu_worker.quantization``). A method

- ``create_weights(layer)``: registers the layer's stored tensors (for a quantized one
  several: blocks, scales, zero points) with their shapes on this rank;
- ``axes(layer, name)``: how stored tensor ``name`` maps onto the logical
  ``[out_features, in_features]`` matrix, so the layer's own ``weight_loader`` slices any
  of them (and the checkpoint tensor it reads) by logical rows and columns;
- ``finish(layer)``: once loaded, converts what the checkpoint stored into what the
  kernel reads (a repack, a transpose);
- ``apply(layer, x, bias)``: ``x W^T (+ bias)``;
- ``bind(layer)``: the same as a function of x alone, with whatever can be looked up once
  looked up (the flat layer programs call it, ``layer_program``);
- ``probes(layer)``: the matmuls whose batch invariance the start-up check measures.

Axes: a stored dimension may hold several logical elements per index (8 int4 values per
int32, a 32-element GGML block per 18 bytes): ``Axis(dim, logical, stored)`` reads
``logical`` elements per ``stored`` indices; narrowing at a position that is not a
multiple of ``logical`` would cut a block, which is refused naming the tensor. ``None``:
the tensor is not split along that logical dimension (whole on every rank: GPTQ's
``g_idx`` along the output, a row-parallel bias along the input). ``offset``: the first
logical row a tensor holds, for the part of a fused layer stored apart (GGUF may give
q, k and v different block types).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class Axis:
    dim: int
    logical: int = 1  # logical elements ...
    stored: int = 1   # ... per this many stored indices
    offset: int = 0   # the logical index the tensor's first stored index holds

    def length(self, t) -> int:
        """The logical rows (or columns) ``t`` holds along this axis."""
        return t.shape[self.dim] // self.stored * self.logical


@dataclass(frozen=True)
class Axes:
    out: Axis | None = Axis(0)
    inp: Axis | None = Axis(-1)


DENSE = Axes()
VECTOR = Axes(out=Axis(0), inp=None)  # a bias: along the output only


def default_axes(t) -> Axes:
    """A plain tensor's: matrices [out, in], vectors along the output (an adapter's A and
    B, a bias)."""
    return VECTOR if len(t.shape) == 1 else DENSE


def narrow(t, axis: Axis | None, start: int, size: int, what: str, *, own: bool):
    """Logical rows/columns ``[start, start + size)`` of ``t`` along ``axis`` (a stored
    tensor of this rank when ``own``: its ``offset`` applies; else a checkpoint tensor)."""
    if axis is None:
        return t
    if own:
        start -= axis.offset
    if start % axis.logical or size % axis.logical:
        raise ValueError(f"{getattr(t, 'name', 'a tensor')}: the {what} split [{start}, {start + size}) "
                         f"cuts a block of {axis.logical} (choose a tensor-parallel size whose "
                         "shard holds whole blocks)")
    dim = axis.dim % len(t.shape)
    return t.narrow(dim, start // axis.logical * axis.stored, size // axis.logical * axis.stored)


class LinearMethod:
    """The interface (see the module docstring); ``name`` says it in the start-up log."""

    name = "?"
    dense = False  # a float weight Numerics may pack and release

    def create_weights(self, layer: nn.Module) -> None:
        raise NotImplementedError

    def axes(self, layer: nn.Module, name: str) -> Axes:
        return DENSE

    def param_name(self, attr: str, ids: tuple) -> str:
        """The stored tensor a checkpoint's ``attr`` (its name's last part) with these ids
        loads into (a part stored apart has its own)."""
        return attr

    def source(self, layer: nn.Module, attr: str, ids: tuple, source):
        """The checkpoint tensor as the layer's loader should slice it (a per-tensor scale
        repeated over its rows: ``weights.Repeated``)."""
        return source

    def finish(self, layer: nn.Module) -> None:
        pass

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        raise NotImplementedError

    def bind(self, layer: nn.Module):
        """``x -> apply(layer, x, layer's bias)``, for a layer whose stored tensors stay put
        from now on (loaded and finished)."""
        bias = layer.bias
        return lambda x: self.apply(layer, x, bias)

    def probes(self, layer: nn.Module) -> list:
        return []

    def nbytes(self, layer: nn.Module) -> int:
        return sum(p.numel() * p.element_size() for n, p in layer.named_parameters(recurse=False) if n != "bias")


class Dense(LinearMethod):
    """A float ``weight`` [out, in] through the group's ``Numerics`` (batch-invariant
    padding, oneDNN-packed copies): what every layer computed before this seam. As an
    embedding table, rows are looked up."""

    name = "dense"
    dense = True

    def create_weights(self, layer: nn.Module) -> None:
        layer.weight = nn.Parameter(torch.empty(layer.out_features, layer.in_features))

    def apply(self, layer, x, bias):
        return layer.tp.numerics.linear(x, layer.weight, bias)

    def embed(self, layer, ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(ids, layer.weight)

    def probes(self, layer):
        return [(layer.weight, getattr(layer, "bias", None))]


DENSE_METHOD = Dense()


class MethodOwner:
    """A layer whose weight is its ``method``'s (``Dense`` unless a quantization plan set
    another, on the meta device before the weights load); ``out_features`` and
    ``in_features`` are this rank's logical matrix."""

    method: LinearMethod = DENSE_METHOD

    def set_method(self, method: LinearMethod) -> None:
        if "weight" in self._parameters:
            del self._parameters["weight"]
        self.method = method
        method.create_weights(self)

    def axes_of(self, param) -> Axes:
        """How ``param`` maps onto this layer's logical matrix: the method's declaration
        for one of this layer's own tensors, a plain tensor's otherwise (an adapter's)."""
        for name, own in self._parameters.items():
            if own is param:
                return VECTOR if name == "bias" else self.method.axes(self, name)
        return default_axes(param)


class QuantizableLinear(MethodOwner, nn.Linear):
    """An ``nn.Linear`` whose weight is its method's; ``input_shards``: how many ranks
    split its input (a row-parallel layer's), so a method can size what is whole."""

    input_shards = 1

    def checkpoint_rows(self, part=None) -> int:
        """Output rows of the checkpoint tensor of ``part`` (the whole layer's: None)."""
        return self.out_features
