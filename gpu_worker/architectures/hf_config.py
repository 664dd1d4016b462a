"""What every architecture module builds on: the ``config.json`` fields all families read
(sizes, RoPE, sliding windows, activation), the config pieces they parse into, and the
declaration each family makes (``Architecture``: how its config reads, how its
checkpoint's tensor names map onto the decoder's parameters).

Both the transformers 4 layout (``rope_theta`` + ``rope_scaling``) and the transformers 5
one (``rope_parameters``, per layer type for Gemma 3) are accepted. Anything we would
silently get wrong is refused with ``UnsupportedConfig`` naming the field and its value.
Only json and msgspec here (no torch): the launcher checks a checkpoint before it starts
any process.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

import msgspec


class UnsupportedConfig(ValueError):
    """A config.json field whose value Candor cannot serve exactly."""

    def __init__(self, field: str, value: Any, supported: Any = None) -> None:
        more = f" (supported: {', '.join(map(str, sorted(supported)))})" if supported else ""
        super().__init__(f"config.json: {field}={value!r} is not supported{more}")
        self.field, self.value = field, value


# "dynamic" NTK only rescales beyond max_position_embeddings, which max_model_len never
# exceeds, so inside our limits it equals the plain rotation (as in HF).
ROPE_TYPES = {"default", "linear", "dynamic", "llama3", "yarn", "longrope"}
ACTIVATIONS = {"silu": "silu", "swish": "silu", "gelu": "gelu", "gelu_pytorch_tanh": "gelu_tanh",
               "gelu_tanh": "gelu_tanh"}


class RopeConfig(msgspec.Struct, frozen=True):
    theta: float = 10000.0
    type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192
    attention_factor: float | None = None  # yarn / longrope: cos and sin scale; None: derived
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float | None = None
    mscale_all_dim: float | None = None
    truncate: bool = True
    short_factor: list[float] = []
    long_factor: list[float] = []
    factor_given: bool = True  # False: derive it from max_position_embeddings (yarn, longrope)
    # M-RoPE (Qwen2-VL): how many of the head_dim / 2 rotary frequencies take the temporal,
    # height and width position, in that order; empty: one position per token
    mrope_section: list[int] = []


class MoeConfig(msgspec.Struct, frozen=True):
    num_experts: int
    top_k: int
    intermediate_size: int
    renormalize: bool  # top-k weights divided by their sum (Mixtral always, Qwen3-MoE by flag)


class EncoderSpec(msgspec.Struct, frozen=True):
    """What a bidirectional encoder (BERT family) has beyond the decoder's switches:
    token-type embeddings, where position ids start, and its classification head
    (``none``: a base model; ``bert``: pooler + classifier; ``roberta``: classifier.dense
    + out_proj), with ``num_labels`` outputs."""

    type_vocab_size: int = 2
    position_offset: int = 0
    head: Literal["none", "bert", "roberta"] = "none"
    num_labels: int = 0


class VisionSpec(msgspec.Struct, frozen=True):
    """An image path in front of the decoder: a vision tower run up to the deepest layer
    the features are read from, the projector that maps its features onto the text
    model's embeddings, and the placeholder token whose positions those embeddings
    replace. ``family``: ``llava`` (``architectures/llava.py``: a CLIP tower and a
    two-layer projector), ``qwen2_vl`` / ``qwen2_5_vl`` (``architectures/qwen2_vl.py``:
    Qwen's patch-merging tower, images of any size) or ``gemma3``
    (``architectures/gemma3_vision.py``: a SigLIP tower
    and Gemma 3's pooling projector, ``mm_tokens`` tokens an image; its image tokens
    attend each other both ways in prefill: ``bidirectional``).

    ``feature_layers``: hidden states read, as counts of tower layers run (0: the
    embeddings after ``pre_layrnorm``), concatenated in order (HF's
    ``vision_feature_layer``, an int or a list, negatives resolved). ``drop_cls``: the
    ``default`` select strategy (the CLS row is dropped); ``full`` keeps it."""

    hidden_size: int
    intermediate_size: int
    num_heads: int
    image_size: int
    patch_size: int
    num_channels: int
    layer_norm_eps: float
    act: str  # quick_gelu | gelu | gelu_tanh | silu (the tower's MLP)
    feature_layers: list[int]
    drop_cls: bool
    projector_act: str
    projector_bias: bool
    image_token_id: int
    family: Literal["llava", "gemma3", "qwen2_vl", "qwen2_5_vl"] = "llava"
    mm_tokens: int = 0  # gemma3: the tokens an image is pooled to (mm_tokens_per_image)
    # an image's tokens attend each other both ways during prefill (Gemma 3's token_type_ids
    # mask): the scheduler keeps its span in one chunk, attention ORs the block in
    bidirectional: bool = False
    # Qwen2-VL / Qwen2.5-VL (architectures/qwen2_vl.py): images of any size, as patches of
    # temporal_patch_size frames (a still image repeated) whose merge_size x merge_size
    # neighbours merge into one token; 2.5: attention within window_size-pixel windows
    # except in full_attention_blocks
    temporal_patch_size: int = 0
    merge_size: int = 0
    window_size: int = 0
    full_attention_blocks: list[int] = []
    rope_theta: float = 10000.0  # the tower's 2-D rotary positions (Qwen)

    @property
    def layers_run(self) -> int:
        return max(self.feature_layers)

    @property
    def tokens_per_image(self) -> int:
        """Every image's token count (0: it varies with the image's size, Qwen2-VL's)."""
        if self.merge_size:
            return 0
        if self.mm_tokens:
            return self.mm_tokens
        return (self.image_size // self.patch_size) ** 2 + (0 if self.drop_cls else 1)


class LayerSpec(msgspec.Struct, frozen=True):
    window: int | None = None  # sliding window (keys p - window + 1 .. p); None: full attention
    rope: int | None = 0  # index into ModelConfig.ropes; None: this layer has no RoPE (SmolLM3)
    moe: bool = False


# ---------------------------------------------------------------- declarations

Fields = dict[str, Any]  # ModelConfig's fields, as a family's parser returns them


# checkpoint module -> (the fused layer it is part of, which part); nano-vllm's idea
SEPARATE_QKV = {"q_proj": ("qkv_proj", "q"), "k_proj": ("qkv_proj", "k"), "v_proj": ("qkv_proj", "v")}
SEPARATE_GATE_UP = {"gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}
# an expert's checkpoint module -> (the stacked parameter, which part within an expert)
HF_EXPERTS = {"gate_proj": ("w13", 0), "up_proj": ("w13", 1), "down_proj": ("w2", None)}


@dataclass(frozen=True)
class WeightNames:
    """How a family's checkpoint tensor names map onto the decoder's parameters: which
    separate tensors are parts of one fused layer, how experts are named, and fragments
    spelled differently. Everything else loads under its own name (a checkpoint that
    holds a layer fused already, as Phi-3's ``qkv_proj``, needs no entry)."""

    packed: dict[str, tuple[str, str | int]] = field(default_factory=lambda: SEPARATE_QKV | SEPARATE_GATE_UP)
    experts: dict[str, tuple[str, int | None]] = field(default_factory=lambda: dict(HF_EXPERTS))
    renames: dict[str, str] = field(default_factory=dict)  # checkpoint name fragment -> ours

    def target(self, name: str, tied: bool) -> tuple[str, tuple] | None:
        """Checkpoint tensor ``name`` -> (our parameter's name, the ids its layer's
        ``weight_loader`` takes after the tensor), or None: a tensor carrying nothing we
        use. A name we have no parameter for comes back as is (the loader names it)."""
        if name.endswith("rotary_emb.inv_freq") or (tied and name == "lm_head.weight"):
            return None
        for old, new in self.renames.items():
            name = name.replace(old, new)
        parts = name.split(".")
        if "experts" in parts:
            i = parts.index("experts")
            expert, proj = int(parts[i + 1]), parts[i + 2]
            if proj not in self.experts:
                return name, ()
            stacked, part = self.experts[proj]
            return ".".join(parts[:i + 1] + [stacked]), (expert, part)
        for module, (fused, part) in self.packed.items():
            if f".{module}." in name:
                return name.replace(f".{module}.", f".{fused}."), (part,)
        return name, ()


@dataclass(frozen=True)
class Architecture:
    """One family: ``parse(config.json dict, model_type)`` -> the ModelConfig fields (the
    switches its HF class hard-codes), and its checkpoint's ``weights`` names."""

    parse: Callable[[dict[str, Any], str], Fields]
    weights: WeightNames = field(default_factory=WeightNames)


# ---------------------------------------------------------------- shared readers


def rope_params(cfg: dict[str, Any]) -> dict[str, Any]:
    return cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}


def parse_rope(cfg: dict[str, Any], params: dict[str, Any]) -> RopeConfig:
    rope_type = params.get("rope_type", params.get("type", "default")) or "default"
    if rope_type == "su":  # Phi-3's early name for longrope
        rope_type = "longrope"
    if rope_type == "mrope" and params.get("mrope_section"):  # Qwen2-VL's transformers 4
        rope_type = "default"  # name: default RoPE, sectioned
    if rope_type not in ROPE_TYPES:
        raise UnsupportedConfig("rope_type", rope_type, ROPE_TYPES)
    partial = float(params.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 1.0)))
    if partial != 1.0:
        raise UnsupportedConfig("partial_rotary_factor", partial)
    theta = params.get("rope_theta", cfg.get("rope_theta", 10000.0))
    orig = params.get("original_max_position_embeddings",
                      cfg.get("original_max_position_embeddings", cfg.get("max_position_embeddings", 8192)))
    factor = params.get("factor")
    opt = lambda k: None if params.get(k) is None else float(params[k])  # noqa: E731
    return RopeConfig(
        theta=float(theta), type=rope_type,
        factor=float(factor) if factor is not None else 1.0,
        factor_given=factor is not None,
        low_freq_factor=float(params.get("low_freq_factor", 1.0)),
        high_freq_factor=float(params.get("high_freq_factor", 4.0)),
        original_max_position_embeddings=int(orig),
        attention_factor=opt("attention_factor"),
        beta_fast=float(params.get("beta_fast") or 32), beta_slow=float(params.get("beta_slow") or 1),
        mscale=opt("mscale"), mscale_all_dim=opt("mscale_all_dim"),
        truncate=bool(params.get("truncate", True)),
        short_factor=[float(x) for x in params.get("short_factor") or []],
        long_factor=[float(x) for x in params.get("long_factor") or []],
        mrope_section=[int(x) for x in params.get("mrope_section") or []],
    )


def layer_windows(cfg: dict[str, Any], n: int, default_sliding: Callable[[int], bool]) -> list[int | None]:
    window = cfg.get("sliding_window")
    types = cfg.get("layer_types")
    if types is not None:
        if len(types) != n:
            raise UnsupportedConfig("layer_types", f"{len(types)} entries for {n} layers")
        unknown = set(types) - {"sliding_attention", "full_attention"}
        if unknown:
            raise UnsupportedConfig("layer_types", sorted(unknown)[0], {"sliding_attention", "full_attention"})
        sliding = [t == "sliding_attention" for t in types]
    else:
        sliding = [default_sliding(i) for i in range(n)]
    return [int(window) if s and window else None for s in sliding]


def activation(cfg: dict[str, Any], key: str = "hidden_act", default: str = "silu") -> str:
    act = cfg.get(key) or default
    if act not in ACTIVATIONS:
        raise UnsupportedConfig(key, act, ACTIVATIONS)
    return ACTIVATIONS[act]


def common_fields(cfg: dict[str, Any], model_type: str, *,
                  default_sliding: Callable[[int], bool] = lambda i: True,
                  act_key: str = "hidden_act") -> Fields:
    """The fields every family reads the same way (a Llama-shaped model needs no more).
    ``default_sliding(i)``: whether layer i slides when ``layer_types`` does not say."""
    hidden = int(cfg["hidden_size"])
    heads = int(cfg["num_attention_heads"])
    n = int(cfg["num_hidden_layers"])
    params = rope_params(cfg)
    layer_types = cfg.get("layer_types") or ["full_attention"] * n
    windows = layer_windows(cfg, n, default_sliding)
    if params and all(isinstance(v, dict) for v in params.values()):  # per layer type (Gemma 3)
        kinds = sorted(params)
        ropes = [parse_rope(cfg, params[k]) for k in kinds]
        rope_of = [kinds.index(t) if t in params else None for t in layer_types]
        if None in rope_of:
            raise UnsupportedConfig("rope_parameters", f"no entry for layer type {layer_types[rope_of.index(None)]}")
    else:
        ropes = [parse_rope(cfg, params)]
        rope_of = [0] * n
    attention_bias = bool(cfg.get("attention_bias", False))
    return dict(
        model_type=model_type,
        vocab_size=int(cfg["vocab_size"]),
        hidden_size=hidden,
        num_layers=n,
        num_heads=heads,
        num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
        head_dim=int(cfg.get("head_dim") or hidden // heads),
        intermediate_size=int(cfg["intermediate_size"]),
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        rope=ropes[0],
        ropes=ropes,
        layers=[LayerSpec(window=w, rope=r) for w, r in zip(windows, rope_of)],
        max_position_embeddings=int(cfg.get("max_position_embeddings", 2048)),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        qkv_bias=attention_bias,
        o_bias=attention_bias,
        mlp_bias=bool(cfg.get("mlp_bias", False)),
        act=activation(cfg, act_key),
        bos_token_id=cfg.get("bos_token_id"),
        dtype=str(cfg.get("dtype") or cfg.get("torch_dtype") or "float32"),
    )


def qwen_windows(cfg: dict[str, Any], model_type: str) -> Fields:
    """``common_fields`` with Qwen2/3's rule (SmolLM3 keeps it): windows only when
    ``use_sliding_window``, from ``max_window_layers`` on."""
    use = bool(cfg.get("use_sliding_window", False))
    first = int(cfg.get("max_window_layers", 0) or 0)
    out = common_fields(cfg, model_type, default_sliding=lambda i: use and i >= first)
    if not use:
        out["layers"] = [msgspec.structs.replace(layer, window=None) for layer in out["layers"]]
    return out


def with_layers(out: Fields, **per_layer: list) -> Fields:
    """``out`` with each layer's spec updated from the given per-layer lists."""
    out["layers"] = [msgspec.structs.replace(layer, **{k: v[i] for k, v in per_layer.items()})
                     for i, layer in enumerate(out["layers"])]
    return out
