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

from bench.compare import WORKLOADS, candor_server
from bench.loadgen import Workload, run
from bench.models import build_llama_100m, build_tiny, build_tiny_hd64


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--budgets", default="512,1024,2048,4096")
    p.add_argument("--workloads", default="a,c")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--models-dir", default=None)
    a = p.parse_args(argv)
    models_dir = Path(a.models_dir or tempfile.mkdtemp(prefix="candor-sweep-"))
    models_dir.mkdir(parents=True, exist_ok=True)
    tiny = build_tiny(models_dir)
    paths = {"tiny-hd64": build_tiny_hd64(models_dir, tiny)}
    wanted = a.workloads.split(",")
    if "b" in wanted:
        paths["llama-100m"] = build_llama_100m(models_dir, tiny)
    for budget in (int(b) for b in a.budgets.split(",")):
        for wl in wanted:
            model_key, workload = WORKLOADS[wl]
            kv = 1024 if model_key == "llama-100m" else 4096
            s = candor_server(paths[model_key], model_key, a.threads, kv,
                              ["--max-num-batched-tokens", str(budget)])
            s.start()
            try:
                s.wait_ready(600)
                warm = Workload(num_requests=4, concurrency=4, prompt_len=(64, 64),
                                output_len=(8, 8), seed=99)
                asyncio.run(run(s.url, model_key, warm))
                outs = [asyncio.run(run(s.url, model_key,
                                        Workload(**{**workload.__dict__, "seed": 1000 * r + 1})))
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
