"""Granite: Llama with multipliers on the embeddings, the residual branches and the
attention scores, and a divisor on the logits."""

from gpu_worker.architectures.hf_config import Architecture, Fields, common_fields


def _granite(cfg, t) -> Fields:
    return {**common_fields(cfg, t),
            "embed_scale": float(cfg.get("embedding_multiplier", 1.0)),
            "residual_scale": float(cfg.get("residual_multiplier", 1.0)),
            "attn_scale": float(cfg.get("attention_multiplier", 1.0)),
            "logits_divisor": float(cfg.get("logits_scaling", 1.0))}


GRANITE = Architecture(_granite)
