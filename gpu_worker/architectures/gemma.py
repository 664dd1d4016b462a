"""Gemma 2 and Gemma 3 (text): zero-centred RMS norms (``x * (1 + w)``) around both the
attention and the MLP (sandwich), embeddings scaled by sqrt(hidden), the score scale from
``query_pre_attn_scalar``, attention scores and final logits soft-capped where the config
says so (Gemma 2's do), tied embeddings by default. Gemma 2 slides on even layers;
Gemma 3 normalises q and k per head, slides on all but every
``sliding_window_pattern``-th layer and gives sliding layers their own RoPE base."""

from gpu_worker.architectures.hf_config import (Architecture, Fields, RopeConfig, UnsupportedConfig,
                                                common_fields, with_layers)


def _gemma(cfg, t, sliding) -> Fields:
    out = common_fields(cfg, t, default_sliding=sliding, act_key="hidden_activation")
    if cfg.get("use_bidirectional_attention"):
        raise UnsupportedConfig("use_bidirectional_attention", True)
    out.update(norm="rms_1p", norm_placement="sandwich", embed_scale_sqrt_hidden=True,
               attn_scale=float(cfg.get("query_pre_attn_scalar") or out["head_dim"]) ** -0.5,
               attn_softcap=cfg.get("attn_logit_softcapping"), final_softcap=cfg.get("final_logit_softcapping"),
               tie_word_embeddings=bool(cfg.get("tie_word_embeddings", True)))
    return out


def _gemma2(cfg, t) -> Fields:
    return _gemma(cfg, t, lambda i: i % 2 == 0)


def _gemma3(cfg, t) -> Fields:
    pattern = int(cfg.get("sliding_window_pattern") or cfg.get("_sliding_window_pattern") or 6)
    out = _gemma(cfg, t, lambda i: (i + 1) % pattern != 0)
    if "rope_local_base_freq" in cfg and len(out["ropes"]) == 1:
        # transformers 4 layout: global layers take rope_theta (+ scaling), local ones the local base
        out["ropes"] = [out["ropes"][0], RopeConfig(theta=float(cfg["rope_local_base_freq"]))]
        out = with_layers(out, rope=[1 if layer.window else 0 for layer in out["layers"]])
    return {**out, "qk_norm": "head"}


GEMMA2 = Architecture(_gemma2)
GEMMA3_TEXT = Architecture(_gemma3)
