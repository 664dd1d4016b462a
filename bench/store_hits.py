"""The shared KV store's hit rate: DP=2 round-robin, with and without ``--kv-store-size``.

    python -m bench.disagg --store [--model tiny|llama-100m] [--prompts 7] [--rounds 4]

``--prompts`` distinct prompts of ``--prompt-len`` token ids are sent ``--rounds`` times,
one after another (an odd count, so round robin sends a prompt to the other replica each
round: without a store its second visit is a miss on a replica that never saw it).
Reported: the share of prompt tokens served from cache (``cached_tokens``), the store's
hit and miss blocks, and the mean time to the answer (4 tokens) per round after the first.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
import urllib.request
from pathlib import Path

from bench.servers import candor_server

SETUPS = {"DP=2 round robin": [], "DP=2 round robin + kv store":
          ["--kv-store-size", "1"]}


def _complete(url: str, model: str, ids: list[int]) -> tuple[int, int, float]:
    body = json.dumps({"model": model, "prompt": ids, "max_tokens": 4, "temperature": 0,
                       "ignore_eos": True}).encode()
    req = urllib.request.Request(url + "/v1/completions", data=body,
                                 headers={"Content-Type": "application/json"})
    started = time.perf_counter()
    with urllib.request.urlopen(req, timeout=300) as resp:
        usage = json.loads(resp.read())["usage"]
    return (usage["prompt_tokens"], usage["prompt_tokens_details"]["cached_tokens"],
            time.perf_counter() - started)


def store_bench(model: Path, served: str, a: argparse.Namespace, metric_sum) -> None:
    rng = random.Random(7)
    prompts = [[rng.randrange(300, 1800) for _ in range(a.prompt_len)]
               for _ in range(a.prompts)]
    rows = []
    for name, flags in SETUPS.items():
        server = candor_server(model, served, a.threads, None,
                               ["--data-parallel-size", "2", "--data-parallel-routing",
                                "round_robin", *flags])
        server.start()
        try:
            server.wait_ready(600)
            _complete(server.url, served, [5, 6, 7])  # warm both replicas
            _complete(server.url, served, [5, 6, 7])
            prompt = cached = 0
            later: list[float] = []
            for r in range(a.rounds):
                for ids in prompts:
                    p, c, s = _complete(server.url, served, ids)
                    prompt, cached = prompt + p, cached + c
                    if r:
                        later.append(s)
                time.sleep(0.5)  # the store's puts are write-behind
            hits = metric_sum(server.url, "candor_kv_store_hits_total")
            misses = metric_sum(server.url, "candor_kv_store_misses_total")
        finally:
            server.stop()
        rows.append((name, cached / prompt, hits, misses, statistics.mean(later)))
        print(f"[{name}] done", flush=True)
    print(f"\n{served}: {a.prompts} prompts of {a.prompt_len} tokens, {a.rounds} rounds "
          f"in turn, 4 tokens each, one request at a time")
    print("| setup | prompt tokens from cache | store hit blocks | store miss blocks | "
          "mean latency, rounds 2+ (ms) |")
    print("|---|---|---|---|---|")
    for name, rate, hits, misses, lat in rows:
        print(f"| {name} | {100 * rate:.1f}% | {hits:.0f} | {misses:.0f} | {1000 * lat:.0f} |")
