"""Throughput of one engine vs tensor- and data-parallel topologies on this machine.

    python -m bench.scale_bench [--requests 32] [--concurrency 16] [--rounds 2]

Serves the ~100M Llama (random weights, ``bench.models``) as TP=1, TP=2 and DP=2, each
gpu_worker rank with ``--threads`` threads, and loads each with the same ``candor bench``
workload (fresh seed per round, so no prefix cache carries over). On a machine with fewer
cores than ranks x threads no speed-up is expected: the ranks share the cores, and TP
adds two all-reduces per layer; the numbers say what the overhead costs here.
"""

from __future__ import annotations

import argparse
import asyncio
import shutil
import statistics
import tempfile
from pathlib import Path

from bench.servers import candor_server
from launcher.loadgen import Workload, run
from bench.models import build_llama_100m, build_tiny

TOPOLOGIES = {"TP=1 DP=1": [], "TP=2": ["--tensor-parallel-size", "2"],
              "DP=2": ["--data-parallel-size", "2"]}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--requests", type=int, default=32)
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--threads", type=int, default=1, help="threads per gpu_worker rank")
    p.add_argument("--only", nargs="*", default=list(TOPOLOGIES))
    a = p.parse_args(argv)
    scratch = Path(tempfile.mkdtemp(prefix="candor-scale-"))
    try:
        model = build_llama_100m(scratch, build_tiny(scratch))
        rows = []
        for name in a.only:
            server = candor_server(model, "llama-100m", a.threads, 1024, TOPOLOGIES[name])
            server.start()
            try:
                server.wait_ready(600)
                asyncio.run(run(server.url, "llama-100m", Workload(
                    num_requests=4, concurrency=4, prompt_len=(32, 32), output_len=(8, 8), seed=99)))
                runs = []
                for r in range(a.rounds):
                    w = Workload(num_requests=a.requests, concurrency=a.concurrency,
                                 prompt_len=(a.prompt_len, a.prompt_len),
                                 output_len=(a.output_len, a.output_len), seed=1000 * r + 1)
                    runs.append(asyncio.run(run(server.url, "llama-100m", w)))
                    print(f"[{name} round {r}] {runs[-1]['output_tokens_per_s']:.0f} tok/s, "
                          f"errors {runs[-1]['errors']}", flush=True)
            finally:
                server.stop()
            rows.append((name, statistics.median(x["output_tokens_per_s"] for x in runs),
                         statistics.median(x["ttft_s_p50"] for x in runs),
                         statistics.median(x["itl_s_p50"] for x in runs),
                         sum(x["errors"] for x in runs)))
        print(f"\n{a.requests} requests, concurrency {a.concurrency}, {a.prompt_len} -> "
              f"{a.output_len} tokens, {a.threads} thread(s) per rank, median of {a.rounds}")
        print("| topology | output tok/s | TTFT p50 (ms) | ITL p50 (ms) | errors |")
        print("|---|---|---|---|---|")
        for name, tps, ttft, itl, errors in rows:
            print(f"| {name} | {tps:.0f} | {1000 * ttft:.0f} | {1000 * itl:.1f} | {errors} |")
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
