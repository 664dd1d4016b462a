"""LLaVA (``LlavaForConditionalGeneration``): a CLIP vision tower and a two-layer projector
in front of a Llama-family text model. The text model's config (``text_config``) reads as
that family's does, so the decoder is the one every text model runs; the image path is a
``VisionSpec`` (``models/vision.py`` builds it).

What HF's class does that is read here: ``vision_feature_layer`` (an int or a list of
hidden-state indexes, negatives from the end, concatenated), ``vision_feature_select_strategy``
(``default`` drops the CLS row, ``full`` keeps it), ``projector_hidden_act``,
``multimodal_projector_bias`` and the placeholder ``image_token_index``. Anything else a
VL checkpoint may set (another tower, anyres tiling of LLaVA-NeXT, another text model) is
refused in one line, naming the field, before any process starts.

Checkpoint names come in three layouts: transformers 4's (``language_model.model.*``,
``vision_tower.vision_model.*``), transformers 5's in-memory one (``model.language_model.*``,
``model.vision_tower.*``) and the tower without ``vision_model`` (what transformers 5
saves); ``checkpoint_name`` maps each onto the decoder's names (``model.*``, ``lm_head.*``)
and the image path's (``vision.tower.*``, ``vision.projector.*``). Tower layers past the
deepest one read, and its ``post_layernorm``, are never loaded (LLaVA never runs them).
"""

from __future__ import annotations

from typing import Any

from gpu_worker.architectures import llama
from gpu_worker.architectures.hf_config import (ACTIVATIONS, Architecture, Fields,
                                                UnsupportedConfig, VisionSpec)

# text_config.model_type -> its family (a LLaVA's text model is a Llama or a Mistral)
TEXT_MODELS: dict[str, Architecture] = {"llama": llama.LLAMA, "mistral": llama.LLAMA}
TOWERS = {"clip_vision_model"}
STRATEGIES = {"default", "full"}
TOWER_ACTS = {"quick_gelu": "quick_gelu", **ACTIVATIONS}
# transformers' CLIPVisionConfig defaults (hub configs often list only what differs)
_CLIP_DEFAULTS = dict(hidden_size=768, intermediate_size=3072, num_hidden_layers=12,
                      num_attention_heads=12, image_size=224, patch_size=32, num_channels=3,
                      layer_norm_eps=1e-5, hidden_act="quick_gelu")

_TEXT_PREFIXES = (("language_model.model.", "model."), ("language_model.lm_head.", "lm_head."),
                  ("model.language_model.", "model."))
_TOWER_PREFIXES = ("model.vision_tower.vision_model.", "vision_tower.vision_model.",
                   "model.vision_tower.", "vision_tower.")
_PROJECTOR_PREFIXES = ("model.multi_modal_projector.", "multi_modal_projector.")


def _vision(cfg: dict[str, Any]) -> VisionSpec:
    raw = cfg.get("vision_config") or {}
    tower = raw.get("model_type", "clip_vision_model")
    if tower not in TOWERS:
        raise UnsupportedConfig("vision_config.model_type", tower, TOWERS)
    v = {**_CLIP_DEFAULTS, **{k: raw[k] for k in _CLIP_DEFAULTS if raw.get(k) is not None}}
    act = str(v["hidden_act"])
    if act not in TOWER_ACTS:
        raise UnsupportedConfig("vision_config.hidden_act", act, TOWER_ACTS)
    size, patch = int(v["image_size"]), int(v["patch_size"])
    if size % patch:
        raise UnsupportedConfig("vision_config.image_size", f"{size} (not a multiple of "
                                f"patch_size {patch})")
    strategy = cfg.get("vision_feature_select_strategy", "default")
    if strategy not in STRATEGIES:
        raise UnsupportedConfig("vision_feature_select_strategy", strategy, STRATEGIES)
    layers = int(v["num_hidden_layers"])
    asked = cfg.get("vision_feature_layer", -2)
    feature_layers = []
    for k in (asked if isinstance(asked, list) else [asked]):
        at = int(k) + layers + 1 if int(k) < 0 else int(k)
        if not 0 <= at <= layers:
            raise UnsupportedConfig("vision_feature_layer", asked)
        feature_layers.append(at)
    projector_act = cfg.get("projector_hidden_act", "gelu")
    if projector_act not in TOWER_ACTS:
        raise UnsupportedConfig("projector_hidden_act", projector_act, TOWER_ACTS)
    token = cfg.get("image_token_index", cfg.get("image_token_id"))
    if token is None:
        raise UnsupportedConfig("image_token_index", None)
    return VisionSpec(
        hidden_size=int(v["hidden_size"]), intermediate_size=int(v["intermediate_size"]),
        num_heads=int(v["num_attention_heads"]), image_size=size, patch_size=patch,
        num_channels=int(v["num_channels"]), layer_norm_eps=float(v["layer_norm_eps"]),
        act=TOWER_ACTS[act], feature_layers=feature_layers, drop_cls=strategy == "default",
        projector_act=TOWER_ACTS[projector_act],
        projector_bias=bool(cfg.get("multimodal_projector_bias", True)),
        image_token_id=int(token))


def _llava(cfg: dict[str, Any], model_type: str) -> Fields:
    text = dict(cfg.get("text_config") or {})
    text_type = text.get("model_type", "llama")
    if text_type not in TEXT_MODELS:
        raise UnsupportedConfig("text_config.model_type", text_type, TEXT_MODELS)
    out = TEXT_MODELS[text_type].parse(text, text_type)
    if "tie_word_embeddings" in cfg and "tie_word_embeddings" not in text:
        out["tie_word_embeddings"] = bool(cfg["tie_word_embeddings"])
    vision = _vision(cfg)
    if not 0 <= vision.image_token_id < out["vocab_size"]:
        raise UnsupportedConfig("image_token_index", f"{vision.image_token_id} (outside the "
                                f"text model's vocabulary of {out['vocab_size']})")
    return {**out, "vision": vision}


LLAVA = Architecture(_llava)


def checkpoint_name(name: str, vision: VisionSpec) -> str | None:
    """A LLaVA (or Gemma 3 image-text: the same layouts) checkpoint tensor's name as the
    decoder (``model.*``, ``lm_head.*``) or the image path (``vision.tower.*``,
    ``vision.projector.*``) calls it; None: never read."""
    for old, new in _TEXT_PREFIXES:
        if name.startswith(old):
            return new + name[len(old):]
    for prefix in _PROJECTOR_PREFIXES:
        if name.startswith(prefix):
            return "vision.projector." + name[len(prefix):]
    for prefix in _TOWER_PREFIXES:
        if name.startswith(prefix):
            rest = name[len(prefix):]
            if rest == "embeddings.position_ids" or rest.startswith("head.") or (
                    rest.startswith("post_layernorm.") and vision.family == "llava"):
                return None  # (Gemma 3's SigLIP runs post_layernorm; its pooling head never)
            if rest.startswith("encoder.layers.") and \
                    int(rest.split(".")[2]) >= vision.layers_run:
                return None
            return "vision.tower." + rest
    return name
