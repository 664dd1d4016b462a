"""SmolLM3: Qwen's window rule, and some layers without RoPE (``no_rope_layers``, or
every ``no_rope_layer_interval``-th layer)."""

from gpu_worker.architectures.hf_config import Architecture, Fields, qwen_windows, with_layers


def _smollm3(cfg, t) -> Fields:
    out = qwen_windows(cfg, t)
    uses = cfg.get("no_rope_layers")
    if uses is None:
        interval = int(cfg.get("no_rope_layer_interval", 4))
        uses = [int((i + 1) % interval != 0) for i in range(out["num_layers"])]
    return with_layers(out, rope=[layer.rope if use else None for layer, use in zip(out["layers"], uses)])


SMOLLM3 = Architecture(_smollm3)
