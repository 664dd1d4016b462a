"""An HF ``config.json`` read into the switches our one decoder implementation has.

``ModelConfig`` is what the decoder reads: sizes, and the switches an HF class hard-codes
(norm kind and placement, q/k norms, biases, activation, MLP shape, mixture of experts,
multipliers, soft-caps, and per-layer attention windows and RoPE tables). Each supported
``model_type`` is registered once in ``ARCHITECTURES``, with the family module
(``gpu_worker/architectures/``) that declares how its config sets those switches and how
its checkpoint names map onto the decoder's parameters.

Only json and msgspec here (no torch): the launcher checks a checkpoint with this module
before it starts any process.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any, Literal

import msgspec

from cluster.token_classifier import TokenClassifierError, read_token_classifier
from gpu_worker.architectures import (bert, gemma, gemma3_vision, granite, llama, llava, mixtral,
                                      olmo2, phi3, qwen, qwen2_vl, smollm3, starcoder2)
from gpu_worker.architectures.hf_config import (Architecture, EncoderSpec, LayerSpec, MoeConfig,
                                                RopeConfig, UnsupportedConfig, VisionSpec)
from gpu_worker.quantization.spec import QuantSpec, parse_quantization

# model_type -> its family's declaration: the one table of supported architectures
ARCHITECTURES: dict[str, Architecture] = {
    "llama": llama.LLAMA,
    "mistral": llama.LLAMA,
    "qwen2": qwen.QWEN2,
    "qwen3": qwen.QWEN3,
    "qwen3_moe": qwen.QWEN3_MOE,
    "mixtral": mixtral.MIXTRAL,
    "gemma2": gemma.GEMMA2,
    "gemma3_text": gemma.GEMMA3_TEXT,
    "phi3": phi3.PHI3,
    "granite": granite.GRANITE,
    "olmo2": olmo2.OLMO2,
    "smollm3": smollm3.SMOLLM3,
    "starcoder2": starcoder2.STARCODER2,
    "llava": llava.LLAVA,  # a Llama/Mistral text model behind a CLIP tower (ModelConfig.vision)
    "gemma3": gemma3_vision.GEMMA3,  # Gemma 3 text behind a SigLIP tower (ModelConfig.vision)
    "qwen2_vl": qwen2_vl.QWEN2_VL,  # Qwen2 text with M-RoPE behind Qwen's tower (ModelConfig.vision)
    "qwen2_5_vl": qwen2_vl.QWEN2_VL,
    "bert": bert.ENCODER,
    "roberta": bert.ENCODER,
    "xlm-roberta": bert.ENCODER,
}


def architecture(model_type: str) -> Architecture:
    if model_type not in ARCHITECTURES:
        raise UnsupportedConfig("model_type", model_type, ARCHITECTURES)
    return ARCHITECTURES[model_type]


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
    quantization: QuantSpec | None = None  # the weights' quantized format (quantization.spec)
    encoder: EncoderSpec | None = None  # set: a bidirectional encoder (models/encoder.py)
    # a decoder *ForSequenceClassification: its ``score`` head's outputs (0: none)
    score_labels: int = 0
    # a causal LM served as that classifier (cluster.token_classifier): the LM-head rows
    # its ``score`` head is made of, and whether it is their two-way difference (yes - no)
    score_token_ids: list[int] = []
    score_two_way: bool = False
    # set: images go in through a vision tower whose embeddings replace the placeholder
    # tokens (models/vision.py); model_type is then the text model's
    vision: VisionSpec | None = None

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


def _int_list(value: Any) -> list[int]:
    if value is None:
        return []
    return [int(v) for v in (value if isinstance(value, list) else [value])]


def parse_config(cfg: dict[str, Any], generation_cfg: dict[str, Any] | None = None) -> ModelConfig:
    """Build a ModelConfig from parsed config.json (and generation_config.json) dicts."""
    model_type = cfg.get("model_type", "llama")
    kwargs = architecture(model_type).parse(cfg, model_type)
    gen_eos = _int_list((generation_cfg or {}).get("eos_token_id"))
    kwargs["eos_token_ids"] = (gen_eos or _int_list(cfg.get("eos_token_id"))
                               or _int_list((cfg.get("text_config") or {}).get("eos_token_id")))
    kwargs["quantization"] = parse_quantization(cfg)
    archs = [str(a) for a in cfg.get("architectures") or []]
    if kwargs.get("encoder") is None and any(a.endswith("ForSequenceClassification") for a in archs):
        kwargs["score_labels"] = int(cfg.get("num_labels") or len(cfg.get("id2label") or {}) or 2)
        try:
            tokens = read_token_classifier(cfg)
        except TokenClassifierError as err:
            raise _Unsupported(str(err)) from None
        if tokens is not None:
            if kwargs["quantization"] is not None:
                raise _Unsupported("classifier_from_token reads the LM head's rows of an "
                                   "unquantized checkpoint; this one is quantized")
            kwargs["score_labels"] = tokens.num_labels
            kwargs["score_two_way"] = tokens.method == "from_2_way_softmax"
    return ModelConfig(**kwargs)


def read_config_dict(model_path: str | Path) -> dict[str, Any]:
    return json.loads((Path(model_path) / "config.json").read_text())


def load_config(model_path: str | Path) -> ModelConfig:
    """Read ``config.json`` (and ``generation_config.json`` if present) from a model dir;
    a ``classifier_from_token`` conversion gets its tokens' ids from the checkpoint's
    tokenizer (as vLLM's ``convert_tokens_to_ids``)."""
    path = Path(model_path)
    gen_path = path / "generation_config.json"
    gen = json.loads(gen_path.read_text()) if gen_path.exists() else None
    raw = read_config_dict(path)
    cfg = parse_config(raw, gen)
    tokens = read_token_classifier(raw) if cfg.score_labels else None
    if tokens is None:
        return cfg
    return msgspec.structs.replace(cfg, score_token_ids=_token_ids(path, tokens.tokens))


def _token_ids(path: Path, tokens: list[str]) -> list[int]:
    from tokenization.tokenizer_files import CheckpointTokenizer

    try:
        backend = CheckpointTokenizer(path).backend
    except FileNotFoundError as err:
        raise _Unsupported(f"classifier_from_token {tokens} needs the tokenizer: {err}") from None
    ids = [backend.token_to_id(t) for t in tokens]
    missing = [t for t, i in zip(tokens, ids) if i is None]
    if missing:
        raise _Unsupported(f"classifier_from_token: {missing} are not tokens of the "
                           "checkpoint's vocabulary")
    return [int(i) for i in ids]


class _Unsupported(UnsupportedConfig):
    """A token-classifier conversion Candor cannot make, with its reason."""

    def __init__(self, reason: str) -> None:
        ValueError.__init__(self, f"config.json: {reason}")
        self.field, self.value = "classifier_from_token", None
