"""Checkpoints for the comparison: the tiny model, and a ~100M-parameter Llama with random
weights (real files, because vLLM needs them) that reuses the tiny model's tokenizer.

Imports torch/transformers lazily: only the benchmark's own build step needs them.
"""

from __future__ import annotations

import shutil
from pathlib import Path

LLAMA_100M = dict(hidden_size=768, intermediate_size=2048, num_hidden_layers=12,
                  num_attention_heads=12, num_key_value_heads=12, max_position_embeddings=2048,
                  rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=True)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "chat_template.jinja", "generation_config.json")


def build_tiny(root: Path) -> Path:
    from gpu_worker.tiny_model import build_tiny_model

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
