"""FP8 e4m3 weights (compressed-tensors ``float-quantized``; ``quant_method: fp8`` with or
without ``weight_block_size``): ``w = fp8 * scale`` dequantized inside the matmul.

Activations: compressed-tensors' dynamic per-token scheme rounds each token's row
through e4m3 (``s = max|x| / 448``, ``x -> e4m3(x / s) * s``) before the matmul, bitwise
as transformers computes it; ``quant_method: fp8`` runs weight-only, activations in
float, as transformers does on CPU (it dequantizes such a checkpoint there); a static
activation scale in the checkpoint is not used.

The weight is kept as its bytes (uint8: ``Module.to(dtype)`` would convert a float8
tensor), its scale as float32 rows: one per output channel, a per-tensor scale repeated
over its part's rows (so the q, k and v of a fused layer keep their own), or one per
``weight_block_size`` block (``weight_scale_inv`` [out / rows, in / cols]).
"""

from __future__ import annotations

import torch
from torch import nn

from gpu_worker.batch_invariant import Probe
from gpu_worker.models.linear_method import Axes, Axis, LinearMethod
from gpu_worker.models.weights import Repeated
from gpu_worker.quantization import kernels
from gpu_worker.quantization.int8 import row_absmax
from gpu_worker.quantization.spec import Fp8Spec

SLAB = 256  # rows dequantized at a time by the torch path


E4M3_MAX = 448.0


def round_rows_through_e4m3(layer, x: torch.Tensor) -> torch.Tensor:
    """Each row scaled to e4m3's range, rounded to e4m3 and scaled back (row-wise: a
    row's values never depend on the others; the max is the whole row's, as int8's)."""
    x = x.float()
    scale = row_absmax(layer, x) / E4M3_MAX
    scale = torch.where(scale == 0, torch.ones_like(scale), scale)
    return (x / scale).clamp_(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn).float() * scale


def dequantize(w: torch.Tensor, scales: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """Bytes [rows, in] and scales [rows / bn, in / bk] -> float32 (the kernel's values)."""
    f = w.view(torch.float8_e4m3fn).float()
    bn, bk = block
    s = scales.repeat_interleave(bn, 0)[:w.shape[0]].repeat_interleave(bk, 1)[:, :w.shape[1]]
    return f * s


class Fp8Linear(LinearMethod):
    name = "fp8"

    def __init__(self, spec: Fp8Spec) -> None:
        self.spec = spec

    def _scale_shape(self, layer) -> tuple[int, int]:
        if self.spec.block is None:
            return layer.out_features, 1
        bn, bk = self.spec.block
        return -(-layer.out_features // bn), -(-layer.in_features // bk)

    def create_weights(self, layer: nn.Module) -> None:
        if layer.in_features % 32:
            raise ValueError(f"fp8: {layer.in_features} input features on this rank (the kernel takes 32s)")
        layer.weight = nn.Parameter(torch.empty(layer.out_features, layer.in_features, dtype=torch.uint8),
                                    requires_grad=False)
        layer.register_parameter(self.spec.scale_name, nn.Parameter(torch.empty(self._scale_shape(layer)),
                                                                    requires_grad=False))

    def axes(self, layer, name):
        if name == "weight":
            return Axes()
        if self.spec.block is None:
            return Axes(out=Axis(0), inp=None)
        bn, bk = self.spec.block
        return Axes(out=Axis(0, bn, 1), inp=Axis(1, bk, 1))

    def param_name(self, attr, ids):
        return None if attr == "input_scale" else attr  # (weight-only: see the module docstring)

    def source(self, layer, attr, ids, source):
        if attr == self.spec.scale_name and self.spec.block is None and len(source.shape) <= 1 \
                and (not source.shape or source.shape[0] == 1):  # per tensor: over its part's rows
            return Repeated(source, (layer.checkpoint_rows(ids[0] if ids else None), 1))
        return source

    def _block(self, layer) -> tuple[int, int]:
        return self.spec.block if self.spec.block is not None else (1, layer.in_features)

    def apply(self, layer, x, bias):
        if self.spec.token_activations:
            x = round_rows_through_e4m3(layer, x).to(x.dtype)
        x = x.contiguous()
        scales = getattr(layer, self.spec.scale_name)
        bn, bk = self._block(layer)
        y = x.new_empty((x.shape[0], layer.out_features))
        k = kernels.load() if kernels.applies(x) else None
        if k is not None:
            k.fp8_linear(x, layer.weight, scales, bn, bk, y)
        else:
            slab = max(bn, SLAB // bn * bn)  # whole blocks of rows
            for a in range(0, layer.out_features, slab):
                rows = layer.weight[a:a + slab]
                w = dequantize(rows, scales[a // bn:-(-(a + rows.shape[0]) // bn)], (bn, bk)).to(x.dtype)
                y[:, a:a + w.shape[0]] = layer.tp.numerics.linear(x, w)
        return y if bias is None else y.add_(bias)

    def probes(self, layer):
        key = ("fp8", layer.out_features, layer.in_features, self.spec.block, self.spec.token_activations)
        return [Probe(key, layer.in_features, lambda x: self.apply(layer, x, None))]
