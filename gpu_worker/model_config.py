"""The slice of an HF ``config.json`` our Llama-family implementation needs.

Llama, Mistral and Qwen2 share one decoder shape; the differences that matter here are
linear biases, tied embeddings and the RoPE variant. Both the transformers 4 layout
(``rope_theta`` + ``rope_scaling``) and the transformers 5 one (``rope_parameters``) are
accepted. Anything we would silently get wrong (another activation, an unknown RoPE
type) is rejected at load time instead.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import msgspec

SUPPORTED_MODEL_TYPES = {"llama", "mistral", "qwen2"}
# "dynamic" NTK only rescales beyond max_position_embeddings, which max_model_len never
# exceeds, so inside our limits it equals the plain rotation (as in HF).
ROPE_TYPES = {"default", "linear", "dynamic", "llama3"}


class RopeConfig(msgspec.Struct, frozen=True):
    theta: float = 10000.0
    type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


class ModelConfig(msgspec.Struct, frozen=True):
    model_type: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float
    rope: RopeConfig
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    sliding_window: int | None = None  # None: full attention
    bos_token_id: int | None = None
    eos_token_ids: list[int] = []
    dtype: str = "float32"

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim


def _int_list(value: Any) -> list[int]:
    if value is None:
        return []
    return [int(v) for v in (value if isinstance(value, list) else [value])]


def _parse_rope(cfg: dict[str, Any]) -> RopeConfig:
    params = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    if params and all(isinstance(v, dict) for v in params.values()):
        raise ValueError("per-layer-type rope_parameters are not supported")
    rope_type = params.get("rope_type", params.get("type", "default")) or "default"
    if rope_type not in ROPE_TYPES:
        raise ValueError(f"unsupported rope type {rope_type!r} (supported: {sorted(ROPE_TYPES)})")
    theta = params.get("rope_theta", cfg.get("rope_theta", 10000.0))
    return RopeConfig(
        theta=float(theta),
        type=rope_type,
        factor=float(params.get("factor", 1.0)),
        low_freq_factor=float(params.get("low_freq_factor", 1.0)),
        high_freq_factor=float(params.get("high_freq_factor", 4.0)),
        original_max_position_embeddings=int(
            params.get("original_max_position_embeddings", cfg.get("max_position_embeddings", 8192))
        ),
    )


def parse_config(cfg: dict[str, Any], generation_cfg: dict[str, Any] | None = None) -> ModelConfig:
    """Build a ModelConfig from parsed config.json (and generation_config.json) dicts."""
    model_type = cfg.get("model_type", "llama")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(f"unsupported model_type {model_type!r} (supported: {sorted(SUPPORTED_MODEL_TYPES)})")
    act = cfg.get("hidden_act", "silu")
    if act != "silu":
        raise ValueError(f"unsupported hidden_act {act!r}")
    hidden = int(cfg["hidden_size"])
    heads = int(cfg["num_attention_heads"])
    is_qwen2 = model_type == "qwen2"
    attention_bias = bool(cfg.get("attention_bias", False))
    sliding = cfg.get("sliding_window")
    if is_qwen2 and not cfg.get("use_sliding_window", False):
        sliding = None
    gen_eos = _int_list((generation_cfg or {}).get("eos_token_id"))
    return ModelConfig(
        model_type=model_type,
        vocab_size=int(cfg["vocab_size"]),
        hidden_size=hidden,
        num_layers=int(cfg["num_hidden_layers"]),
        num_heads=heads,
        num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
        head_dim=int(cfg.get("head_dim") or hidden // heads),
        intermediate_size=int(cfg["intermediate_size"]),
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        rope=_parse_rope(cfg),
        max_position_embeddings=int(cfg.get("max_position_embeddings", 2048)),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        qkv_bias=is_qwen2 or attention_bias,  # Qwen2 always has q/k/v biases, o_proj none
        o_bias=attention_bias and not is_qwen2,
        mlp_bias=bool(cfg.get("mlp_bias", False)),
        sliding_window=int(sliding) if sliding else None,
        bos_token_id=cfg.get("bos_token_id"),
        eos_token_ids=gen_eos or _int_list(cfg.get("eos_token_id")),
        dtype=str(cfg.get("dtype") or cfg.get("torch_dtype") or "float32"),
    )


def load_config(model_path: str | Path) -> ModelConfig:
    """Read ``config.json`` (and ``generation_config.json`` if present) from a model dir."""
    path = Path(model_path)
    cfg = json.loads((path / "config.json").read_text())
    gen_path = path / "generation_config.json"
    gen = json.loads(gen_path.read_text()) if gen_path.exists() else None
    return parse_config(cfg, gen)
