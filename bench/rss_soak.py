"""RSS of every Candor process across many mixed requests: does anything leak?

    python -m bench.rss_soak [--requests 10000] [--concurrency 16] [candor serve flags...]

Starts `candor serve` on the deterministic tiny model, sends a mix of whole and streamed
completions and chats, n > 1 sampling, echo + logprobs, stop strings, requests that are
refused (bad fields, unknown model, broken JSON) and streams the client abandons midway,
and samples each child's RSS (VmRSS from /proc) every tenth of the run. Prints one row per
process: RSS after the warm-up tenth, at the end, and the growth between them.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import tempfile
import time
from pathlib import Path

import aiohttp

from bench.servers import candor_server
from bench.models import build_tiny

MODEL = "tiny"


def _children(pid: int) -> dict[str, int]:
    """role[index] -> pid for the launcher's children."""
    out = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            args = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if int(stat.rsplit(")", 1)[1].split()[1]) != pid or len(args) < 4:
            continue
        try:
            cfg = json.loads(args[3])
        except ValueError:
            continue
        out[f"{cfg['role']}[{cfg['index']}]"] = int(entry.name)
    return out


def _rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def _request(i: int) -> tuple[str, dict | bytes, str]:
    """(route, body, kind) for the i-th request of the mix."""
    rng = random.Random(i)
    prompt = " ".join(rng.choice(["alpha", "beta", "gamma", "delta", "story", "once"])
                      for _ in range(rng.randint(3, 40)))
    chat = {"model": MODEL, "messages": [{"role": "user", "content": prompt}],
            "max_tokens": rng.randint(1, 24)}
    comp = {"model": MODEL, "prompt": prompt, "max_tokens": rng.randint(1, 24)}
    kind = i % 10
    if kind == 0:
        return "/v1/completions", {**comp, "stream": True}, "stream"
    if kind == 1:
        return "/v1/chat/completions", {**chat, "stream": True, "n": 2,
                                        "temperature": 0.8, "seed": i}, "stream"
    if kind == 2:
        return "/v1/completions", {**comp, "echo": True, "logprobs": 2}, "whole"
    if kind == 3:
        return "/v1/chat/completions", {**chat, "n": 3, "temperature": 1.0}, "whole"
    if kind == 4:
        return "/v1/completions", {**comp, "stop": ["ta", "ga", "be"]}, "whole"
    if kind == 5:
        return "/v1/completions", {**comp, "max_tokens": 2 ** 64}, "refused"
    if kind == 6:
        return "/v1/chat/completions", {**chat, "model": "nope"}, "refused"
    if kind == 7:
        return "/v1/completions", b'{"model": "tiny", "prompt": ', "refused"
    if kind == 8:
        return "/v1/completions", {**comp, "max_tokens": 64, "ignore_eos": True,
                                   "stream": True}, "abandon"
    return "/v1/chat/completions", chat, "whole"


async def _send(session: aiohttp.ClientSession, url: str, i: int, tally: dict) -> None:
    route, body, kind = _request(i)
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    try:
        async with session.post(url + route, data=data,
                                headers={"Content-Type": "application/json"}) as resp:
            if kind == "abandon":
                await resp.content.readline()  # first frame, then hang up
            else:
                await resp.read()
            tally[resp.status] = tally.get(resp.status, 0) + 1
    except aiohttp.ClientError as exc:
        tally[type(exc).__name__] = tally.get(type(exc).__name__, 0) + 1


async def soak(url: str, launcher_pid: int, requests: int, concurrency: int) -> dict:
    samples: list[tuple[int, dict[str, float]]] = []
    tally: dict = {}
    every = max(1, requests // 10)
    sem = asyncio.Semaphore(concurrency)
    children = _children(launcher_pid)

    async def one(i: int, session: aiohttp.ClientSession) -> None:
        async with sem:
            await _send(session, url, i, tally)

    timeout = aiohttp.ClientTimeout(total=120)
    started = time.monotonic()
    async with aiohttp.ClientSession(timeout=timeout) as session:
        for chunk_start in range(0, requests, every):
            chunk = range(chunk_start, min(requests, chunk_start + every))
            await asyncio.gather(*(one(i, session) for i in chunk))
            samples.append((chunk.stop, {name: _rss_mb(pid) for name, pid in children.items()}))
    return {"samples": samples, "tally": tally, "wall_s": time.monotonic() - started}


def report(result: dict) -> str:
    samples = result["samples"]
    (warm_n, warm), (end_n, end) = samples[0], samples[-1]
    lines = [f"{end_n} requests in {result['wall_s']:.0f} s; answers: "
             + ", ".join(f"{k}: {v}" for k, v in sorted(result["tally"].items(), key=str)),
             "", f"| process | RSS after {warm_n} (MB) | RSS after {end_n} (MB) | growth (MB) |",
             "|---|---|---|---|"]
    for name in sorted(end):
        lines.append(f"| {name} | {warm[name]:.1f} | {end[name]:.1f} | "
                     f"{end[name] - warm[name]:+.1f} |")
    lines += ["", "RSS per tenth of the run (MB): " + "; ".join(
        f"{n}: " + ", ".join(f"{k.split('[')[0]} {v:.0f}" for k, v in sorted(s.items()))
        for n, s in samples)]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=10_000)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--threads", type=int, default=1)
    args, serve_flags = parser.parse_known_args(argv)  # the rest goes to `candor serve`
    model = build_tiny(Path(tempfile.mkdtemp(prefix="candor-soak-")) / "tiny")
    server = candor_server(model, MODEL, args.threads, None, serve_flags)
    server.start()
    try:
        server.wait_ready(300)
        result = asyncio.run(soak(server.url, server.proc.pid, args.requests,
                                  args.concurrency))
    finally:
        server.stop()
    print(report(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
