"""An async load generator for any OpenAI-compatible server (streaming /v1/completions).

Clock definitions (also in the README):
- TTFT: from just before the request is sent to the arrival of the first SSE frame that
  carries generated text.
- ITL: gaps between successive text-carrying frames of one request.
- end-to-end latency: from just before sending to the arrival of ``data: [DONE]``.
- output tokens: ``usage.completion_tokens`` of the final usage chunk
  (``stream_options.include_usage``), so a frame carrying several tokens counts right. A
  server that sends no usage in a stream (llama-cpp-python) is counted ``max_tokens``
  when it finished for ``length``, else one per text frame. A stream that ends before
  any ``finish_reason`` or usage was cut short: an error.

Prompts are token-id lists drawn from a fixed seed, so every server sees the same
workload and prompt lengths are exact; ``ignore_eos`` makes output lengths exact. For a
server that takes no token ids, ``text_tokenizer`` (a tokenizer.json) sends those ids
decoded as text instead (its own tokenizer then counts them, about as many), and
``length_by="min_tokens"`` asks for exact lengths by ``min_tokens = max_tokens``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import time
from collections import Counter
from dataclasses import asdict, dataclass, field

import aiohttp


@dataclass
class Workload:
    num_requests: int = 32
    concurrency: int = 32
    request_rate: float | None = None     # requests/s (Poisson); None: closed loop
    prompt_len: tuple[int, int] = (128, 128)
    output_len: tuple[int, int] = (128, 128)
    shared_prefix_len: int = 0
    vocab_low: int = 300
    vocab_high: int = 1800
    seed: int = 0
    extra_body: dict = field(default_factory=dict)  # merged into every request body
    text_tokenizer: str | None = None  # a tokenizer.json: prompts go as their decoded text
    length_by: str = "ignore_eos"  # or "min_tokens": how each output is held to its length

    def prompts(self) -> list[tuple[list[int] | str, int]]:
        ids = self.prompt_ids()
        if self.text_tokenizer is None:
            return ids
        from tokenizers import Tokenizer
        tok = Tokenizer.from_file(self.text_tokenizer)
        return [(tok.decode(p), n) for p, n in ids]

    def length_fields(self, max_tokens: int) -> dict:
        if self.length_by == "ignore_eos":
            return {"ignore_eos": True}
        if self.length_by == "min_tokens":
            return {"min_tokens": max_tokens}
        raise ValueError(f"length_by {self.length_by!r}: ignore_eos or min_tokens")

    def prompt_ids(self) -> list[tuple[list[int], int]]:
        rng = random.Random(self.seed)
        prefix = [rng.randrange(self.vocab_low, self.vocab_high)
                  for _ in range(self.shared_prefix_len)]
        out = []
        for _ in range(self.num_requests):
            n = rng.randint(*self.prompt_len)
            body = [rng.randrange(self.vocab_low, self.vocab_high) for _ in range(n)]
            out.append((prefix + body, rng.randint(*self.output_len)))
        return out


@dataclass
class RequestResult:
    ok: bool
    ttft_s: float = 0.0
    e2e_s: float = 0.0
    itl_s: list[float] = field(default_factory=list)
    output_tokens: int = 0
    error: str = ""


async def _one(session: aiohttp.ClientSession, url: str, model: str, prompt: list[int] | str,
               max_tokens: int, extra_body: dict | None = None,
               length_fields: dict | None = None) -> RequestResult:
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            **(length_fields if length_fields is not None else {"ignore_eos": True}),
            "stream": True, "stream_options": {"include_usage": True}, **(extra_body or {})}
    start = time.perf_counter()
    first = last = None
    itl: list[float] = []
    tokens = None
    frames, finish = 0, None
    try:
        async with session.post(url, json=body) as resp:
            if resp.status != 200:
                return RequestResult(False, error=f"HTTP {resp.status}: {(await resp.text())[:200]}")
            async for raw in resp.content:
                line = raw.strip()
                if not line.startswith(b"data: "):
                    continue
                data = line[6:]
                now = time.perf_counter()
                if data == b"[DONE]":
                    if finish is None and tokens is None:  # llama-cpp-python's interrupt
                        return RequestResult(False, error="[DONE] before any finish_reason")
                    if tokens is None:  # no usage chunk: see the module's docstring
                        tokens = max_tokens if finish == "length" else frames
                    return RequestResult(True, (first or now) - start, now - start, itl, tokens)
                chunk = json.loads(data)
                if "error" in chunk:
                    return RequestResult(False, error=chunk["error"]["message"])
                if chunk.get("usage") and not chunk.get("choices"):
                    tokens = chunk["usage"]["completion_tokens"]
                if chunk.get("choices"):
                    finish = chunk["choices"][0].get("finish_reason") or finish
                if chunk.get("choices") and chunk["choices"][0].get("text"):
                    frames += 1
                    if first is None:
                        first = now
                    else:
                        itl.append(now - last)
                    last = now
    except (aiohttp.ClientError, asyncio.TimeoutError) as err:
        return RequestResult(False, error=repr(err))
    return RequestResult(False, error="stream ended without [DONE]")


def _pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    values = sorted(values)
    return values[min(len(values) - 1, int(round(q / 100 * (len(values) - 1))))]


def summarize(results: list[RequestResult], wall_s: float) -> dict:
    ok = [r for r in results if r.ok]
    ttft = [r.ttft_s for r in ok]
    e2e = [r.e2e_s for r in ok]
    itl = [x for r in ok for x in r.itl_s]
    out_tokens = sum(r.output_tokens for r in ok)
    summary = {"requests": len(results), "errors": len(results) - len(ok),
               "wall_s": wall_s, "output_tokens": out_tokens,
               "output_tokens_per_s": out_tokens / wall_s if wall_s else 0.0,
               "requests_per_s": len(ok) / wall_s if wall_s else 0.0}
    for name, values in (("ttft_s", ttft), ("itl_s", itl), ("e2e_s", e2e)):
        for q in (50, 90, 99):
            summary[f"{name}_p{q}"] = _pct(values, q)
        summary[f"{name}_mean"] = statistics.fmean(values) if values else float("nan")
    if len(ok) != len(results):
        summary["first_error"] = next(r.error for r in results if not r.ok)
        reasons = Counter(r.error for r in results if not r.ok)
        summary["errors_by_reason"] = dict(reasons.most_common())
    return summary


async def run(base_url: str, model: str, workload: Workload) -> dict:
    url = base_url.rstrip("/") + "/v1/completions"
    prompts = workload.prompts()
    sem = asyncio.Semaphore(workload.concurrency)
    rng = random.Random(workload.seed + 1)
    timeout = aiohttp.ClientTimeout(total=None, sock_read=600)
    async with aiohttp.ClientSession(timeout=timeout,
                                     connector=aiohttp.TCPConnector(limit=0)) as session:
        async def guarded(prompt, n):
            async with sem:
                return await _one(session, url, model, prompt, n, workload.extra_body,
                                  workload.length_fields(n))

        start = time.perf_counter()
        tasks = []
        for prompt, n in prompts:
            tasks.append(asyncio.create_task(guarded(prompt, n)))
            if workload.request_rate:
                await asyncio.sleep(rng.expovariate(workload.request_rate))
        results = await asyncio.gather(*tasks)
        wall = time.perf_counter() - start
    return {"workload": asdict(workload), **summarize(results, wall)}


MAX_REASONS_SHOWN = 8


def format_table(summary: dict) -> str:
    rows = [("requests (errors)", f"{summary['requests']} ({summary['errors']})"),
            ("wall time", f"{summary['wall_s']:.2f} s"),
            ("output tokens/s", f"{summary['output_tokens_per_s']:.1f}"),
            ("requests/s", f"{summary['requests_per_s']:.2f}")]
    for name, label in (("ttft_s", "TTFT"), ("itl_s", "ITL"), ("e2e_s", "end-to-end")):
        rows.append((f"{label} p50/p90/p99", " / ".join(
            f"{summary[f'{name}_p{q}'] * 1000:.1f}" for q in (50, 90, 99)) + " ms"))
    width = max(len(r[0]) for r in rows)
    lines = [f"{k.ljust(width)}  {v}" for k, v in rows]
    reasons = summary.get("errors_by_reason", {})
    if reasons:
        lines.append(f"why {summary['errors']} requests failed:")
        for i, (why, count) in enumerate(reasons.items()):
            if i == MAX_REASONS_SHOWN:
                lines.append(f"  ... and {len(reasons) - i} other reasons (--json lists all)")
                break
            lines.append(f"  {count:>5} x {why}")
    return "\n".join(lines)


def _range(text: str) -> tuple[int, int]:
    lo, _, hi = text.partition(":")
    return int(lo), int(hi or lo)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="candor bench", description=__doc__.split("\n\n")[0])
    p.add_argument("--base-url", default="http://127.0.0.1:8000")
    p.add_argument("--model", default="tiny-llama")
    p.add_argument("--num-requests", type=int, default=32)
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--request-rate", type=float, default=None)
    p.add_argument("--prompt-len", type=_range, default=(128, 128), help="LO[:HI] tokens")
    p.add_argument("--output-len", type=_range, default=(128, 128), help="LO[:HI] tokens")
    p.add_argument("--shared-prefix-len", type=int, default=0)
    p.add_argument("--vocab-range", type=_range, default=(300, 1800))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.add_argument("--extra-body", type=json.loads, default={},
                   help='JSON object merged into every request, e.g. \'{"logit_bias": {"5": 2}}\'')
    a = p.parse_args(argv)
    workload = Workload(a.num_requests, a.concurrency, a.request_rate, a.prompt_len,
                        a.output_len, a.shared_prefix_len, a.vocab_range[0], a.vocab_range[1],
                        a.seed, a.extra_body)
    summary = asyncio.run(run(a.base_url, a.model, workload))
    print(json.dumps(summary, indent=2) if a.json else format_table(summary))
    return 0 if summary["errors"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
