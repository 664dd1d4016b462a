"""Group-wise int4 weights (GPTQ, AWQ, compressed-tensors ``pack-quantized``), activations
in float: ``w = (q - zero) * scale``, one (scale, zero) per ``group_size`` input elements.

A layer loads its checkpoint's tensors as the format stores them (this rank's slice,
cut by logical rows and columns through the layer's loader):

| format | int4 values | zero points | scales |
|---|---|---|---|
| GPTQ | ``qweight`` int32 [in/8, out], 8 along the input per word | ``qzeros`` [groups, out/8], stored minus one (v1) | ``scales`` [groups, out] |
| AWQ (GEMM) | ``qweight`` int32 [in, out/8], word nibbles in AWQ's order 0 2 4 6 1 3 5 7 | ``qzeros`` [groups, out/8] | ``scales`` [groups, out] |
| pack-quantized | ``weight_packed`` int32 [out, in/8] | ``weight_zero_point`` [out/8, groups] (asymmetric; else 8) | ``weight_scale`` [out, groups] |

Then ``finish`` repacks them into what the kernel reads, output-major like a GGML block
row: ``qs`` uint8 [out, in/2] (element k in byte k/2, low nibble first), ``group_scales``
and ``group_zeros`` float32 [out, groups], freeing the checkpoint's layout. GPTQ's
act-order (``desc_act``: ``g_idx`` assigns input columns to groups out of order) sorts
the input columns by group once here and gathers x's columns the same way at each
matmul (exllama's trick), so groups stay contiguous.
"""

from __future__ import annotations

import torch
from torch import nn

from gpu_worker.batch_invariant import Probe
from gpu_worker.models.linear_method import Axes, Axis, LinearMethod
from gpu_worker.quantization import kernels
from gpu_worker.quantization.spec import Int4Spec

SLAB = 256  # rows dequantized at a time by the torch path
AWQ_ORDER = (0, 4, 1, 5, 2, 6, 3, 7)  # output n % 8 -> its nibble in an AWQ word
_STORED = ("qs", "group_scales", "group_zeros", "perm")


def _nibbles(words: torch.Tensor) -> torch.Tensor:
    """int32 words [..., w] -> their 8 nibbles [..., w * 8], lowest first (uint8)."""
    b = words.contiguous().view(torch.uint8)
    return torch.stack([b & 0x0F, b >> 4], dim=-1).reshape(*words.shape[:-1], -1)


def pack_nibbles(q: torch.Tensor) -> torch.Tensor:
    """uint8 values 0..15 [n, k] -> bytes [n, k/2] (element k in byte k/2, low nibble first)."""
    return (q[:, 0::2] | (q[:, 1::2] << 4)).contiguous()


def dequantize(qs: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group: int) -> torch.Tensor:
    """The kernel's layout -> float32 [rows, in] (the same operations as the kernel)."""
    q = torch.stack([qs & 0x0F, qs >> 4], dim=-1).reshape(qs.shape[0], -1).float()
    return (q - zeros.repeat_interleave(group, 1)) * scales.repeat_interleave(group, 1)


class Int4Linear(LinearMethod):
    name = "int4"

    def __init__(self, spec: Int4Spec) -> None:
        self.spec = spec
        self.group = 0  # the kernel's group size on this rank, once finished

    # ------------------------------------------------------------ the checkpoint's layout

    def _layout(self, layer: nn.Module) -> dict[str, tuple[tuple[int, ...], torch.dtype, Axes]]:
        """name -> (shape on this rank, dtype, axes) of each tensor the checkpoint stores."""
        spec = self.spec
        n, k = layer.out_features, layer.in_features
        whole = spec.group_size <= 0  # one group per full row: whole on every rank
        full_k = k * getattr(layer, "input_shards", 1)
        group = full_k if whole else spec.group_size
        shared = whole or spec.act_order  # groups not split with the input columns
        groups = full_k // group if shared else k // group
        along_in = None if shared else Axis(0, group, 1)
        if spec.format == "gptq":
            out = {"qweight": ((k // 8, n), torch.int32, Axes(out=Axis(1), inp=Axis(0, 8, 1))),
                   "qzeros": ((groups, n // 8), torch.int32, Axes(out=Axis(1, 8, 1), inp=along_in)),
                   "scales": ((groups, n), torch.float32, Axes(out=Axis(1), inp=along_in))}
            if spec.act_order:
                out["g_idx"] = ((k,), torch.int32, Axes(out=None, inp=Axis(0)))
            return out
        if spec.format == "awq":
            return {"qweight": ((k, n // 8), torch.int32, Axes(out=Axis(1, 8, 1), inp=Axis(0))),
                    "qzeros": ((groups, n // 8), torch.int32, Axes(out=Axis(1, 8, 1), inp=along_in)),
                    "scales": ((groups, n), torch.float32, Axes(out=Axis(1), inp=along_in))}
        along_in = None if whole else Axis(1, group, 1)
        out = {"weight_packed": ((n, k // 8), torch.int32, Axes(out=Axis(0), inp=Axis(1, 8, 1))),
               "weight_scale": ((n, groups), torch.float32, Axes(out=Axis(0), inp=along_in))}
        if not spec.symmetric:
            out["weight_zero_point"] = ((n // 8, groups), torch.int32, Axes(out=Axis(0, 8, 1), inp=along_in))
        return out

    def create_weights(self, layer: nn.Module) -> None:
        k = layer.in_features
        if k % 32 or layer.out_features % 8:
            raise ValueError(f"int4: {layer.out_features} x {k} on this rank (the kernel takes input "
                             "features in 32s, output features in 8s)")
        for name, (shape, dtype, _) in self._layout(layer).items():
            layer.register_parameter(name, nn.Parameter(torch.empty(shape, dtype=dtype), requires_grad=False))

    def axes(self, layer, name):
        return self._layout(layer)[name][2]

    def param_name(self, attr, ids):
        # not stored: the shape before packing; GPTQ's g_idx without act-order (column k is
        # in group k // group_size)
        if attr == "weight_shape" or (attr == "g_idx" and not self.spec.act_order):
            return None
        return attr

    # ------------------------------------------------------------ the kernel's layout

    def finish(self, layer: nn.Module) -> None:
        spec = self.spec
        p = layer._parameters
        n, k = layer.out_features, layer.in_features
        if spec.format == "gptq":
            q = _nibbles(p["qweight"].t()).view(n, k)  # [out, in]
            zeros = _nibbles(p["qzeros"]).float().t() + spec.zero_offset  # [out, groups]
            scales = p["scales"].t()
        elif spec.format == "awq":
            order = torch.tensor(AWQ_ORDER)
            q = _nibbles(p["qweight"]).view(k, n // 8, 8)[:, :, order].reshape(k, n).t()
            zeros = _nibbles(p["qzeros"]).view(-1, n // 8, 8)[:, :, order].reshape(-1, n).float().t()
            scales = p["scales"].t()
        else:
            q = _nibbles(p["weight_packed"]).view(n, k)
            scales = p["weight_scale"]
            zeros = (torch.full_like(scales, 8.0) if spec.symmetric else
                     _nibbles(p["weight_zero_point"].t()).view(scales.shape[1], -1)[:, :n].t().float())
        perm = None
        group = k if spec.group_size <= 0 else spec.group_size
        if spec.format == "gptq" and spec.act_order:
            perm, q, scales, zeros, group = self._sort_groups(p["g_idx"], q, scales, zeros)
        if group % 32:
            raise ValueError(f"int4: groups of {group} input columns on this rank (the kernel takes 32s)")
        for name in list(p):
            if name != "bias":
                del p[name]
        layer.qs = nn.Parameter(pack_nibbles(q.contiguous()), requires_grad=False)
        layer.group_scales = nn.Parameter(scales.float().contiguous(), requires_grad=False)
        layer.group_zeros = nn.Parameter(zeros.float().contiguous(), requires_grad=False)
        if perm is not None:
            layer.perm = nn.Parameter(perm, requires_grad=False)
        self.group = group

    @staticmethod
    def _sort_groups(g_idx, q, scales, zeros):
        """Act-order: input columns sorted by group, so each group is one contiguous run;
        (the permutation x takes, q, scales, zeros and group size in that order)."""
        perm = torch.argsort(g_idx.long(), stable=True)
        order = g_idx.long()[perm]
        counts = torch.bincount(order)
        counts = counts[counts > 0]
        if (counts != counts[0]).any():
            raise ValueError("GPTQ act-order: this rank's input columns hold groups of different sizes "
                             f"({sorted(set(counts.tolist()))}); serve it on fewer tensor-parallel ranks")
        group = int(counts[0])
        chunks = order[::group]
        return perm, q[:, perm], scales[:, chunks], zeros[:, chunks], group

    def apply(self, layer, x, bias):
        if getattr(layer, "perm", None) is not None:
            x = x.index_select(1, layer.perm)
        x = x.contiguous()
        y = x.new_empty((x.shape[0], layer.out_features))
        k = kernels.load() if kernels.applies(x) else None
        if k is not None:
            k.int4_linear(x, layer.qs, layer.group_scales, layer.group_zeros, self.group, y)
        else:
            for a in range(0, layer.out_features, SLAB):
                w = dequantize(layer.qs[a:a + SLAB], layer.group_scales[a:a + SLAB],
                               layer.group_zeros[a:a + SLAB], self.group).to(x.dtype)
                y[:, a:a + w.shape[0]] = layer.tp.numerics.linear(x, w)
        return y if bias is None else y.add_(bias)

    def probes(self, layer):
        key = ("int4", layer.out_features, layer.in_features, self.group)
        return [Probe(key, layer.in_features, lambda x: self.apply(layer, x, None))]

    def nbytes(self, layer):
        return sum(getattr(layer, n).numel() * getattr(layer, n).element_size()
                   for n in _STORED if getattr(layer, n, None) is not None)
