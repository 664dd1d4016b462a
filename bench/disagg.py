"""Decode latency while long prompts keep arriving: colocated DP=2 vs prefill/decode split.

    python -m bench.disagg [--model tiny|llama-100m] [--rounds 1] [--chunk 256]
                           [--only P=1/D=1] [--repo /path/to/another/checkout]
    python -m bench.disagg --store [--rounds 4]  (the shared KV store: bench/store_hits.py)

The interference disaggregation removes: on a colocated replica a long prompt's prefill
chunks share steps with running decodes, so their inter-token latency (ITL) spikes; with
P=1/D=1 prefill runs on its own replica and decodes only wait for KV imports. Each
topology serves the same two workloads at once: ``--streams`` decode streams (short
prompt, long output) and ``--long`` long prompts arriving at ``--rate`` per second (a
few tokens each). Reported: the decode streams' ITL p50/p99, the long prompts' TTFT, and
for the split the KV bytes moved and transfer seconds per prompt token (from /metrics).
The long prompts' ITL includes their first decode gap, where the split waits for the
KV: with ``--chunk`` below the prompt length the prompt is prefilled in chunks and each
chunk's blocks leave while the next computes. ``--repo`` runs the servers from another
checkout (the same bench before and after a change).
Both topologies run two engine replicas on the same cores; on a 2-core box the
processes fight for them, so the overhead may dominate: the numbers say what it costs.
"""

from __future__ import annotations

import argparse
import asyncio
import shutil
import statistics
import tempfile
import urllib.request
from pathlib import Path

from launcher.loadgen import Workload, run
from bench.models import build_llama_100m, build_tiny
from bench.servers import REPO, candor_server

TOPOLOGIES = {"colocated DP=2": ["--data-parallel-size", "2"],
              "P=1/D=1": ["--prefill-replicas", "1", "--decode-replicas", "1"]}


def metric_sum(base_url: str, name: str, **labels: str) -> float:
    """Sum of ``name``'s samples whose labels include ``labels`` (one scrape)."""
    with urllib.request.urlopen(base_url + "/metrics", timeout=10) as resp:
        text = resp.read().decode()
    total = 0.0
    for line in text.splitlines():
        if not line.startswith(name + "{") and not line.startswith(name + " "):
            continue
        series, value = line.rsplit(" ", 1)
        if all(f'{k}="{v}"' in series for k, v in labels.items()):
            total += float(value)
    return total


async def _round(url: str, served: str, a: argparse.Namespace, seed: int) -> tuple[dict, dict]:
    streams = Workload(num_requests=a.streams, concurrency=a.streams, prompt_len=(32, 32),
                       output_len=(a.stream_tokens, a.stream_tokens), seed=seed)
    long = Workload(num_requests=a.long, concurrency=a.long, request_rate=a.rate,
                    prompt_len=(a.long_len, a.long_len), output_len=(4, 4), seed=seed + 1)
    return tuple(await asyncio.gather(run(url, served, streams), run(url, served, long)))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", choices=["tiny", "llama-100m"], default="tiny")
    p.add_argument("--streams", type=int, default=4)
    p.add_argument("--stream-tokens", type=int, default=96)
    p.add_argument("--long", type=int, default=6)
    p.add_argument("--long-len", type=int, default=900)
    p.add_argument("--rate", type=float, default=1.0, help="long prompts per second")
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--threads", type=int, default=1, help="threads per gpu_worker rank")
    p.add_argument("--store", action="store_true",
                   help="instead: the shared KV store's hit rate (bench/store_hits.py)")
    p.add_argument("--prompts", type=int, default=7, help="--store: distinct prompts")
    p.add_argument("--prompt-len", type=int, default=512, help="--store: their length")
    p.add_argument("--chunk", type=int, default=None,
                   help="--max-num-batched-tokens of both topologies (prefill chunk size)")
    p.add_argument("--only", choices=list(TOPOLOGIES), default=None)
    p.add_argument("--repo", type=Path, default=REPO, help="the checkout serving")
    a = p.parse_args(argv)
    chunk = ["--max-num-batched-tokens", str(a.chunk)] if a.chunk else []
    scratch = Path(tempfile.mkdtemp(prefix="candor-disagg-"))
    try:
        tiny = build_tiny(scratch)
        model = tiny if a.model == "tiny" else build_llama_100m(scratch, tiny)
        if a.store:
            from bench.store_hits import store_bench
            store_bench(model, a.model, a, metric_sum)
            return 0
        rows = []
        for name, flags in TOPOLOGIES.items():
            if a.only not in (None, name):
                continue
            server = candor_server(model, a.model, a.threads, None, [*flags, *chunk],
                                   repo=a.repo)
            server.start()
            try:
                server.wait_ready(600)
                asyncio.run(run(server.url, a.model, Workload(
                    num_requests=2, concurrency=2, prompt_len=(32, 32), output_len=(4, 4),
                    seed=99)))
                moved0 = metric_sum(server.url, "candor_kv_transfer_bytes_total",
                                    direction="received")
                secs0 = metric_sum(server.url, "candor_kv_transfer_seconds_sum")
                runs = [asyncio.run(_round(server.url, a.model, a, 1000 * r + 1))
                        for r in range(a.rounds)]
                moved = metric_sum(server.url, "candor_kv_transfer_bytes_total",
                                   direction="received") - moved0
                secs = metric_sum(server.url, "candor_kv_transfer_seconds_sum") - secs0
            finally:
                server.stop()
            prompt_tokens = a.rounds * (a.streams * 32 + a.long * a.long_len)
            rows.append((name,
                         statistics.median(s["itl_s_p50"] for s, _ in runs),
                         statistics.median(s["itl_s_p99"] for s, _ in runs),
                         statistics.median(lg["ttft_s_p50"] for _, lg in runs),
                         statistics.median(lg["itl_s_p99"] for _, lg in runs),
                         sum(s["errors"] + lg["errors"] for s, lg in runs),
                         moved / prompt_tokens, secs / prompt_tokens))
            print(f"[{name}] done", flush=True)
        print(f"\n{a.model}: {a.streams} decode streams (32 -> {a.stream_tokens} tokens) while "
              f"{a.long} prompts of {a.long_len} tokens arrive at {a.rate}/s; "
              f"{a.threads} thread(s) per rank, chunk {a.chunk or 'default'}, median of "
              f"{a.rounds}; served from {a.repo}")
        print("| topology | decode ITL p50 (ms) | decode ITL p99 (ms) | long-prompt TTFT p50 "
              "(ms) | long-prompt ITL p99 (ms) | errors | KV bytes / prompt token | "
              "transfer µs / prompt token |")
        print("|---|---|---|---|---|---|---|---|")
        for name, p50, p99, ttft, long_itl, errors, bpt, spt in rows:
            print(f"| {name} | {1000 * p50:.1f} | {1000 * p99:.1f} | {1000 * ttft:.0f} | "
                  f"{1000 * long_itl:.0f} | {errors} | {bpt:.0f} | {1e6 * spt:.1f} |")
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
