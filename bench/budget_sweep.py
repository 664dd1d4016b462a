"""TTFT and throughput of Candor alone under several ``--max-num-batched-tokens``.

The step budget trades first-token latency against duplicated work: a bigger budget
prefills more prompts per step, but every request's first token then waits for the whole
step, and requests sharing an uncached prefix each recompute it in that same step (the
prefix blocks are only reusable once a step has written them). Use this to justify the
default with numbers: ``python -m bench.budget_sweep --budgets 512,1024,2048,4096``.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
from pathlib import Path

from launcher.loadgen import run
from bench.servers import WARMUP, candor_server
from bench.workloads import KV_BLOCKS, WORKLOADS, build_models, round_workload


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--budgets", default="512,1024,2048,4096")
    p.add_argument("--workloads", default="a,c")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--models-dir", default=None)
    a = p.parse_args(argv)
    models_dir = Path(a.models_dir or tempfile.mkdtemp(prefix="candor-sweep-"))
    wanted = a.workloads.split(",")
    paths = build_models(models_dir, sorted({WORKLOADS[wl].model for wl in wanted}))
    for budget in (int(b) for b in a.budgets.split(",")):
        for wl in wanted:
            bench = WORKLOADS[wl]
            model_key = bench.model
            s = candor_server(paths[model_key], model_key, a.threads, KV_BLOCKS[model_key],
                              ["--max-num-batched-tokens", str(budget)])
            s.start()
            try:
                s.wait_ready(600)
                asyncio.run(run(s.url, model_key, WARMUP))
                outs = [asyncio.run(run(s.url, model_key, round_workload(bench, r)))
                        for r in range(a.rounds)]
            finally:
                s.stop()
            tps = statistics.median(o["output_tokens_per_s"] for o in outs)
            ttft = statistics.median(o["ttft_s_p50"] for o in outs)
            print(f"budget {budget:5d} ({wl}): {tps:7.0f} tok/s, ttft p50 {1000 * ttft:6.0f} ms",
                  flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
