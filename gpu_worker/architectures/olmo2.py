"""OLMo 2: norms after the attention and the MLP (not before), and RMS norms over the
whole q and k projections (all heads at once)."""

from gpu_worker.architectures.hf_config import Architecture, Fields, common_fields


def _olmo2(cfg, t) -> Fields:
    return {**common_fields(cfg, t), "norm_placement": "post", "qk_norm": "full"}


OLMO2 = Architecture(_olmo2)
