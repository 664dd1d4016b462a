"""Worker forward time per step for workload (c)'s steps, runner level (no servers, no
IPC), with the attention kernel built from this checkout's source or another one.

    python -m bench.runner_steps [--against OTHER/paged_decode.cpp] [--rounds 5]

Each round runs, for each kernel source in turn (order alternating by round), a fresh
deterministic ``ModelRunner`` on tiny-hd64 in its own process: request 0's 1024-token
shared prefix (one step), then four steps of 16 requests' own 64 tokens over the shared
prefix blocks (request 0's tail first: the planner's steps for (c)'s burst), then ``--decode-steps`` decode steps of all 64 (contexts ~1100). Prints each step kind's fastest step per
round (on a shared box the others include time spent waiting for a core), then min /
median / max over rounds and the per-round ratio.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from bench.stats import Spread, pair_ratios
from bench.workloads import build_models

DEFAULT_MODELS_DIR = Path.home() / ".cache" / "candor" / "bench" / "models"
PREFIX, OWN, SEQS, BS = 1024, 64, 64, 16


def _child(model: str, source: str, decode_steps: int, threads: int) -> dict:
    os.environ["MKL_CBWR"] = "AUTO,STRICT"  # before torch loads, as gpu_worker/__main__ does
    import torch

    from gpu_worker.attention import cpu_kernel_backend
    from gpu_worker.model_runner import ModelRunner
    from protocol.ipc import SamplingParams, SeqChunk, StepPlan

    cpu_kernel_backend._SOURCE = Path(source)
    torch.set_num_threads(threads)
    own_blocks = (OWN + decode_steps + 2) // BS + 1
    runner = ModelRunner(model, num_blocks=PREFIX // BS + SEQS * own_blocks + 1, deterministic=True)
    assert runner.deterministic, runner.deterministic_note
    greedy = SamplingParams(temperature=0.0)
    rids = [f"r{i}" for i in range(SEQS)]
    shared = list(range(PREFIX // BS))
    tables = {rid: shared + [PREFIX // BS + i * own_blocks + j for j in range(own_blocks)]
              for i, rid in enumerate(rids)}
    prompt = {rid: [(7 * j) % 250 + 3 for j in range(PREFIX)] + [(11 * i + j) % 250 + 3 for j in range(OWN)]
              for i, rid in enumerate(rids)}
    times: dict[str, list[float]] = {"prefix": [], "prefill": [], "decode": []}
    step = 0

    def run(kind, seqs, new):
        nonlocal step
        step += 1
        t0 = time.perf_counter()
        res = runner.execute(StepPlan(step, seqs, new))
        times[kind].append(time.perf_counter() - t0)
        return res

    run("prefix", [SeqChunk("r0", prompt["r0"][:PREFIX], 0, tables["r0"], False)], {"r0": greedy})
    last = {}
    for lo in range(0, SEQS, 16):  # 4 steps of 16 requests' own tokens (r0's tail first)
        batch = rids[lo:lo + 16]
        seqs = [SeqChunk(rid, prompt[rid][PREFIX:], PREFIX, tables[rid], True) for rid in batch]
        res = run("prefill", seqs, {rid: greedy for rid in batch if rid != "r0"})
        last.update(zip(batch, res.sampled))
    for n in range(decode_steps):
        seqs = [SeqChunk(rid, [last[rid]], PREFIX + OWN + n, [], True, kept_blocks=len(tables[rid]))
                for rid in rids]
        res = run("decode", seqs, {})
        last.update(zip(rids, res.sampled))
    return {k: 1e3 * min(v) for k, v in times.items()}  # the rest waited for a core


def _run(model: Path, source: Path, decode_steps: int, threads: int) -> dict:
    out = subprocess.run([sys.executable, "-m", "bench.runner_steps", "--child", str(model), str(source),
                          "--decode-steps", str(decode_steps), "--threads", str(threads)],
                         check=True, capture_output=True, text=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    from gpu_worker.attention import cpu_kernel_backend

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--against", type=Path, default=None)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--decode-steps", type=int, default=32)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--models-dir", type=Path, default=DEFAULT_MODELS_DIR)
    p.add_argument("--child", nargs=2, metavar=("MODEL", "SOURCE"), help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.child:
        print(json.dumps(_child(a.child[0], a.child[1], a.decode_steps, a.threads)))
        return 0
    model = build_models(a.models_dir, ["tiny-hd64"])["tiny-hd64"]
    sources = {"this": cpu_kernel_backend._SOURCE}
    if a.against is not None:
        sources["against"] = a.against
    rounds: dict[str, list[dict]] = {s: [] for s in sources}
    for r in range(a.rounds):
        for name in (list(sources) if r % 2 == 0 else list(sources)[::-1]):
            res = _run(model, sources[name], a.decode_steps, a.threads)
            rounds[name].append(res)
            print(f"[r{r}] {name:8s} " + "  ".join(f"{k} {v:8.2f} ms" for k, v in res.items()), flush=True)
    for key in ("prefix", "prefill", "decode"):
        line = [f"{key:8s}"]
        for name, rs in rounds.items():
            s = Spread.of([x[key] for x in rs])
            line.append(f"{name} {s.lo:.2f} / {s.median:.2f} / {s.hi:.2f} ms")
        if len(rounds) == 2:
            rt = Spread.of(pair_ratios([x[key] for x in rounds["this"]], [x[key] for x in rounds["against"]]))
            line.append(f"this/against {rt.median:.2f}x [{rt.lo:.2f}..{rt.hi:.2f}]")
        print("   ".join(line))
    return 0


if __name__ == "__main__":
    sys.exit(main())
