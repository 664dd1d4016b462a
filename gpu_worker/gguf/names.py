"""Which GGUF tensor is which HF parameter, and what llama.cpp's converter changed.

The names come from gguf's own table (``gguf.get_tensor_name_map``: HF module name ->
GGUF name, per architecture), inverted over the HF modules our decoder has, so a
Gemma ``blk.N.ffn_norm`` is ``pre_feedforward_layernorm`` while a Llama one is
``post_attention_layernorm``, as llama.cpp's converter wrote them.

Two changes of ``convert_hf_to_gguf.py`` are undone (transformers' GGUF loader undoes
the same ones): Llama-architecture files store q and k with each head's rows
interleaved for llama.cpp's adjacent-pair RoPE (``row_order``), and Gemma files store
every norm weight as ``1 + w`` (``value_offset``).

Torch-free: the launcher checks a file's tensors against its config with it.
"""

from __future__ import annotations

from functools import lru_cache

import numpy as np
from gguf import MODEL_ARCH_NAMES, get_tensor_name_map

from gpu_worker.model_config import ModelConfig

_MODEL_MODULES = ("model.embed_tokens", "model.norm", "lm_head")
_LAYER_MODULES = ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
                  "post_feedforward_layernorm", "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj",
                  "self_attn.o_proj", "self_attn.q_norm", "self_attn.k_norm", "mlp.gate_proj", "mlp.up_proj",
                  "mlp.down_proj")
_ARCH_IDS = {name: arch for arch, name in MODEL_ARCH_NAMES.items()}
_PERMUTED_ARCHS = {"llama"}  # convert_hf_to_gguf.py's LlamaModel.permute
_SHIFTED_NORM_ARCHS = {"gemma2", "gemma3"}  # Gemma*Model: norm weights + 1


@lru_cache(maxsize=16)
def gguf_to_hf(arch: str, n_layers: int) -> dict[str, str]:
    """GGUF tensor name without its .weight/.bias -> the HF module it was converted from."""
    table = get_tensor_name_map(_ARCH_IDS[arch], n_layers)
    out: dict[str, str] = {}
    modules = list(_MODEL_MODULES) + [f"model.layers.{i}.{m}" for i in range(n_layers) for m in _LAYER_MODULES]
    for module in modules:
        name = table.get_name(module)
        if name is not None:
            out.setdefault(name, module)
    return out


def hf_name(arch: str, n_layers: int, gguf_name: str) -> str | None:
    """``blk.0.attn_q.weight`` -> ``model.layers.0.self_attn.q_proj.weight`` (None: no HF
    parameter of ours)."""
    base, dot, suffix = gguf_name.rpartition(".")
    if suffix not in ("weight", "bias"):
        return None
    module = gguf_to_hf(arch, n_layers).get(base)
    return None if module is None else f"{module}{dot}{suffix}"


def row_order(arch: str, name: str, cfg: ModelConfig) -> np.ndarray | None:
    """For a Llama-architecture q or k projection (weight or bias), the GGUF row each HF
    row is: llama.cpp's converter grouped each head's rows as (half, pair), HF keeps
    (pair, half). None: the rows are in HF's order already."""
    if arch not in _PERMUTED_ARCHS:
        return None
    if ".self_attn.q_proj." in name:
        heads = cfg.num_heads
    elif ".self_attn.k_proj." in name:
        heads = cfg.num_kv_heads
    else:
        return None
    half = cfg.head_dim // 2
    return np.arange(heads * cfg.head_dim).reshape(heads, half, 2).swapaxes(1, 2).reshape(-1)


def value_offset(arch: str, name: str) -> float:
    """What to add to every value of tensor ``name`` (HF): -1 for a Gemma norm weight."""
    return -1.0 if arch in _SHIFTED_NORM_ARCHS and name.endswith("norm.weight") else 0.0


def expected_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every HF tensor a checkpoint of ``cfg`` holds, with its shape (dense decoders with
    pre-norm or sandwich layers: the families GGUF files are served for)."""
    h, v, hd, inter = cfg.hidden_size, cfg.vocab_size, cfg.head_dim, cfg.intermediate_size
    out: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (v, h), "model.norm.weight": (h,)}
    if not cfg.tie_word_embeddings:
        out["lm_head.weight"] = (v, h)
    norms = ["input_layernorm", "post_attention_layernorm"]
    if cfg.norm_placement == "sandwich":
        norms += ["pre_feedforward_layernorm", "post_feedforward_layernorm"]
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        out.update({f"{p}{n}.weight": (h,) for n in norms})
        for proj, rows in (("q", cfg.q_size), ("k", cfg.kv_size), ("v", cfg.kv_size)):
            out[f"{p}self_attn.{proj}_proj.weight"] = (rows, h)
            if cfg.qkv_bias:
                out[f"{p}self_attn.{proj}_proj.bias"] = (rows,)
        out[f"{p}self_attn.o_proj.weight"] = (h, cfg.q_size)
        if cfg.o_bias:
            out[f"{p}self_attn.o_proj.bias"] = (h,)
        if cfg.qk_norm == "head":
            out[f"{p}self_attn.q_norm.weight"] = out[f"{p}self_attn.k_norm.weight"] = (hd,)
        out[f"{p}mlp.gate_proj.weight"] = out[f"{p}mlp.up_proj.weight"] = (inter, h)
        out[f"{p}mlp.down_proj.weight"] = (h, inter)
        if cfg.mlp_bias:
            for proj, rows in (("gate", inter), ("up", inter), ("down", h)):
                out[f"{p}mlp.{proj}_proj.bias"] = (rows,)
    return out
