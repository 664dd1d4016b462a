"""BERT, RoBERTa and XLM-RoBERTa: bidirectional encoders (no causal mask, no KV cache
across steps: a prompt is computed whole, in one step), learned absolute position
embeddings, token-type (segment) embeddings, LayerNorm after each residual add (post-LN),
q/k/v/o and both MLP matrices with biases, erf GELU.

RoBERTa and XLM-R number positions from ``pad_token_id + 1`` (their table has two rows
more than the usable context: ``max_position_embeddings`` 514 serves 512 tokens).

A ``*ForSequenceClassification`` checkpoint (a cross-encoder) keeps its head: BERT's
``pooler`` (dense + tanh on the first token) then ``classifier``; RoBERTa's and XLM-R's
``classifier.dense`` + tanh then ``classifier.out_proj``, on the first token too.
"""

from gpu_worker.architectures.hf_config import (Architecture, EncoderSpec, Fields, LayerSpec, RopeConfig,
                                                UnsupportedConfig, WeightNames, activation)

_ROBERTA = {"roberta", "xlm-roberta"}
ENCODER_TYPES = {"bert"} | _ROBERTA


def position_offset(cfg: dict, model_type: str) -> int:
    """The first position id a sequence's first token takes."""
    return int(cfg.get("pad_token_id", 1)) + 1 if model_type in _ROBERTA else 0


def _encoder(cfg, t) -> Fields:
    kind = cfg.get("position_embedding_type", "absolute") or "absolute"
    if kind != "absolute":
        raise UnsupportedConfig("position_embedding_type", kind, {"absolute"})
    if cfg.get("is_decoder") or cfg.get("add_cross_attention"):
        raise UnsupportedConfig("is_decoder", True)
    hidden, heads, n = int(cfg["hidden_size"]), int(cfg["num_attention_heads"]), int(cfg["num_hidden_layers"])
    offset = position_offset(cfg, t)
    archs = [str(a) for a in cfg.get("architectures") or []]
    classify = any(a.endswith("ForSequenceClassification") for a in archs)
    labels = cfg.get("id2label") or {}
    num_labels = int(cfg.get("num_labels") or len(labels) or 2) if classify else 0
    head = ("roberta" if t in _ROBERTA else "bert") if classify else "none"
    return dict(
        model_type=t, vocab_size=int(cfg["vocab_size"]), hidden_size=hidden, num_layers=n,
        num_heads=heads, num_kv_heads=heads, head_dim=hidden // heads,
        intermediate_size=int(cfg["intermediate_size"]),
        rms_norm_eps=float(cfg.get("layer_norm_eps", 1e-12)), rope=RopeConfig(), ropes=[],
        layers=[LayerSpec(rope=None) for _ in range(n)],
        max_position_embeddings=int(cfg.get("max_position_embeddings", 512)) - offset,
        tie_word_embeddings=False, qkv_bias=True, o_bias=True, mlp_bias=True, norm="layer",
        norm_placement="post", mlp="plain", act=activation(cfg, default="gelu"),
        bos_token_id=cfg.get("bos_token_id"), dtype=str(cfg.get("dtype") or cfg.get("torch_dtype") or "float32"),
        encoder=EncoderSpec(type_vocab_size=int(cfg.get("type_vocab_size", 2) or 0),
                            position_offset=offset, head=head, num_labels=num_labels),
    )


# HF's separate query/key/value feed our fused qkv_proj; everything else keeps HF's name
ENCODER = Architecture(_encoder, WeightNames(
    packed={"query": ("qkv_proj", "q"), "key": ("qkv_proj", "k"), "value": ("qkv_proj", "v")}))
