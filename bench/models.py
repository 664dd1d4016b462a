"""Checkpoints for the comparison: the tiny model, and a ~100M-parameter Llama with random
weights (real files, because vLLM needs them) that reuses the tiny model's tokenizer.

Imports torch/transformers lazily: only the benchmark's own build step needs them.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

LLAMA_100M = dict(hidden_size=768, intermediate_size=2048, num_hidden_layers=12,
                  num_attention_heads=12, num_key_value_heads=12, max_position_embeddings=2048,
                  rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=True)
# Llama-3-8B's shapes (random weights via --load-format dummy: only config.json is read).
LLAMA3_8B = dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                 num_attention_heads=32, num_key_value_heads=8, vocab_size=128256,
                 max_position_embeddings=8192, rms_norm_eps=1e-5, rope_theta=500000.0,
                 tie_word_embeddings=False)
# A small GQA model with head_dim 128 and 4 query heads per KV head: flashinfer's
# tensor-core decode and the 8B's kernel shapes, at a size HF runs in seconds.
GQA_HD128 = dict(hidden_size=1024, intermediate_size=2816, num_hidden_layers=4,
                 num_attention_heads=8, num_key_value_heads=2, head_dim=128,
                 max_position_embeddings=2048, rms_norm_eps=1e-5, rope_theta=10000.0,
                 tie_word_embeddings=True)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "chat_template.jinja", "generation_config.json")


def build_tiny(root: Path) -> Path:
    from launcher.tiny_model import build_tiny_model

    path = root / "tiny-llama"
    if not (path / "config.json").exists():
        build_tiny_model(path)
    return path


def build_tiny_hd64(root: Path, tiny: Path) -> Path:
    """The tiny checkpoint's shape (hidden 64, 4 layers) with one 64-wide attention head:
    vLLM's CPU attention rejects the tiny model's head_dim 16."""
    return _build_random(root / "tiny-hd64", tiny, dict(
        hidden_size=64, intermediate_size=192, num_hidden_layers=4, num_attention_heads=1,
        num_key_value_heads=1, head_dim=64, max_position_embeddings=2048, rms_norm_eps=1e-5,
        rope_theta=10000.0, tie_word_embeddings=True))


def build_llama_100m(root: Path, tiny: Path) -> Path:
    """Random (seeded) weights in float32 safetensors, the tiny checkpoint's tokenizer."""
    return _build_random(root / "llama-100m", tiny, LLAMA_100M)


def build_gqa_hd128(root: Path, tiny: Path) -> Path:
    return _build_random(root / "gqa-hd128", tiny, GQA_HD128)


def build_llama3_8b_dummy(root: Path, tiny: Path) -> Path:
    """config.json of Llama-3-8B's shape in bf16 (serve it with ``--load-format dummy``)
    and the tiny tokenizer widened to the 128256-id vocabulary: every id the random model
    samples then decodes to some text (" w<id>"), so TTFT/ITL, measured on text frames,
    stay meaningful. Prompts tokenize as with the tiny tokenizer: the merges are the same."""
    path = root / "llama3-8b-dummy"
    if (path / "config.json").exists():
        return path
    path.mkdir(parents=True, exist_ok=True)
    tiny_cfg = json.loads((tiny / "config.json").read_text())
    cfg = dict(architectures=["LlamaForCausalLM"], model_type="llama", hidden_act="silu",
               torch_dtype="bfloat16", bos_token_id=tiny_cfg.get("bos_token_id"),
               eos_token_id=tiny_cfg.get("eos_token_id"), **LLAMA3_8B)
    (path / "config.json").write_text(json.dumps(cfg, indent=2))
    for name in TOKENIZER_FILES:
        if (tiny / name).exists():
            shutil.copy(tiny / name, path / name)
    tok = json.loads((tiny / "tokenizer.json").read_text())
    vocab = tok["model"]["vocab"]
    for added in tok.get("added_tokens", []):  # else tokenizers renumbers them past the end
        vocab.setdefault(added["content"], added["id"])
    taken = set(vocab.values())
    for i in range(LLAMA3_8B["vocab_size"]):
        if i not in taken:
            vocab[f"\u0120w{i}"] = i  # byte-level "Ġ" = a leading space
    (path / "tokenizer.json").write_text(json.dumps(tok, ensure_ascii=False))
    return path


def _build_random(path: Path, tiny: Path, shape: dict) -> Path:
    if (path / "config.json").exists():
        return path
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    tiny_cfg = LlamaConfig.from_pretrained(tiny)
    cfg = LlamaConfig(vocab_size=tiny_cfg.vocab_size, bos_token_id=tiny_cfg.bos_token_id,
                      eos_token_id=tiny_cfg.eos_token_id, **shape)
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg).to(torch.float32)
    model.save_pretrained(path, safe_serialization=True)
    for name in TOKENIZER_FILES:
        if (tiny / name).exists() and not (path / name).exists():
            shutil.copy(tiny / name, path / name)
    return path


# Same width and depth for the architecture comparison: a dense Llama, a Qwen3 (q/k norms)
# and a Qwen3-MoE whose 8 experts (top-2) each have a quarter of the dense MLP's width, so a
# token's active MLP FLOPs are half the dense model's while the weights are 2x.
ARCH_WIDTH = dict(hidden_size=256, num_hidden_layers=4, num_attention_heads=8,
                  num_key_value_heads=4, head_dim=32, max_position_embeddings=2048,
                  rms_norm_eps=1e-6, rope_theta=10000.0, tie_word_embeddings=True)
ARCH_SHAPES = {
    "llama-256": ("LlamaConfig", "LlamaForCausalLM", dict(intermediate_size=1024)),
    "qwen3-256": ("Qwen3Config", "Qwen3ForCausalLM", dict(intermediate_size=1024)),
    "qwen3moe-256": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM",
                     dict(intermediate_size=1024, moe_intermediate_size=256, num_experts=8,
                          num_experts_per_tok=2, norm_topk_prob=True, decoder_sparse_step=1)),
}


def build_arch(root: Path, tiny: Path, name: str) -> Path:
    """One of ``ARCH_SHAPES`` with random (seeded) weights and the tiny tokenizer."""
    path = root / name
    if (path / "config.json").exists():
        return path
    import torch
    import transformers

    cfg_cls, model_cls, extra = ARCH_SHAPES[name]
    tiny_cfg = json.loads((tiny / "config.json").read_text())
    cfg = getattr(transformers, cfg_cls)(vocab_size=tiny_cfg["vocab_size"],
                                         bos_token_id=tiny_cfg.get("bos_token_id"),
                                         eos_token_id=tiny_cfg.get("eos_token_id"),
                                         **ARCH_WIDTH, **extra)
    torch.manual_seed(0)
    model = getattr(transformers, model_cls)(cfg).to(torch.float32)
    model.save_pretrained(path, safe_serialization=True)
    for name_ in TOKENIZER_FILES:
        if (tiny / name_).exists() and not (path / name_).exists():
            shutil.copy(tiny / name_, path / name_)
    return path


def num_params(path: Path) -> int:
    from safetensors import safe_open

    total = 0
    for f in sorted(path.glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as st:
            for k in st.keys():
                shape = st.get_slice(k).get_shape()
                n = 1
                for d in shape:
                    n *= d
                total += n
    return total
