"""Throughput cost of constrained decoding: output tok/s at N streams, free vs json_schema.

Against a running server (``candor serve``). The constrained workload asks for a JSON
array of exactly ``--items`` one-digit integers (about two tokens per item, so the
grammar engine works on every step); the free workload generates the same number of
tokens with ``ignore_eos``. Rounds alternate so drift in the machine's load hits both.

    python -m bench.structured --base-url http://127.0.0.1:8000 --concurrency 32
    python -m bench.structured --serve tiny llama-100m --threads 1

``--serve`` builds each named checkpoint (bench.models) and serves it itself, one after
the other, printing one summary per model: the mask's cost is per row and per step, so
its share of a step shrinks as the model grows.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import tempfile
from pathlib import Path

from bench.servers import candor_server
from launcher.loadgen import Workload, run
from bench.models import build_llama_100m, build_tiny


def schema(items: int) -> dict:
    return {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9},
            "minItems": items, "maxItems": items}


async def measure(base_url: str, model: str, concurrency: int, items: int,
                  rounds: int) -> dict:
    constrained = Workload(num_requests=concurrency * 2, concurrency=concurrency,
                           prompt_len=(64, 64), output_len=(4 * items, 4 * items),
                           extra_body={"ignore_eos": False, "response_format": {
                               "type": "json_schema",
                               "json_schema": {"name": "digits", "schema": schema(items)}}})
    out: dict[str, list[dict]] = {"free": [], "json_schema": []}
    # warm-up, not counted: first-use costs (the grammar engine's vocabulary, the
    # schema's compile, torch's first passes) would land on whichever runs first
    for extra in (constrained.extra_body, {}):
        await run(base_url, model, Workload(num_requests=4, concurrency=4, prompt_len=(64, 64),
                                            output_len=(16, 16), seed=99, extra_body=extra))
    for _ in range(rounds):
        got = await run(base_url, model, constrained)
        out["json_schema"].append(got)
        tokens = got["output_tokens"] // max(1, got["requests"] - got["errors"])
        free = Workload(num_requests=concurrency * 2, concurrency=concurrency,
                        prompt_len=(64, 64), output_len=(tokens, tokens))
        out["free"].append(await run(base_url, model, free))
    summary = {}
    for name, runs in out.items():
        errors = sum(r["errors"] for r in runs)
        if errors:
            raise SystemExit(f"{name}: {errors} failed requests: {runs[0].get('first_error')}")
        tokens = sum(r["output_tokens"] for r in runs)
        wall = sum(r["wall_s"] for r in runs)
        summary[name] = {"output_tokens": tokens, "wall_s": round(wall, 2),
                         "output_tokens_per_s": round(tokens / wall, 1),
                         **{f"{k}_ms_p50": round(1000 * sorted(r[f"{k}_s_p50"] for r in runs)[
                             len(runs) // 2], 2) for k in ("ttft", "itl", "e2e")}}
    free, con = summary["free"]["output_tokens_per_s"], summary["json_schema"]["output_tokens_per_s"]
    summary["cost_percent"] = round(100 * (1 - con / free), 1)
    return summary


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--base-url", default="http://127.0.0.1:8000")
    p.add_argument("--model", default="tiny-llama")
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--items", type=int, default=64)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--serve", nargs="*", choices=("tiny", "llama-100m"), default=None,
                   help="serve these checkpoints here instead of using --base-url")
    p.add_argument("--threads", type=int, default=1, help="worker threads with --serve")
    args = p.parse_args(argv)
    if not args.serve:
        print(json.dumps(asyncio.run(measure(args.base_url, args.model, args.concurrency,
                                             args.items, args.rounds)), indent=2))
        return 0
    scratch = Path(tempfile.mkdtemp(prefix="candor-structured-"))
    try:
        tiny = build_tiny(scratch)
        for name in args.serve:
            path = tiny if name == "tiny" else build_llama_100m(scratch, tiny)
            server = candor_server(path, name, args.threads, 4096)
            server.start()
            try:
                server.wait_ready(600)
                summary = asyncio.run(measure(server.url, name, args.concurrency, args.items,
                                              args.rounds))
            finally:
                server.stop()
            print(json.dumps({"model": name, "threads": args.threads, **summary}), flush=True)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
