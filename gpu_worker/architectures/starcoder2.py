"""Starcoder2: LayerNorm (``norm_epsilon``), biases everywhere (``use_bias``), a plain
fc -> activation -> proj MLP named ``c_fc`` / ``c_proj``, tied embeddings by default."""

from gpu_worker.architectures.hf_config import SEPARATE_QKV, Architecture, Fields, WeightNames, common_fields


def _starcoder2(cfg, t) -> Fields:
    bias = bool(cfg.get("use_bias", True))
    return {**common_fields(cfg, t), "norm": "layer", "rms_norm_eps": float(cfg.get("norm_epsilon", 1e-5)),
            "mlp": "plain", "qkv_bias": bias, "o_bias": bias, "mlp_bias": bias,
            "tie_word_embeddings": bool(cfg.get("tie_word_embeddings", True))}


STARCODER2 = Architecture(_starcoder2, WeightNames(packed=dict(SEPARATE_QKV)))
