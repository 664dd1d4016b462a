"""compressed-tensors W8A8 int8: int8 weights with a scale per output channel, and each
token's activations quantized to int8 at every matmul (dynamic, symmetric, as the scheme
was calibrated for): ``y = (sum_k xq wq) * sx * sw``.

The sums are exact in int32 (``torch._int_mm``, oneDNN's int8 GEMM on CPU), so their
order cannot matter: a row's result is bitwise the same in any batch, and the
activation scale is its own row's. The quantization is compressed-tensors' own:
``sx = max|x| / 127.5``, ``xq = clamp(round(x / sx), -128, 127)``, with the max over the
whole row on a row-parallel layer (its ranks' maxima combined), so a split quantizes as
one rank does.
"""

from __future__ import annotations

import torch
from torch import nn

from gpu_worker.batch_invariant import Probe
from gpu_worker.models.linear_method import Axes, Axis, LinearMethod

INT8_HALF_RANGE = 127.5  # (127 - -128) / 2


def row_absmax(layer, x: torch.Tensor) -> torch.Tensor:
    """Each row's max |x| over the whole row: a row-parallel layer holds a slice of it, so
    the ranks' maxima are combined (every rank then quantizes as one rank would)."""
    amax = x.abs().amax(dim=1, keepdim=True)
    return layer.tp.max_over_ranks(amax) if getattr(layer, "input_shards", 1) > 1 else amax


def quantize_rows(layer, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row symmetric int8 (compressed-tensors' dynamic token quantization)."""
    x = x.float()
    scale = row_absmax(layer, x) / INT8_HALF_RANGE
    scale = torch.where(scale == 0, torch.ones_like(scale), scale)
    return torch.round(x / scale).clamp_(-128, 127).to(torch.int8), scale


class Int8Linear(LinearMethod):
    name = "w8a8-int8"

    def create_weights(self, layer: nn.Module) -> None:
        layer.weight = nn.Parameter(torch.empty(layer.out_features, layer.in_features, dtype=torch.int8),
                                    requires_grad=False)
        layer.weight_scale = nn.Parameter(torch.empty(layer.out_features, 1), requires_grad=False)

    def axes(self, layer, name):
        return Axes() if name == "weight" else Axes(out=Axis(0), inp=None)

    def apply(self, layer, x, bias):
        xq, sx = quantize_rows(layer, x)
        if x.device.type == "cpu" and hasattr(torch, "_int_mm"):
            acc = torch._int_mm(xq, layer.weight.t())
        else:  # exact in float64 (sums far below 2^53)
            acc = xq.double() @ layer.weight.double().t()
        y = (acc.float() * sx * layer.weight_scale.view(1, -1)).to(x.dtype)
        return y if bias is None else y.add_(bias)

    def probes(self, layer):
        key = ("w8a8", layer.out_features, layer.in_features)
        return [Probe(key, layer.in_features, lambda x: self.apply(layer, x, None))]
