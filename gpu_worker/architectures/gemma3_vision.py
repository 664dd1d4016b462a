"""Gemma 3 with images (``Gemma3ForConditionalGeneration``, ``model_type`` ``gemma3``): a
SigLIP vision tower (no class token, learned positions, ``post_layernorm``), Gemma 3's
projector (average-pooled to ``mm_tokens_per_image`` tokens, Gemma's zero-centred RMS
norm, one bias-free matrix) and the Gemma 3 text model (``text_config``, read as
``gemma3_text`` is). The image path is a ``VisionSpec`` with ``family="gemma3"``.

What differs from LLaVA beyond the tower: an image's tokens attend each other both ways
during prefill (HF builds it from ``token_type_ids``: ``bidirectional`` here), so the
scheduler keeps an image's span in one chunk and never starts a request inside one
(scheduler/planner.py), and the attention backend ORs the block into its causal mask.

Checkpoint names: transformers 4's (``language_model.model.*``,
``vision_tower.vision_model.*``, ``multi_modal_projector.*``) and 5's (``model.``-prefixed,
the tower without ``vision_model``) map as LLaVA's do (``llava.checkpoint_name``); the
SigLIP attention-pooling ``head`` is never read (Gemma 3 takes the last hidden state).
"""

from __future__ import annotations

import math
from typing import Any

from gpu_worker.architectures import gemma
from gpu_worker.architectures.hf_config import (ACTIVATIONS, Architecture, Fields,
                                                UnsupportedConfig, VisionSpec)

TOWERS = {"siglip_vision_model"}
# transformers' SiglipVisionConfig defaults (hub configs often list only what differs)
_SIGLIP_DEFAULTS = dict(hidden_size=768, intermediate_size=3072, num_hidden_layers=12,
                        num_attention_heads=12, image_size=224, patch_size=16, num_channels=3,
                        layer_norm_eps=1e-6, hidden_act="gelu_pytorch_tanh")


def _vision(cfg: dict[str, Any], text_vocab: int) -> VisionSpec:
    raw = cfg.get("vision_config") or {}
    tower = raw.get("model_type", "siglip_vision_model")
    if tower not in TOWERS:
        raise UnsupportedConfig("vision_config.model_type", tower, TOWERS)
    v = {**_SIGLIP_DEFAULTS, **{k: raw[k] for k in _SIGLIP_DEFAULTS if raw.get(k) is not None}}
    act = str(v["hidden_act"])
    if act not in ACTIVATIONS:
        raise UnsupportedConfig("vision_config.hidden_act", act, ACTIVATIONS)
    size, patch = int(v["image_size"]), int(v["patch_size"])
    if size % patch:
        raise UnsupportedConfig("vision_config.image_size", f"{size} (not a multiple of "
                                f"patch_size {patch})")
    tokens = int(cfg.get("mm_tokens_per_image", 256))
    side = math.isqrt(tokens)
    if side * side != tokens or (size // patch) % side:
        raise UnsupportedConfig("mm_tokens_per_image", f"{tokens} (must be a square whose side "
                                f"divides the tower's {size // patch} patches per side)")
    token = cfg.get("image_token_index", cfg.get("image_token_id"))
    if token is None:
        raise UnsupportedConfig("image_token_index", None)
    if not 0 <= int(token) < text_vocab:
        raise UnsupportedConfig("image_token_index", f"{token} (outside the text model's "
                                f"vocabulary of {text_vocab})")
    layers = int(v["num_hidden_layers"])
    return VisionSpec(
        hidden_size=int(v["hidden_size"]), intermediate_size=int(v["intermediate_size"]),
        num_heads=int(v["num_attention_heads"]), image_size=size, patch_size=patch,
        num_channels=int(v["num_channels"]), layer_norm_eps=float(v["layer_norm_eps"]),
        act=ACTIVATIONS[act], feature_layers=[layers], drop_cls=False, projector_act="none",
        projector_bias=False, image_token_id=int(token), family="gemma3",
        mm_tokens=tokens, bidirectional=True)


# transformers' Gemma3TextConfig defaults: the hub's Gemma 3 image-text configs list only a
# few text fields (hidden sizes, layers, rope_scaling, sliding_window); the transformers 4
# layout's RoPE (no rope_parameters) is rope_theta for global layers and
# rope_local_base_freq for local ones
_TEXT_DEFAULTS = dict(vocab_size=262208, hidden_size=2304, intermediate_size=9216,
                      num_hidden_layers=26, num_attention_heads=8, num_key_value_heads=4,
                      head_dim=256, hidden_activation="gelu_pytorch_tanh",
                      max_position_embeddings=131072, rms_norm_eps=1e-6,
                      query_pre_attn_scalar=256, sliding_window=4096)
_TEXT_ROPE_DEFAULTS = dict(rope_theta=1_000_000.0, rope_local_base_freq=10_000.0)


def _gemma3(cfg: dict[str, Any], model_type: str) -> Fields:
    if not isinstance(cfg.get("text_config"), dict):
        raise UnsupportedConfig("text_config", None)
    text = dict(cfg["text_config"])
    text_type = text.get("model_type", "gemma3_text")
    if text_type != "gemma3_text":
        raise UnsupportedConfig("text_config.model_type", text_type, {"gemma3_text"})
    defaults = {**_TEXT_DEFAULTS, **({} if "rope_parameters" in text else _TEXT_ROPE_DEFAULTS)}
    text = {**defaults, **{k: v for k, v in text.items() if v is not None or k not in defaults}}
    out = gemma.GEMMA3_TEXT.parse(text, text_type)
    if "tie_word_embeddings" in cfg and "tie_word_embeddings" not in text:
        out["tie_word_embeddings"] = bool(cfg["tie_word_embeddings"])
    if cfg.get("dtype") or cfg.get("torch_dtype"):
        out["dtype"] = str(cfg.get("dtype") or cfg.get("torch_dtype"))
    return {**out, "vision": _vision(cfg, out["vocab_size"])}


GEMMA3 = Architecture(_gemma3)
