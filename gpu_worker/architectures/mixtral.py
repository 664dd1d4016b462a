"""Mixtral: every layer's MLP is a mixture of experts (top-k weights always
renormalised), stored as ``block_sparse_moe.experts.{e}.w1`` (gate), ``w3`` (up) and
``w2`` (down)."""

from gpu_worker.architectures.hf_config import (Architecture, Fields, MoeConfig, WeightNames, common_fields,
                                                with_layers)


def _mixtral(cfg, t) -> Fields:
    out = common_fields(cfg, t)
    out["moe"] = MoeConfig(int(cfg.get("num_local_experts") or cfg["num_experts"]), int(cfg["num_experts_per_tok"]),
                           int(cfg["intermediate_size"]), True)
    return with_layers(out, moe=[True] * out["num_layers"])


MIXTRAL = Architecture(_mixtral, WeightNames(
    renames={".block_sparse_moe.": ".mlp."},
    experts={"w1": ("w13", 0), "w3": ("w13", 1), "w2": ("w2", None)}))
