"""MoE layer forward tok/s: the fused CPU kernel against the per-expert torch path.

    python -m bench.moe_kernel [--threads 1] [--seconds 0.5] [--rows 1,8,32,128,512]

The layer of ``bench.models``' qwen3moe-256 (hidden 256, 8 experts of 256, top-2),
random routing and weights; each path runs alternately for ``--seconds`` per row count,
three times, and the median is printed with the min and max (a busy box spreads them).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from gpu_worker.models import fused_moe
from gpu_worker.models.decoder import SparseMoE

from bench.models import ARCH_SHAPES, ARCH_WIDTH

HIDDEN, TOP_K = ARCH_WIDTH["hidden_size"], ARCH_SHAPES["qwen3moe-256"][2]["num_experts_per_tok"]


def _layer() -> SparseMoE:
    """One MoE layer of qwen3moe-256 (its config through the same parser), random weights."""
    from gpu_worker.model_config import parse_config
    from gpu_worker.models.parallel import TPGroup
    from gpu_worker.tp_shard import tp_shard

    _, _, extra = ARCH_SHAPES["qwen3moe-256"]
    cfg = parse_config({**ARCH_WIDTH, **extra, "model_type": "qwen3_moe", "vocab_size": 2048})
    layer = SparseMoE(cfg, TPGroup(tp_shard(cfg)))
    with torch.no_grad():
        for p in layer.parameters():
            p.normal_(0, 0.05)
    return layer.eval()


def _rate(fn, rows: int, seconds: float) -> float:
    fn()
    n, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        fn()
        n += 1
    return rows * n / (time.perf_counter() - t0)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--seconds", type=float, default=0.5)
    p.add_argument("--rows", default="1,8,32,128,512")
    a = p.parse_args(argv)
    torch.set_num_threads(a.threads)
    kernel = fused_moe.load()
    if kernel is None:
        raise SystemExit("fused_moe.cpp could not be built here")
    layer = _layer()
    first = layer.experts.first
    print(f"qwen3moe-256's MoE layer, {a.threads} thread(s); tok/s min / median / max of 3")
    print(f"{'rows':>5} {'per-expert torch':>28} {'fused kernel':>28} {'fused/torch':>12}")
    for rows in (int(r) for r in a.rows.split(",")):
        x = torch.randn(rows, HIDDEN)
        with torch.inference_mode():
            probs = torch.softmax(layer.gate(x), dim=-1)
            weights, chosen = torch.topk(probs, TOP_K, dim=-1)
            weights = weights / weights.sum(dim=-1, keepdim=True)
            paths = {"torch": lambda: layer.per_expert(x, weights, chosen),
                     "fused": lambda: kernel(x, weights, chosen, layer.experts.w13,
                                             layer.experts.w2, first)}
            rates: dict[str, list[float]] = {"torch": [], "fused": []}
            for _ in range(3):
                for name, fn in paths.items():
                    rates[name].append(_rate(fn, rows, a.seconds))
        cells = [f"{min(r):8.0f} / {statistics.median(r):8.0f} / {max(r):8.0f}" for r in rates.values()]
        ratio = statistics.median(rates["fused"]) / statistics.median(rates["torch"])
        print(f"{rows:>5} {cells[0]:>28} {cells[1]:>28} {ratio:>11.2f}x", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
