"""A decoder layer's forward as a flat run of kernel calls: the CPU's counterpart of a
CUDA graph.

Why: at batch 1 a small model's step is mostly Python between its kernels. SmolLM2-135M
on one core spent ~13.4 ms a step, ~9 of them in matmuls reading the weights; a layer's
modules (eight ``nn.Module`` calls, each layer's checks of dtype, strides and switches,
attribute lookups through ``nn.Module.__getattr__``, a quantized method looking its
tensors up) cost ~65 us of 30 layers' ~300. A program looks all of that up once, when
it is built, and calls the same kernels in the same order with the same arguments, so
its results are the modules' bits exactly (``tests/unit/gpu_worker/test_layer_program.py``
holds it to that): the step went 13.4 -> 11.2 ms. Where every layer's program calls only
kernels C++ can reach (packed GGUF), ``layer_loop`` runs all of them in one call.

A layer's ``program()`` returns a function with the layer module's signature, ``(x,
cos_sins, kv_cache, meta) -> x``, or why it cannot: programs cover what the real
checkpoints we serve on CPU use (a pre-norm layer, plain RMS norms, q|k|v without q/k
norms under RoPE, SiLU-gated MLP, one tensor-parallel rank, float32 on CPU with the row
kernels); any other layer keeps its module. A program runs a layer's linear layers
through their method's ``bind`` and never through a LoRA hook: the caller runs the
modules for a step with adapter rows (``DecoderForCausalLM.forward``'s ``flat``).
Forward hooks see modules only, so a profiler that hooks them runs the modules too.
"""

from __future__ import annotations

from typing import Callable

import torch

from gpu_worker.models import row_ops
from gpu_worker.models.blocks import RMSNorm

LayerStep = Callable  # (x, cos_sins, kv_cache, meta) -> x, as a decoder layer module


def prenorm_program(layer) -> LayerStep | str:
    """A ``PreNormLayer``'s forward as one flat function, or the reason it keeps its module
    (the layer asks: ``DecoderLayer.program``)."""
    attn, mlp = layer.self_attn, layer.mlp
    why = ("a residual scale" if layer.residual_scale != 1.0
           else "a norm other than a plain RMS norm" if not all(
               type(n) is RMSNorm and not n.one_plus for n in (layer.input_layernorm, layer.post_attention_layernorm))
           else "q/k norms or no RoPE" if attn.qk_norm != "none" or attn.rope is None
           else "an MLP other than SiLU-gated" if (getattr(mlp, "gate_up_proj", None) is None
                                                   or mlp.act_name != "silu")
           else "tensor parallelism" if attn.qkv_proj.tp.size != 1
           else "not float32 on CPU" if not (layer.input_layernorm.weight.is_cpu
                                             and layer.input_layernorm.weight.dtype == torch.float32)
           else "the row kernels could not be built" if row_ops.load() is None
           else None)
    if why is not None:
        return why
    kernels = row_ops.load()
    rms_norm, add_rms_norm, rope_qkv, silu_mul = (kernels.rms_norm, kernels.add_rms_norm, kernels.rope_qkv,
                                                  kernels.silu_mul)
    qkv_proj, o_proj = attn.qkv_proj.method.bind(attn.qkv_proj), attn.o_proj.method.bind(attn.o_proj)
    gate_up_proj, down_proj = mlp.gate_up_proj.method.bind(mlp.gate_up_proj), mlp.down_proj.method.bind(mlp.down_proj)
    norm1, eps1 = layer.input_layernorm.weight, layer.input_layernorm.eps
    norm2, eps2 = layer.post_attention_layernorm.weight, layer.post_attention_layernorm.eps
    heads, kv_heads, q_size, rope, window, softcap = (attn.num_heads, attn.num_kv_heads, attn.q_size, attn.rope,
                                                      attn.window, attn.softcap)
    inter = mlp.intermediate_size

    def step(x: torch.Tensor, cos_sins, kv_cache, meta) -> torch.Tensor:
        # PreNormLayer: x + mlp(norm2(x + attn(norm1(x)))), the residual adds in place
        cos, sin = cos_sins[rope]
        q, k, v = rope_qkv(qkv_proj(rms_norm(x, norm1, eps1)), cos, sin, heads, kv_heads)
        attended = meta.attend(q, k, v, kv_cache[0], kv_cache[1], window, softcap)
        h = add_rms_norm(x, o_proj(attended.view(x.shape[0], q_size)), 1.0, norm2, eps2)
        return x.add_(down_proj(silu_mul(gate_up_proj(h), inter)))

    return step
