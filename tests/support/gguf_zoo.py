"""Tiny GGUF files, written here with llama.cpp's own writer (``gguf.GGUFWriter``) the way
``convert_hf_to_gguf.py`` writes real ones, for parity tests against transformers' GGUF
loader on the same file (nothing is downloaded).

A tiny random HF model of the architecture (transformers' own classes, ``model_zoo``'s
perturbed weights) is converted as llama.cpp converts: llama q/k rows permuted for its
adjacent-pair RoPE, Gemma norms stored as ``1 + w``, matrices quantized with
``gguf.quants.quantize`` (deterministic). gguf-py cannot quantize the K types (it only
dequantizes them), so Q4_K/Q5_K/Q6_K blocks are random bytes with finite, small fp16
scales: every bit pattern a block can hold, read by both sides the same way.

The tokenizer is the project's tiny byte-level BPE as a GGUF ``gpt2`` vocabulary (control
tokens type 3, the tool tokens user-defined, type 4), with the tiny model's chat template
or one named by ``template``.

Sizes follow what transformers' GGUF loader reads: it maps no head size for Qwen 3 and no
query scale for Gemma, so those models take its config classes' defaults (head_dim 128,
query_pre_attn_scalar 256), and so do ours.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import gguf
import numpy as np
import torch
from gguf import GGMLQuantizationType as T

from tests.support import model_zoo

VOCAB = 2048
_BASE = dict(vocab_size=VOCAB, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, head_dim=64, max_position_embeddings=512,
             rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=False)
# GGUF architecture -> (transformers config class, model class, config beyond _BASE)
ARCHS: dict[str, tuple[str, str, dict]] = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", {}),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", dict(tie_word_embeddings=True)),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", dict(head_dim=128)),
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM",
               dict(num_attention_heads=2, num_key_value_heads=1, head_dim=256, query_pre_attn_scalar=256,
                    sliding_window=24, attn_logit_softcapping=50.0, final_logit_softcapping=30.0,
                    hidden_activation="gelu_pytorch_tanh", tie_word_embeddings=True)),
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM",
               dict(num_hidden_layers=6, num_attention_heads=2, num_key_value_heads=1, head_dim=256,
                    query_pre_attn_scalar=256, sliding_window=24, rope_theta=1000000.0,
                    hidden_activation="gelu_pytorch_tanh", tie_word_embeddings=True)),
}
K_TYPES = (T.Q4_K, T.Q5_K, T.Q6_K)
# a K block's fp16 scale fields (byte offset, value): d and dmin such that values centre on 0
_K_SCALES = {T.Q4_K: ((0, 1e-3), (2, 7.5e-3)), T.Q5_K: ((0, 5e-4), (2, 7.75e-3)), T.Q6_K: ((208, 2e-4),)}


def hf_model(arch: str):
    """The tiny random HF model of ``arch`` (fp32, model_zoo's perturbation)."""
    import transformers

    cfg_cls, model_cls, extra = ARCHS[arch]
    config = getattr(transformers, cfg_cls)(**{**_BASE, **extra, "bos_token_id": 0, "eos_token_id": 4,
                                              "pad_token_id": 5})
    torch.manual_seed(0)
    model = getattr(transformers, model_cls)(config).to(torch.float32)
    model_zoo.perturb(model, embed_std=model_zoo.STD / 8 if arch.startswith("gemma") else None)
    return model


def _tokens():
    """The tiny tokenizer as GGUF gpt2 vocabulary fields."""
    from launcher import tiny_model

    tok = tiny_model.build_tokenizer()
    backend = json.loads(tok.backend_tokenizer.to_str())
    vocab = tok.backend_tokenizer.get_vocab(with_added_tokens=True)
    tokens = [t for t, _ in sorted(vocab.items(), key=lambda kv: kv[1])]
    assert len(tokens) == VOCAB
    merges = [m if isinstance(m, str) else " ".join(m) for m in backend["model"]["merges"]]
    kinds = {t: 3 for t in tiny_model.SPECIAL_TOKENS} | {t: 4 for t in tiny_model.TOOL_TOKENS}
    ids = tok.convert_tokens_to_ids
    return (tokens, merges, [kinds.get(t, 1) for t in tokens], ids(tiny_model.BOS), ids(tiny_model.EOT),
            ids(tiny_model.PAD), tiny_model.CHAT_TEMPLATE.read_text(encoding="utf-8"))


def _permute(w: np.ndarray, heads: int) -> np.ndarray:
    """convert_hf_to_gguf.py's LlamaModel.permute (q/k rows for adjacent-pair RoPE)."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _blocks(w: np.ndarray, qtype: T, rng: np.random.Generator) -> np.ndarray:
    """``w`` as ``qtype`` blocks: quantized by gguf where it can; else random bytes (K
    types: with their scales set; any other type: a file the loader must refuse)."""
    if qtype not in K_TYPES:
        try:
            return gguf.quants.quantize(w, qtype)
        except NotImplementedError:
            pass
    raw = rng.integers(0, 256, gguf.quants.quant_shape_to_byte_shape(w.shape, qtype), dtype=np.uint8)
    blocks = raw.reshape(-1, gguf.GGML_QUANT_SIZES[qtype][1])
    for offset, scale in _K_SCALES.get(qtype, ()):
        blocks[:, offset:offset + 2] = np.array([scale], np.float16).view(np.uint8)
    return raw


def write(path: Path, arch: str, weight_type: T, *, embed_type: T | None = None, template: str | None = None,
          mixed_q6k: bool = False, extra_metadata: dict | None = None,
          edit: Callable[[str, T, np.ndarray], tuple[str, T, np.ndarray] | None] | None = None) -> Path:
    """Write ``arch`` with its matrices in ``weight_type`` (the embedding in
    ``embed_type``, default the same; ``mixed_q6k``: down projections and the output in
    Q6_K, as Ollama's Q4_K_M mixes) to ``path``. ``edit(gguf_name, type, values)``
    may rename, retype, reshape (None: drop) a tensor: a bad file."""
    model = hf_model(arch)
    cfg = model.config
    tokens, merges, kinds, bos, eos, pad, tiny_template = _tokens()
    w = gguf.GGUFWriter(str(path), arch)
    w.add_name(f"tiny-{arch}")
    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_key_length(cfg.head_dim)
    w.add_value_length(cfg.head_dim)
    w.add_rope_dimension_count(cfg.head_dim)
    w.add_rope_freq_base(cfg.rope_parameters["rope_theta"] if arch != "gemma3"
                         else cfg.rope_parameters["full_attention"]["rope_theta"])
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_vocab_size(cfg.vocab_size)
    if arch.startswith("gemma"):
        w.add_sliding_window(cfg.sliding_window)
    if arch == "gemma2":
        w.add_attn_logit_softcapping(cfg.attn_logit_softcapping)
        w.add_final_logit_softcapping(cfg.final_logit_softcapping)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types(kinds)
    w.add_token_merges(merges)
    w.add_bos_token_id(bos)
    w.add_eos_token_id(eos)
    w.add_pad_token_id(pad)
    w.add_add_bos_token(True)
    w.add_chat_template(template if template is not None else tiny_template)
    for key, value in (extra_metadata or {}).items():
        w.add_key_value(key, value, gguf.GGUFValueType.get_type(value))

    names = gguf.get_tensor_name_map(next(a for a, n in gguf.MODEL_ARCH_NAMES.items() if n == arch),
                                     cfg.num_hidden_layers)  # llama.cpp's own HF -> GGUF table
    rng = np.random.default_rng(0)
    for hf_name, tensor in model.state_dict().items():
        if hf_name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        base, _, suffix = hf_name.rpartition(".")
        data = tensor.detach().numpy().astype(np.float32)
        if arch == "llama" and ".q_proj." in hf_name:
            data = _permute(data, cfg.num_attention_heads)
        elif arch == "llama" and ".k_proj." in hf_name:
            data = _permute(data, cfg.num_key_value_heads)
        if arch.startswith("gemma") and hf_name.endswith("norm.weight"):
            data = data + 1.0
        qtype = T.F32
        if data.ndim == 2:
            qtype = (embed_type or weight_type) if "embed_tokens" in hf_name else weight_type
            if mixed_q6k and ("down_proj" in hf_name or hf_name == "lm_head.weight"):
                qtype = T.Q6_K
        name = f"{names.get_name(base)}.{suffix}"
        if edit is not None:
            edited = edit(name, qtype, data)
            if edited is None:
                continue
            name, qtype, data = edited
        if qtype == T.F32:
            w.add_tensor(name, data)
        elif qtype == T.F16:
            w.add_tensor(name, data.astype(np.float16))
        else:
            w.add_tensor(name, _blocks(data, qtype, rng), raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def transformers_model(path: Path):
    """transformers' GGUF loader on ``path``: the reference (fp32, never stops early)."""
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None
    return model
