"""Every decoder layer in one C++ call (``layer_loop.cpp``), where each layer's flat
program (``layer_program``) would call nothing but kernels it can reach from C++.

Why: with the layers as flat programs a batch-1 SmolLM2 step still spent ~1.5 ms of its
~11 in Python between the kernels (about twenty calls a layer, each a few microseconds of
argument parsing, tensor wrapping and frames). The loop calls the same kernels with the
same arguments in the same order as the programs, so it gives their bits (and so the
modules'); it finds them through each kernel module's ``kernel_abi`` (address and exact
type) and refuses any whose type is not the one it casts to.

It runs a step where every layer is a program whose linear layers are GGUF tensors in
the packed layout (``GgmlLinear.bind``'s kernel call, then its bias if any), all layers rotate
by one RoPE table, and the attention is the batch-invariant kernel's (``InvariantStep``,
the deterministic mode, without bidirectional spans). Anything else keeps the programs.
"""

from __future__ import annotations

import functools
from pathlib import Path

import torch

from gpu_worker.attention import cpu_kernel_backend
from gpu_worker.attention.cpu_kernel_backend import InvariantStep
from gpu_worker.cpu_extension import build
from gpu_worker.models import row_ops
from gpu_worker.quantization import kernels as quant_kernels
from gpu_worker.quantization.ggml import GgmlLinear

_SOURCE = Path(__file__).with_name("layer_loop.cpp")
CFLAGS = ("-ffp-contract=off",)


@functools.cache
def load():
    """The compiled loop (``decoder_layers``, ``kernel_types``), or None."""
    return build(_SOURCE, ["decoder_layers", "kernel_types"], cflags=CFLAGS)


def _kernel_addresses(loop) -> list[int] | str:
    """The loop's kernels' addresses in its order, or why not (a module missing, or a
    kernel whose type differs from the one the loop casts it to)."""
    modules = {"row kernels": row_ops.load(), "quantized-matmul kernels": quant_kernels.load(),
               "attention kernel": cpu_kernel_backend.compiled()}
    missing = [name for name, module in modules.items() if module is None]
    if missing:
        return f"the {', '.join(missing)} could not be built"
    found = {name: entry for module in modules.values() for name, entry in module.kernel_abi().items()}
    addresses = []
    for name, wanted in loop.kernel_types():
        address, declared = found.get(name, (0, "(none)"))
        if "".join(declared.split()) != "".join(wanted.split()):
            return f"kernel {name} is {declared}, the loop calls {wanted}"
        addresses.append(address)
    return addresses


_NO_BIAS = torch.empty(0)


def _packed(layer) -> tuple[torch.Tensor, torch.Tensor, int, int] | None:
    """(packed tensor, bias or an empty tensor, GGML type id, rows) of a linear layer the
    loop can run (one packed GGUF tensor: ``GgmlLinear.packed_args``), else None."""
    args = layer.method.packed_args(layer) if isinstance(layer.method, GgmlLinear) else None
    if args is None:
        return None
    weight, type_id, rows = args
    return weight, _NO_BIAS if layer.bias is None else layer.bias.detach(), type_id, rows


class LayerLoop:
    """The layers' static arguments, gathered once; ``runs(meta)`` says whether a step can
    go through the loop, calling it runs every layer."""

    def __init__(self, loop, addresses: list[int], weights: list[torch.Tensor], ints: list[int],
                 reals: list[float], rope: int) -> None:
        self.loop, self.addresses, self.rope = loop, addresses, rope
        self.weights, self.ints, self.reals = weights, ints, reals

    @classmethod
    def build(cls, model) -> LayerLoop | str:
        """The loop over ``model``'s layers (each already a program: ``flatten``), or why not."""
        layers = model.model.layers
        if model.programs is None or any(p is m for p, m in zip(model.programs, layers)):
            return "a layer runs as its module"
        weights, ints, reals, ropes = [], [], [], set()
        for layer in layers:  # (each a pre-norm layer's program: prenorm_program checked the rest)
            attn, mlp = layer.self_attn, layer.mlp
            linears = [_packed(m) for m in (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)]
            if any(x is None for x in linears):
                return "a linear layer that is not one packed GGUF tensor"
            (qkv, qkv_b, qkv_type, qkv_n), (o, o_b, o_type, o_n), (gu, gu_b, gu_type, gu_n), \
                (down, down_b, down_type, down_n) = linears
            weights += [layer.input_layernorm.weight.detach(), qkv, qkv_b, o, o_b,
                        layer.post_attention_layernorm.weight.detach(), gu, gu_b, down, down_b]
            ints += [qkv_type, qkv_n, o_type, o_n, gu_type, gu_n, down_type, down_n, attn.num_heads,
                     attn.num_kv_heads, mlp.intermediate_size, attn.window or 0]
            reals += [layer.input_layernorm.eps, layer.post_attention_layernorm.eps, attn.softcap or 0.0]
            ropes.add(attn.rope)
        if len(ropes) != 1:
            return "layers rotate by different RoPE tables"
        loop = load()
        if loop is None:
            return "the loop could not be built"
        addresses = _kernel_addresses(loop)
        if isinstance(addresses, str):
            return addresses
        return cls(loop, addresses, weights, ints, reals, ropes.pop())

    @staticmethod
    def runs(meta) -> bool:
        return type(meta) is InvariantStep and not meta.spans

    def __call__(self, x: torch.Tensor, cos_sins, kv_caches, meta: InvariantStep) -> torch.Tensor:
        cos, sin = cos_sins[self.rope]
        return self.loop.decoder_layers(x, self.weights, self.ints, self.reals, [k for k, _ in kv_caches],
                                        [v for _, v in kv_caches], cos, sin,
                                        meta.tables, meta.row_seq, meta.lens, meta.slot_mapping, meta.scale,
                                        self.addresses)
