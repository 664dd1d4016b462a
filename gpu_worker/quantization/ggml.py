"""GGUF weights kept in their GGML blocks (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q4_K, Q5_K, Q6_K).

The contract with a GGUF reader: each quantized tensor arrives as its type, its logical
shape ``[out_features, in_features]`` and its raw blocks, a uint8 tensor of
``out_features`` rows exactly as the file stores them (what ``gguf.quants.quantize``
writes); the reader names the types per tensor in ``GgmlSpec.tensor_types`` and hands
each tensor to the layer's ``weight_loader`` like any other (``CheckpointTensor``).

A layer keeps the blocks as they are (``weight`` [rows, in / block * bytes]): a
column-parallel rank holds its rows of blocks, a row-parallel one its run of whole
blocks along the input (a split inside a block is refused). A fused layer whose parts
came in different types (Q4_K_M gives ``attn_v`` Q6_K beside Q4_K q and k) keeps each
part apart (``weight_q`` ...) and writes each part's output columns in place.
The embedding table and LM head stay in blocks too: lookups dequantize the rows asked
for, logits run the same kernel.

Compute: ``quant_linear.cpp`` dequantizes inside the matmul (never the whole weight), or,
for Q4_0 / Q4_1 / Q8_0 on a CPU with AVX-512 VNNI (AMX tiles for more than 8 rows), never
dequantizes: x becomes integer digits per block and the codes' products are exact
integer sums, so a row's bits are the same at any batch size there too (a CPU without
VNNI computes other, equally invariant bits: replicas should share a CPU kind). Those
three are rearranged once loaded (``finish``) into the kernel's packed layout: the same
bytes, tiles of 16 rows in the order the vector loads read them (lookups unpack the rows
asked for);
without it, ``gguf.quants.dequantize`` (llama.cpp's numpy code, the same values) turns a
slab of ``SLAB`` rows at a time into floats for a dense matmul through ``Numerics``.
"""

from __future__ import annotations

import functools

import numpy as np
import torch
from torch import nn

from gpu_worker.batch_invariant import Probe
from gpu_worker.models.linear_method import Axes, Axis, LinearMethod
from gpu_worker.models.weights import CheckpointTensor
from gpu_worker.quantization import kernels
from gpu_worker.quantization.spec import GGML_TYPES

SLAB = 256  # rows dequantized at a time by the torch path


def dequantize(raw: torch.Tensor, type_name: str, in_features: int) -> torch.Tensor:
    """Rows of GGML blocks -> float32 [rows, in_features] (the kernel, or gguf's numpy)."""
    type_id = GGML_TYPES[type_name][0]
    k = kernels.load() if raw.device.type == "cpu" else None
    if k is not None:
        return k.ggml_dequantize(raw.contiguous(), type_id, in_features)
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize as gguf_dequantize
    rows = gguf_dequantize(np.ascontiguousarray(raw.cpu().numpy()), GGMLQuantizationType(type_id))
    return torch.from_numpy(rows.reshape(raw.shape[0], in_features)).to(raw.device)


class GgmlLinear(LinearMethod):
    """One layer's GGML blocks: ``types`` per part (None: the whole layer, one type)."""

    name = "gguf"

    def __init__(self, types: dict) -> None:
        self.types = types
        self.segments: list[tuple[str, str, int, int]] = []  # (tensor, type, first row, rows)
        self.packed: set[str] = set()  # tensors held in the kernel's packed layout (finish)
        self._kernels = None  # the kernels that packed them (they unpack rows too)

    def create_weights(self, layer: nn.Module) -> None:
        if len(set(self.types.values())) == 1:
            parts = {None: (0, layer.out_features)}
            names = {None: "weight"}
            types = {None: next(iter(self.types.values()))}
        else:
            parts = layer.part_rows()
            names = {p: f"weight_{p}" for p in parts}
            types = self.types
        for part, (start, rows) in parts.items():
            type_name = types[part]
            _, block, nbytes = GGML_TYPES[type_name]
            if layer.in_features % block:
                raise ValueError(f"{layer.in_features} input features (this rank's) cut a {type_name} "
                                 f"block of {block}: a tensor-parallel split must hold whole blocks")
            layer.register_parameter(names[part], nn.Parameter(
                torch.empty(rows, layer.in_features // block * nbytes, dtype=torch.uint8), requires_grad=False))
            self.segments.append((names[part], type_name, start, rows))

    def axes(self, layer, name):
        for tensor, type_name, start, _ in self.segments:
            if tensor == name:
                _, block, nbytes = GGML_TYPES[type_name]
                return Axes(out=Axis(0, offset=start), inp=Axis(1, block, nbytes))
        raise KeyError(name)

    def source(self, layer, attr, ids, source):
        """A GGUF file's tensor as its raw blocks (a file that stores the blocks as they
        are, as the tests' safetensors do, is read as it is)."""
        blocks = getattr(source.file, "blocks", None)
        if attr == "bias" or blocks is None:
            return source
        return CheckpointTensor(blocks(), source.name)

    def param_name(self, attr, ids):
        if attr == "weight" and self.segments[0][0] != "weight":
            return f"weight_{ids[0]}"
        return attr

    def finish(self, layer) -> None:
        """Q4_0 / Q4_1 / Q8_0 on a CPU with the integer kernels: each tensor rearranged once
        into the kernel's packed layout (the same bytes, each tile of 16 rows' blocks in the
        order its vector loads read them), which streams at batch 1 without a gather per
        vector. The outputs are the same bits as from the GGML rows."""
        k = self._kernels = kernels.load()
        if k is None:
            return
        for tensor, type_name, _, _ in self.segments:
            raw = getattr(layer, tensor)
            type_id = GGML_TYPES[type_name][0]
            if tensor not in self.packed and raw.device.type == "cpu" and k.ggml_packs(type_id):
                setattr(layer, tensor, nn.Parameter(k.ggml_pack(raw.data, type_id), requires_grad=False))
                self.packed.add(tensor)

    def _rows(self, layer, tensor: str, type_name: str, rows: int, ids: torch.Tensor | None = None) -> torch.Tensor:
        """GGML rows ``ids`` (all when None) of a stored tensor, packed or not."""
        held = getattr(layer, tensor)
        if tensor not in self.packed:
            return held if ids is None else held.index_select(0, ids)
        ids = torch.arange(rows) if ids is None else ids
        return self._kernels.ggml_unpack_rows(held, GGML_TYPES[type_name][0], ids, rows, layer.in_features)

    def apply(self, layer, x, bias):
        y = x.new_empty((x.shape[0], layer.out_features))
        k = kernels.load() if kernels.applies(x) else None
        x = x.contiguous()
        for tensor, type_name, start, rows in self.segments:
            out = y if rows == layer.out_features else y[:, start:start + rows]  # (a slice costs a call)
            if k is not None and tensor in self.packed:
                k.ggml_linear_packed(x, getattr(layer, tensor), GGML_TYPES[type_name][0], rows, out)
                continue
            if k is not None:
                k.ggml_linear(x, getattr(layer, tensor), GGML_TYPES[type_name][0], out)
                continue
            raw = self._rows(layer, tensor, type_name, rows)
            for a in range(0, rows, SLAB):
                w = dequantize(raw[a:a + SLAB], type_name, layer.in_features).to(x.dtype)
                y[:, start + a:start + a + w.shape[0]] = layer.tp.numerics.linear(x, w)
        return y if bias is None else y.add_(bias)

    def packed_args(self, layer) -> tuple[torch.Tensor, int, int] | None:
        """(packed tensor, GGML type id, rows): what ``ggml_apply_packed`` takes before x,
        for a layer held as one packed tensor; else None."""
        if len(self.segments) != 1 or self.segments[0][0] not in self.packed:
            return None
        tensor, type_name, _, rows = self.segments[0]
        return getattr(layer, tensor).detach(), GGML_TYPES[type_name][0], rows

    def bind(self, layer):
        """One packed tensor: the kernel call alone (``apply`` looks its parts up per call)."""
        args = self.packed_args(layer)
        if args is None:
            return super().bind(layer)
        apply = functools.partial(self._kernels.ggml_apply_packed, *args)  # (x contiguous fp32 on CPU, or it raises)
        bias = layer.bias
        return apply if bias is None else lambda x: apply(x).add_(bias)

    def embed(self, layer, ids: torch.Tensor) -> torch.Tensor:
        tensor, type_name, _, rows = self.segments[0]
        blocks = self._rows(layer, tensor, type_name, rows, ids.reshape(-1))
        return dequantize(blocks, type_name, layer.in_features).view(*ids.shape, layer.in_features)

    def probes(self, layer):
        key = ("gguf", tuple((t, rows) for _, t, _, rows in self.segments), layer.in_features)
        return [Probe(key, layer.in_features, lambda x: self.apply(layer, x, None))]
