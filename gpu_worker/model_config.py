"""An HF ``config.json`` read into the switches our one decoder implementation has.

Every supported architecture is a parser here (``PARSERS``, keyed by ``model_type``) that
sets the switches its HF class hard-codes: norm kind and placement, q/k norms, biases,
activation, MLP shape, mixture of experts, multipliers, soft-caps, and per-layer
attention windows and RoPE tables. Both the transformers 4 layout (``rope_theta`` +
``rope_scaling``) and the transformers 5 one (``rope_parameters``, per layer type for
Gemma 3) are accepted. Anything we would silently get wrong is refused with
``UnsupportedConfig`` naming the field and its value.

Only json and msgspec here (no torch): the launcher checks a checkpoint with this module
before it starts any process.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any, Callable, Literal

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


class MoeConfig(msgspec.Struct, frozen=True):
    num_experts: int
    top_k: int
    intermediate_size: int
    renormalize: bool  # top-k weights divided by their sum (Mixtral always, Qwen3-MoE by flag)


class LayerSpec(msgspec.Struct, frozen=True):
    window: int | None = None  # sliding window (keys p - window + 1 .. p); None: full attention
    rope: int | None = 0  # index into ModelConfig.ropes; None: this layer has no RoPE (SmolLM3)
    moe: bool = False


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
    norm: Literal["rms", "rms_1p", "layer"] = "rms"  # rms_1p: Gemma's x * (1 + w); layer: LayerNorm
    norm_placement: Literal["pre", "sandwich", "post"] = "pre"
    qk_norm: Literal["none", "head", "full"] = "none"  # head: per head (Qwen3); full: whole projection
    mlp: Literal["gated", "plain"] = "gated"
    act: str = "silu"  # silu | gelu | gelu_tanh
    moe: MoeConfig | None = None
    layers: list[LayerSpec] = []
    ropes: list[RopeConfig] = []
    embed_scale: float = 1.0
    embed_scale_sqrt_hidden: bool = False  # Gemma: sqrt(hidden) rounded to the compute dtype
    residual_scale: float = 1.0
    attn_scale: float | None = None  # None: head_dim ** -0.5
    attn_softcap: float | None = None
    final_softcap: float | None = None
    logits_divisor: float = 1.0
    bos_token_id: int | None = None
    eos_token_ids: list[int] = []
    dtype: str = "float32"

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def sliding_window(self) -> int | None:
        """The widest window any layer has (None when every layer attends fully)."""
        windows = [layer.window for layer in self.layers if layer.window is not None]
        return max(windows) if windows else None

    @property
    def scale(self) -> float:
        return self.head_dim**-0.5 if self.attn_scale is None else self.attn_scale


def _int_list(value: Any) -> list[int]:
    if value is None:
        return []
    return [int(v) for v in (value if isinstance(value, list) else [value])]


def _rope_params(cfg: dict[str, Any]) -> dict[str, Any]:
    return cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}


def _parse_rope(cfg: dict[str, Any], params: dict[str, Any]) -> RopeConfig:
    rope_type = params.get("rope_type", params.get("type", "default")) or "default"
    if rope_type == "su":  # Phi-3's early name for longrope
        rope_type = "longrope"
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
    )


def rope_attention_factor(rope: RopeConfig, max_position_embeddings: int) -> float:
    """The cos/sin scale of yarn and longrope (1 otherwise), derived as HF does."""
    if rope.attention_factor is not None:
        return rope.attention_factor
    factor = rope.factor if rope.factor_given else max_position_embeddings / rope.original_max_position_embeddings
    if rope.type == "yarn":
        def mscale(scale: float, m: float = 1.0) -> float:
            return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0
        if rope.mscale and rope.mscale_all_dim:
            return float(mscale(factor, rope.mscale) / mscale(factor, rope.mscale_all_dim))
        return mscale(factor)
    if rope.type == "longrope":
        if factor <= 1.0:
            return 1.0
        return math.sqrt(1 + math.log(factor) / math.log(rope.original_max_position_embeddings))
    return 1.0


def _layer_windows(cfg: dict[str, Any], n: int, default_sliding: Callable[[int], bool]) -> list[int | None]:
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


def _act(cfg: dict[str, Any], key: str = "hidden_act", default: str = "silu") -> str:
    act = cfg.get(key) or default
    if act not in ACTIVATIONS:
        raise UnsupportedConfig(key, act, ACTIVATIONS)
    return ACTIVATIONS[act]


def _base(cfg: dict[str, Any], model_type: str, *, default_sliding: Callable[[int], bool] = lambda i: True,
          act_key: str = "hidden_act") -> dict[str, Any]:
    hidden = int(cfg["hidden_size"])
    heads = int(cfg["num_attention_heads"])
    n = int(cfg["num_hidden_layers"])
    params = _rope_params(cfg)
    layer_types = cfg.get("layer_types") or ["full_attention"] * n
    windows = _layer_windows(cfg, n, default_sliding)
    if params and all(isinstance(v, dict) for v in params.values()):  # per layer type (Gemma 3)
        kinds = sorted(params)
        ropes = [_parse_rope(cfg, params[k]) for k in kinds]
        rope_of = [kinds.index(t) if t in params else None for t in layer_types]
        if None in rope_of:
            raise UnsupportedConfig("rope_parameters", f"no entry for layer type {layer_types[rope_of.index(None)]}")
    else:
        ropes = [_parse_rope(cfg, params)]
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
        act=_act(cfg, act_key),
        bos_token_id=cfg.get("bos_token_id"),
        dtype=str(cfg.get("dtype") or cfg.get("torch_dtype") or "float32"),
    )


def _qwen_sliding(cfg: dict[str, Any]) -> Callable[[int], bool]:
    """Qwen2/3 without layer_types: windows only when use_sliding_window, from
    max_window_layers on (HF's rule)."""
    use = bool(cfg.get("use_sliding_window", False))
    first = int(cfg.get("max_window_layers", 0) or 0)
    return lambda i: use and i >= first


def _llama(cfg, t):
    return _base(cfg, t)


def _qwen2(cfg, t):
    out = _base(cfg, t, default_sliding=_qwen_sliding(cfg))
    if not cfg.get("use_sliding_window", False):
        out["layers"] = [msgspec.structs.replace(layer, window=None) for layer in out["layers"]]
    return {**out, "qkv_bias": True, "o_bias": False}  # Qwen2: q/k/v biases always, o_proj none


def _qwen3(cfg, t):
    out = _base(cfg, t, default_sliding=_qwen_sliding(cfg))
    if not cfg.get("use_sliding_window", False):
        out["layers"] = [msgspec.structs.replace(layer, window=None) for layer in out["layers"]]
    out["qk_norm"] = "head"
    if t == "qwen3_moe":
        sparse = set(range(out["num_layers"])) - set(cfg.get("mlp_only_layers") or [])
        step = int(cfg.get("decoder_sparse_step", 1) or 1)
        n_exp = int(cfg.get("num_experts") or cfg.get("num_local_experts") or 0)
        is_moe = [i in sparse and n_exp > 0 and (i + 1) % step == 0 for i in range(out["num_layers"])]
        out["layers"] = [msgspec.structs.replace(layer, moe=m) for layer, m in zip(out["layers"], is_moe)]
        out["moe"] = MoeConfig(n_exp, int(cfg["num_experts_per_tok"]), int(cfg["moe_intermediate_size"]),
                               bool(cfg.get("norm_topk_prob", False)))
    return out


def _mixtral(cfg, t):
    out = _base(cfg, t)
    out["layers"] = [msgspec.structs.replace(layer, moe=True) for layer in out["layers"]]
    out["moe"] = MoeConfig(int(cfg.get("num_local_experts") or cfg["num_experts"]), int(cfg["num_experts_per_tok"]),
                           int(cfg["intermediate_size"]), True)
    return out


def _gemma(cfg, t):
    if t == "gemma2":
        sliding = lambda i: i % 2 == 0  # noqa: E731
    else:
        pattern = int(cfg.get("sliding_window_pattern") or cfg.get("_sliding_window_pattern") or 6)
        sliding = lambda i: (i + 1) % pattern != 0  # noqa: E731
    out = _base(cfg, t, default_sliding=sliding, act_key="hidden_activation")
    if t == "gemma3_text" and "rope_local_base_freq" in cfg and len(out["ropes"]) == 1:
        # transformers 4 layout: global layers take rope_theta (+ scaling), local ones the local base
        local = RopeConfig(theta=float(cfg["rope_local_base_freq"]))
        out["ropes"] = [out["ropes"][0], local]
        out["layers"] = [msgspec.structs.replace(layer, rope=1 if layer.window else 0) for layer in out["layers"]]
    if cfg.get("use_bidirectional_attention"):
        raise UnsupportedConfig("use_bidirectional_attention", True)
    out.update(norm="rms_1p", norm_placement="sandwich", embed_scale_sqrt_hidden=True,
               attn_scale=float(cfg.get("query_pre_attn_scalar") or out["head_dim"]) ** -0.5,
               attn_softcap=cfg.get("attn_logit_softcapping"), final_softcap=cfg.get("final_logit_softcapping"),
               tie_word_embeddings=bool(cfg.get("tie_word_embeddings", True)))
    if t == "gemma3_text":
        out["qk_norm"] = "head"
    return out


def _phi3(cfg, t):
    return _base(cfg, t)


def _granite(cfg, t):
    out = _base(cfg, t)
    out.update(embed_scale=float(cfg.get("embedding_multiplier", 1.0)),
               residual_scale=float(cfg.get("residual_multiplier", 1.0)),
               attn_scale=float(cfg.get("attention_multiplier", 1.0)),
               logits_divisor=float(cfg.get("logits_scaling", 1.0)))
    return out


def _olmo2(cfg, t):
    return {**_base(cfg, t), "norm_placement": "post", "qk_norm": "full"}


def _smollm3(cfg, t):
    out = _base(cfg, t, default_sliding=_qwen_sliding(cfg))
    if not cfg.get("use_sliding_window", False):
        out["layers"] = [msgspec.structs.replace(layer, window=None) for layer in out["layers"]]
    uses = cfg.get("no_rope_layers")
    if uses is None:
        interval = int(cfg.get("no_rope_layer_interval", 4))
        uses = [int((i + 1) % interval != 0) for i in range(out["num_layers"])]
    out["layers"] = [msgspec.structs.replace(layer, rope=layer.rope if use else None)
                     for layer, use in zip(out["layers"], uses)]
    return out


def _starcoder2(cfg, t):
    out = _base(cfg, t)
    bias = bool(cfg.get("use_bias", True))
    out.update(norm="layer", rms_norm_eps=float(cfg.get("norm_epsilon", 1e-5)), mlp="plain",
               qkv_bias=bias, o_bias=bias, mlp_bias=bias,
               tie_word_embeddings=bool(cfg.get("tie_word_embeddings", True)))
    return out


# model_type -> parser; the model class for each lives in gpu_worker/models/registry.py
PARSERS: dict[str, Callable[[dict[str, Any], str], dict[str, Any]]] = {
    "llama": _llama, "mistral": _llama, "qwen2": _qwen2, "qwen3": _qwen3, "qwen3_moe": _qwen3,
    "mixtral": _mixtral, "gemma2": _gemma, "gemma3_text": _gemma, "phi3": _phi3, "granite": _granite,
    "olmo2": _olmo2, "smollm3": _smollm3, "starcoder2": _starcoder2,
}


def parse_config(cfg: dict[str, Any], generation_cfg: dict[str, Any] | None = None) -> ModelConfig:
    """Build a ModelConfig from parsed config.json (and generation_config.json) dicts."""
    model_type = cfg.get("model_type", "llama")
    if model_type not in PARSERS:
        raise UnsupportedConfig("model_type", model_type, PARSERS)
    kwargs = PARSERS[model_type](cfg, model_type)
    gen_eos = _int_list((generation_cfg or {}).get("eos_token_id"))
    kwargs["eos_token_ids"] = gen_eos or _int_list(cfg.get("eos_token_id"))
    return ModelConfig(**kwargs)


def read_config_dict(model_path: str | Path) -> dict[str, Any]:
    cfg = json.loads((Path(model_path) / "config.json").read_text())
    if cfg.get("model_type") == "gemma3" and "text_config" in cfg:
        raise UnsupportedConfig("model_type", "gemma3 (multimodal; serve a gemma3_text checkpoint)")
    return cfg


def load_config(model_path: str | Path) -> ModelConfig:
    """Read ``config.json`` (and ``generation_config.json`` if present) from a model dir."""
    path = Path(model_path)
    gen_path = path / "generation_config.json"
    gen = json.loads(gen_path.read_text()) if gen_path.exists() else None
    return parse_config(read_config_dict(path), gen)
