"""Milliseconds per call of the CPU attention kernel (``paged_decode.cpp``) on the shapes
the benchmark workloads give it, optionally against another version of its source.

    python -m bench.attn_kernel [--against OTHER.cpp] [--threads 1] [--repeats 30]

Shapes (fp32, 16-token blocks, blocks scattered over the cache as a busy server's are):
- ``c-decode``: workload (c)'s decode step on tiny-hd64 (1 head of 64): 64 decodes, each
  on its own table whose first 64 blocks (the 1024-token prefix) are the same blocks,
  contexts 1089..1120;
- ``c-prefill``: its prefill step: 16 requests' 64-token chunks at positions 1024..1087
  over the shared prefix (1024 query rows); ``c-chunk``: one of those chunks alone (short
  enough to time on a busy box, where a call of several ms is always preempted);
  ``c-prefix``: its first step, the 1024-token prefix as one causal chunk;
- ``b-decode``: workload (b)'s decode step on llama-100m: 32 decodes, 12 heads of 64,
  contexts 129..256;
- ``s-prefill0`` / ``s-prefill1``: the real model's (SmolLM2-135M: 9 query heads over 3
  KV heads of 64) 2k-token prompt (bench.compare's r2k) in its two 1024-token chunks,
  the first (positions 0..1023) and the second (1024..2047); ``s-decode16``: its r16
  decode step, 16 streams at contexts 130..258, and ``s-decode16-dram`` the same on a cache
  of a served size, whose blocks no CPU cache holds from one call to the next.
One layer per call. Each version of the source is built as the worker builds it
(``cpu_extension.build``, named by ISA and source hash, so two versions coexist); the
versions run alternately, ``--repeats`` timed calls each per round (the fastest call of
a round counts: on a busy box the rest is time spent waiting for a core), and each line
prints the median over rounds with the min and max, and the per-round ratio. ``--check`` also asserts both versions agree within 1e-5 (they need not be bitwise
equal: the row's arithmetic may change between versions, never within one);
``--bitwise`` asserts they are the same bits.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch

from gpu_worker.attention import cpu_kernel_backend
from gpu_worker.cpu_extension import build

BS = 16


def _scattered(n_blocks: int, g: torch.Generator) -> list[int]:
    return torch.randperm(n_blocks, generator=g).tolist()


def shapes(seed: int = 0) -> dict[str, tuple]:
    """name -> (q, k_cache, v_cache, tables, lens, scale, row_seq)."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    # (c): 4096 blocks of 1 x 64, a 64-block shared prefix
    nb, d = 4096, 64
    kc, vc = torch.randn(nb, BS, 1, d, generator=g), torch.randn(nb, BS, 1, d, generator=g)
    free = _scattered(nb, g)
    prefix, free = free[:64], free[64:]
    own = [free[i * 8:(i + 1) * 8] for i in range(64)]  # 8 own blocks: up to 128 more keys
    tables = torch.tensor([prefix + o for o in own])
    lens = torch.tensor([1024 + 64 + 1 + (i % 32) for i in range(64)])
    out["c-decode"] = (torch.randn(64, 1, d, generator=g), kc, vc, tables, lens, d ** -0.5, None)
    rows = torch.arange(16).repeat_interleave(64)
    plens = torch.arange(1025, 1089).repeat(16)
    out["c-prefill"] = (torch.randn(1024, 1, d, generator=g), kc, vc, tables[:16], plens, d ** -0.5, rows)
    out["c-chunk"] = (out["c-prefill"][0][:64], kc, vc, tables[:1], plens[:64], d ** -0.5, rows[:64])
    out["c-prefix"] = (torch.randn(1024, 1, d, generator=g), kc, vc, tables[:1], torch.arange(1, 1025), d ** -0.5,
                       torch.zeros(1024, dtype=torch.long))
    # (b): 1024 blocks of 12 x 64, 32 streams of 129..256 keys
    nb, h = 1024, 12
    kc, vc = torch.randn(nb, BS, h, d, generator=g), torch.randn(nb, BS, h, d, generator=g)
    free = _scattered(nb, g)
    tables = torch.tensor([free[i * 16:(i + 1) * 16] for i in range(32)])
    lens = torch.tensor([129 + (i * 37) % 128 for i in range(32)])
    out["b-decode"] = (torch.randn(32, h, d, generator=g), kc, vc, tables, lens, d ** -0.5, None)
    # SmolLM2-135M: 9 query heads over 3 KV heads of 64, 1024 blocks
    h, kvh = 9, 3
    kc, vc = torch.randn(nb, BS, kvh, d, generator=g), torch.randn(nb, BS, kvh, d, generator=g)
    free = _scattered(nb, g)
    prompt = torch.tensor([free[:128]])
    zeros = torch.zeros(1024, dtype=torch.long)
    out["s-prefill0"] = (torch.randn(1024, h, d, generator=g), kc, vc, prompt, torch.arange(1, 1025), d ** -0.5,
                         zeros)
    out["s-prefill1"] = (torch.randn(1024, h, d, generator=g), kc, vc, prompt, torch.arange(1025, 2049),
                         d ** -0.5, zeros)
    tables = torch.tensor([free[128 + i * 17:128 + (i + 1) * 17] for i in range(16)])
    lens = torch.tensor([130 + (i * 37) % 129 for i in range(16)])
    out["s-decode16"] = (torch.randn(16, h, d, generator=g), kc, vc, tables, lens, d ** -0.5, None)
    # the same step on a served-size cache (8192 blocks, 192 MiB of K and V: not in any cache)
    nb = 8192
    kc, vc = torch.randn(nb, BS, kvh, d, generator=g), torch.randn(nb, BS, kvh, d, generator=g)
    free = _scattered(nb, g)
    tables = torch.tensor([free[i * 17:(i + 1) * 17] for i in range(16)])
    out["s-decode16-dram"] = (torch.randn(16, h, d, generator=g), kc, vc, tables, lens, d ** -0.5, None)
    return out


def _kernel(source: Path):
    module = build(source, ["paged_attention"], openmp=True, cflags=cpu_kernel_backend.CFLAGS)
    if module is None:
        raise SystemExit(f"{source} could not be built here")
    empty, no_kv = torch.empty(0, dtype=torch.long), torch.empty(0, 0, 0)
    # (sources before the fused K/V write take 9 arguments, later ones 12)
    extra = (no_kv, no_kv, empty) if "arg11" in (module.paged_attention.__doc__ or "") else ()
    return lambda q, kc, vc, t, lens, sc, rs: module.paged_attention(
        q, kc, vc, t, empty if rs is None else rs, lens, sc, 0, 0.0, *extra)


def _best_ms(fn, args, repeats: int) -> float:
    """The fastest of ``repeats`` calls: on a shared box the others only add the time
    the call waited for a core."""
    fn(*args)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn(*args)
        times.append(time.perf_counter() - t0)
    return 1e3 * min(times)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--source", type=Path, default=cpu_kernel_backend._SOURCE)
    p.add_argument("--against", type=Path, default=None, help="another paged_decode.cpp to time alongside")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--repeats", type=int, default=30)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--shapes", default="c-decode,c-chunk,c-prefill,c-prefix,b-decode,s-prefill0,s-prefill1,s-decode16")
    p.add_argument("--check", action="store_true")
    p.add_argument("--bitwise", action="store_true")
    a = p.parse_args(argv)
    torch.set_num_threads(a.threads)
    versions = {"this": _kernel(a.source)}
    if a.against is not None:
        versions["against"] = _kernel(a.against)
    cases = shapes()
    for name in a.shapes.split(","):
        args = cases[name]
        if a.check and len(versions) == 2:
            o1, l1 = versions["this"](*args)
            o2, l2 = versions["against"](*args)
            torch.testing.assert_close(o1, o2, rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(l1, l2, rtol=1e-5, atol=1e-5)
        if a.bitwise and len(versions) == 2:
            o1, l1 = versions["this"](*args)
            o2, l2 = versions["against"](*args)
            assert torch.equal(o1, o2) and torch.equal(l1, l2), f"{name}: the versions differ in bits"
        per = {v: [] for v in versions}
        for r in range(a.rounds):
            order = list(versions) if r % 2 == 0 else list(reversed(versions))
            for v in order:
                per[v].append(_best_ms(versions[v], args, a.repeats))
        line = [f"{name:10s}"]
        for v, ms in per.items():
            line.append(f"{v}: {statistics.median(ms):8.3f} ms [{min(ms):.3f}..{max(ms):.3f}]")
        if len(per) == 2:
            ratios = sorted(x / y for x, y in zip(per["this"], per["against"]))
            line.append(f"this/against {statistics.median(ratios):.2f}x [{ratios[0]:.2f}..{ratios[-1]:.2f}]")
        print("  ".join(line), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
