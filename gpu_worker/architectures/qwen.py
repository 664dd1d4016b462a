"""Qwen 2 and 3 (dense and MoE): windows only with ``use_sliding_window``; Qwen2 always
has q/k/v biases and never an o_proj bias; Qwen3 normalises q and k per head; Qwen3-MoE
routes the layers ``mlp_only_layers`` and ``decoder_sparse_step`` leave sparse through
experts named ``mlp.experts.{e}.{gate,up,down}_proj`` (router ``mlp.gate``)."""

from gpu_worker.architectures.hf_config import Architecture, Fields, MoeConfig, qwen_windows, with_layers


def _qwen2(cfg, t) -> Fields:
    return {**qwen_windows(cfg, t), "qkv_bias": True, "o_bias": False}


def _qwen3(cfg, t) -> Fields:
    return {**qwen_windows(cfg, t), "qk_norm": "head"}


def _qwen3_moe(cfg, t) -> Fields:
    out = _qwen3(cfg, t)
    n = out["num_layers"]
    sparse = set(range(n)) - set(cfg.get("mlp_only_layers") or [])
    step = int(cfg.get("decoder_sparse_step", 1) or 1)
    n_exp = int(cfg.get("num_experts") or cfg.get("num_local_experts") or 0)
    out["moe"] = MoeConfig(n_exp, int(cfg["num_experts_per_tok"]), int(cfg["moe_intermediate_size"]),
                           bool(cfg.get("norm_topk_prob", False)))
    return with_layers(out, moe=[i in sparse and n_exp > 0 and (i + 1) % step == 0 for i in range(n)])


QWEN2 = Architecture(_qwen2)
QWEN3 = Architecture(_qwen3)
QWEN3_MOE = Architecture(_qwen3_moe)
