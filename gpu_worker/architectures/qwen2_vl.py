"""Qwen2-VL and Qwen2.5-VL with images (``Qwen2VLForConditionalGeneration``,
``Qwen2_5_VLForConditionalGeneration``; ``model_type`` ``qwen2_vl`` / ``qwen2_5_vl``):
Qwen's vision tower (``models/qwen2_vl_vision.py``) in front of a Qwen2 text model whose
RoPE is M-RoPE: an image token's position is a (temporal, height, width) triple, and
``mrope_section`` says how many rotary frequencies each of the three drives.

The text model's fields sit at the top of the config (the hub's, transformers 4) or under
``text_config`` (transformers 5); either reads as Qwen2 does (q/k/v biases, no o_proj
bias). ``rope_scaling`` ``{"type": "mrope", "mrope_section": ...}`` is default RoPE,
sectioned. The tower's config: Qwen2-VL's ``embed_dim`` x ``mlp_ratio`` LayerNorm blocks
with a ``quick_gelu`` MLP and its output ``hidden_size``; Qwen2.5-VL's ``hidden_size``
RMSNorm blocks with a gated ``silu`` MLP (``intermediate_size``), ``out_hidden_size``,
``window_size`` and ``fullatt_block_indexes``. Video is not served (images only).

Checkpoint names: the hub's (``visual.*``, ``model.*``, ``lm_head.*``; transformers 5
saves these too) and transformers 5's in-memory ones (``model.visual.*``,
``model.language_model.*``) map onto ``vision.*`` and the decoder's names.
"""

from __future__ import annotations

from typing import Any

from gpu_worker.architectures import qwen
from gpu_worker.architectures.hf_config import (Architecture, Fields, UnsupportedConfig,
                                                VisionSpec)
from gpu_worker.architectures.llava import TOWER_ACTS

TOWERS = {"qwen2_vl": "qwen2_vl_vision", "qwen2_5_vl": "qwen2_5_vl_vision"}
TEXT_MODELS = {"qwen2_vl_text", "qwen2_5_vl_text", "qwen2"}
# transformers' vision config defaults (hub configs list most fields; these fill the rest)
_DEFAULTS = {
    "qwen2_vl": dict(depth=32, embed_dim=1280, hidden_size=3584, hidden_act="quick_gelu",
                     mlp_ratio=4, num_heads=16, in_channels=3, patch_size=14,
                     spatial_merge_size=2, temporal_patch_size=2),
    "qwen2_5_vl": dict(depth=32, hidden_size=3584, hidden_act="silu", intermediate_size=3420,
                       num_heads=16, in_channels=3, patch_size=14, spatial_merge_size=2,
                       temporal_patch_size=2, window_size=112, out_hidden_size=3584,
                       fullatt_block_indexes=[7, 15, 23, 31]),
}
_TEXT_PREFIXES = (("model.language_model.", "model."),)
_TOWER_PREFIXES = ("model.visual.", "visual.")


def _vision(cfg: dict[str, Any], family: str, text_hidden: int, text_vocab: int) -> VisionSpec:
    raw = dict(cfg.get("vision_config") or {})
    tower = raw.get("model_type", TOWERS[family])
    if tower != TOWERS[family]:
        raise UnsupportedConfig("vision_config.model_type", tower, {TOWERS[family]})
    if "in_chans" in raw and "in_channels" not in raw:  # (the hub's name)
        raw["in_channels"] = raw["in_chans"]
    v = {**_DEFAULTS[family], **{k: raw[k] for k in _DEFAULTS[family] if raw.get(k) is not None}}
    act = str(v["hidden_act"])
    if act not in TOWER_ACTS:
        raise UnsupportedConfig("vision_config.hidden_act", act, TOWER_ACTS)
    rope = raw.get("rope_parameters") or {}
    if rope.get("rope_type", "axial") != "axial":
        raise UnsupportedConfig("vision_config.rope_parameters.rope_type", rope["rope_type"], {"axial"})
    if family == "qwen2_vl":
        width, inner, out = int(v["embed_dim"]), int(int(v["embed_dim"]) * float(v["mlp_ratio"])), int(v["hidden_size"])
    else:
        width, inner, out = int(v["hidden_size"]), int(v["intermediate_size"]), int(v["out_hidden_size"])
    if out != text_hidden:
        raise UnsupportedConfig("vision_config", f"the merger's output width {out} is not the "
                                f"text model's hidden_size {text_hidden}")
    heads, depth = int(v["num_heads"]), int(v["depth"])
    if width % heads or (width // heads) % 4:
        raise UnsupportedConfig("vision_config.num_heads", f"{heads} (the head width must be a "
                                f"multiple of 4 for 2-D rotary positions; width {width})")
    patch, merge = int(v["patch_size"]), int(v["spatial_merge_size"])
    window, full = 0, []
    if family == "qwen2_5_vl":
        window, full = int(v["window_size"]), [int(b) for b in v["fullatt_block_indexes"]]
        if window < patch * merge or window % (patch * merge):
            raise UnsupportedConfig("vision_config.window_size", f"{window} (not a multiple of "
                                    f"patch_size x spatial_merge_size = {patch * merge})")
    token = cfg.get("image_token_id", cfg.get("image_token_index"))
    if token is None:
        raise UnsupportedConfig("image_token_id", None)
    if not 0 <= int(token) < text_vocab:
        raise UnsupportedConfig("image_token_id", f"{token} (outside the text model's "
                                f"vocabulary of {text_vocab})")
    return VisionSpec(
        hidden_size=width, intermediate_size=inner, num_heads=heads, image_size=0,
        patch_size=patch, num_channels=int(v["in_channels"]), layer_norm_eps=1e-6,
        act=TOWER_ACTS[act], feature_layers=[depth], drop_cls=False, projector_act="gelu",
        projector_bias=True, image_token_id=int(token), family=family,  # type: ignore[arg-type]
        temporal_patch_size=int(v["temporal_patch_size"]), merge_size=merge,
        window_size=window, full_attention_blocks=full,
        rope_theta=float(rope.get("rope_theta", 10000.0)))


def _qwen2_vl(cfg: dict[str, Any], model_type: str) -> Fields:
    nested = cfg.get("text_config")
    text = dict(nested) if isinstance(nested, dict) else {k: v for k, v in cfg.items()
                                                          if k != "vision_config"}
    text_type = text.get("model_type", "qwen2")
    if isinstance(nested, dict) and text_type not in TEXT_MODELS:
        raise UnsupportedConfig("text_config.model_type", text_type, TEXT_MODELS)
    out = qwen.QWEN2.parse(text, "qwen2")
    section = out["rope"].mrope_section
    if sum(section) != out["head_dim"] // 2 or len(section) != 3:
        raise UnsupportedConfig("mrope_section", f"{section or None} (three counts of rotary "
                                f"frequencies summing to head_dim / 2 = {out['head_dim'] // 2})")
    if "tie_word_embeddings" in cfg and "tie_word_embeddings" not in text:
        out["tie_word_embeddings"] = bool(cfg["tie_word_embeddings"])
    if cfg.get("dtype") or cfg.get("torch_dtype"):
        out["dtype"] = str(cfg.get("dtype") or cfg.get("torch_dtype"))
    return {**out, "vision": _vision(cfg, model_type, out["hidden_size"], out["vocab_size"])}


QWEN2_VL = Architecture(_qwen2_vl)


def checkpoint_name(name: str) -> str | None:
    """A Qwen2-VL / Qwen2.5-VL checkpoint tensor's name as the decoder (``model.*``,
    ``lm_head.*``) or the image path (``vision.*``) calls it."""
    for old, new in _TEXT_PREFIXES:
        if name.startswith(old):
            return new + name[len(old):]
    for prefix in _TOWER_PREFIXES:
        if name.startswith(prefix):
            return "vision." + name[len(prefix):]
    return name
