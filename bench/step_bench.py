"""Wall time of one 32-row decode step at the runner (no other process): the per-step
overhead of small dense models, by model, thread count and checkout.

    python -m bench.step_bench [--models tiny-hd64,llama-256] [--threads 1,2] [--rounds 3]
                               [--steps 96] [--base DIR] [--profile]

Each round runs, for each (checkout, threads) in turn (the order alternating by round), a
fresh ``ModelRunner`` in its own process (``MKL_CBWR`` set before torch loads, as the
worker does; the default deterministic mode): 32 sequences of 128 prompt tokens
prefilled, then ``--steps`` greedy decode steps of all 32, each timed alone
(``runner.execute``). ``--threads 0`` puts the worker's ``ThreadGovernor`` in the loop
as ``gpu_worker/__main__`` does (reported: the counts it chose). ``--base DIR`` also
runs a checkout at DIR (e.g. ``git archive main | tar -x -C DIR``) for a before/after;
``--interleave`` instead alternates the steps of one process between the row kernels
(``gpu_worker/models/row_ops``) and torch's ops, so both see the same load (on a shared box
the steadiest before/after there is).
Prints per round the median and fastest-decile (p10) step and the forward / sample split,
then per config the median over rounds of each, with min..max over rounds (on a shared box
the p10 is the steadier number); ``--profile`` prints one torch
profiler table (self CPU time by op) of the decode steps per checkout instead.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

if __name__ == "__main__" and sys.path and Path(sys.path[0]).resolve() == Path(__file__).resolve().parent:
    sys.path.pop(0)  # run as a file: bench/ must not shadow the standard library (profile)

SEQS, PROMPT, PREFILL_STEP = 32, 128, 1024
DEFAULT_MODELS_DIR = Path.home() / ".cache" / "candor" / "bench" / "models"


def _child(model: str, steps: int, threads: int, profile: bool, interleave: bool = False) -> dict:
    os.environ.setdefault("MKL_CBWR", "AUTO,STRICT")  # before torch loads, as the worker
    import torch

    from bench.runner_batch import RunnerBatch
    from gpu_worker.model_runner import ModelRunner
    from protocol.ipc import StepPlan

    torch.set_num_threads(max(1, threads))
    batch = RunnerBatch(SEQS, PROMPT, steps, PREFILL_STEP)
    runner = ModelRunner(model, num_blocks=batch.num_blocks)
    governor = None
    if threads == 0:
        from gpu_worker.thread_governor import for_this_process
        governor = for_this_process(torch.set_num_threads)

    def execute(plan: StepPlan):
        tokens = sum(len(s.token_ids) for s in plan.seqs)
        chosen = governor.before_step(tokens) if governor is not None else threads
        result = runner.execute(plan)
        if governor is not None:
            governor.after_step(result.forward_s)
        return result, chosen

    plans = batch.prefill_plans(1)
    for plan in plans:
        batch.took(plan, execute(plan)[0].sampled)
    walls, chose, off_walls = [], [], []
    from gpu_worker.models import row_ops
    kernels_applies = row_ops.applies
    t = runner.timings
    fwd0, smp0 = t.forward, t.sample
    prof = None
    if profile:
        from torch.profiler import ProfilerActivity, profile as torch_profile
        prof = torch_profile(activities=[ProfilerActivity.CPU])
        prof.__enter__()
    for n in range(steps):
        plan = batch.decode_plan(len(plans) + 1 + n, n)
        off = interleave and n % 2 == 1  # every other step on torch's ops (same load for both)
        row_ops.applies = (lambda x: False) if off else kernels_applies
        started = time.perf_counter()
        result, threads_used = execute(plan)
        (off_walls if off else walls).append(time.perf_counter() - started)
        chose.append(threads_used)
        batch.took(plan, result.sampled)
    ranked = sorted(walls)
    out = {"median_ms": 1e3 * statistics.median(walls), "p10_ms": 1e3 * ranked[len(ranked) // 10],
           "forward_ms": 1e3 * (t.forward - fwd0) / steps, "sample_ms": 1e3 * (t.sample - smp0) / steps,
           "threads": {str(k): chose.count(k) for k in sorted(set(chose))},
           "tokens": [batch.last[rid] for rid in batch.rids[:4]]}
    if off_walls:
        off_ranked = sorted(off_walls)
        out.update(off_median_ms=1e3 * statistics.median(off_walls), off_p10_ms=1e3 * off_ranked[len(off_ranked) // 10])
    if prof is not None:
        prof.__exit__(None, None, None)
        out["profile"] = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=30)
    return out


def _run(code_dir: Path, model: Path, steps: int, threads: int, profile: bool,
         interleave: bool = False) -> dict:
    env = {**os.environ, "PYTHONPATH": str(code_dir)}
    out = subprocess.run([sys.executable, __file__, "--child", str(model), "--steps", str(steps),
                          "--threads", str(threads), *(["--profile"] if profile else []),
                          *(["--interleave"] if interleave else [])],
                         check=True, capture_output=True, text=True, env=env, cwd=code_dir)
    return json.loads(out.stdout.strip().splitlines()[-1])


def _models(models_dir: Path, names: list[str]) -> dict[str, Path]:
    from bench.models import ARCH_SHAPES, build_arch, build_tiny
    from bench.workloads import build_models

    tiny = build_tiny(models_dir)
    out = build_models(models_dir, [n for n in names if n not in ARCH_SHAPES])
    out.update({n: build_arch(models_dir, tiny, n) for n in names if n in ARCH_SHAPES})
    return {n: out[n] for n in names}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", default="tiny-hd64,llama-256")
    p.add_argument("--threads", default="1", help="comma-separated; 0 = the adaptive governor")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=96)
    p.add_argument("--base", type=Path, default=None, help="another checkout to run too")
    p.add_argument("--profile", action="store_true")
    p.add_argument("--interleave", action="store_true",
                   help="this checkout only: alternate steps with the row kernels on and off")
    p.add_argument("--models-dir", type=Path, default=DEFAULT_MODELS_DIR)
    p.add_argument("--child", metavar="MODEL", help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.child:
        print(json.dumps(_child(a.child, a.steps, int(a.threads), a.profile, a.interleave)))
        return 0
    here = Path(__file__).resolve().parent.parent
    sys.path.insert(0, str(here))
    from bench.stats import Spread

    code = {"this": here, **({"base": a.base.resolve()} if a.base else {})}
    configs = [(c, int(t)) for c in code for t in a.threads.split(",")]
    for name, path in _models(a.models_dir, a.models.split(",")).items():
        if a.interleave:
            ratios, p10s = [], []
            for r in range(a.rounds):
                res = _run(code["this"], path, a.steps, int(a.threads.split(",")[0]), False, True)
                ratios.append(res["median_ms"] / res["off_median_ms"])
                p10s.append(res["p10_ms"] / res["off_p10_ms"])
                print(f"[{name} r{r}] row kernels on: median {res['median_ms']:.2f} p10 {res['p10_ms']:.2f} ms; "
                      f"off: median {res['off_median_ms']:.2f} p10 {res['off_p10_ms']:.2f} ms", flush=True)
            m, f = Spread.of(ratios), Spread.of(p10s)
            print(f"{name}: on/off step median {m.median:.3f} [{m.lo:.3f}..{m.hi:.3f}], "
                  f"p10 {f.median:.3f} [{f.lo:.3f}..{f.hi:.3f}] over {a.rounds} rounds\n")
            continue
        if a.profile:
            for side, code_dir in code.items():
                res = _run(code_dir, path, a.steps, int(a.threads.split(",")[0]), True)
                print(f"{name} ({side}): median step {res['median_ms']:.2f} ms\n{res['profile']}")
            continue
        medians: dict[tuple[str, int], list[float]] = {c: [] for c in configs}
        fast: dict[tuple[str, int], list[float]] = {c: [] for c in configs}
        for r in range(a.rounds):
            for c in (configs if r % 2 == 0 else configs[::-1]):
                res = _run(code[c[0]], path, a.steps, c[1], False)
                medians[c].append(res["median_ms"])
                fast[c].append(res["p10_ms"])
                print(f"[{name} r{r}] {c[0]:4s} threads={c[1]} step median {res['median_ms']:6.2f} ms "
                      f"(p10 {res['p10_ms']:.2f}; forward {res['forward_ms']:.2f}, sample "
                      f"{res['sample_ms']:.2f}) chose {res['threads']} tokens {res['tokens']}",
                      flush=True)
        print(f"\n{name}: {a.rounds} rounds x {a.steps} decode steps of {SEQS} rows; "
              "median of the rounds' step medians, and of their fastest-decile steps (p10: "
              "what a quiet box gives), [min..max] over rounds, ms")
        for c in configs:
            m, f = Spread.of(medians[c]), Spread.of(fast[c])
            print(f"  {c[0]:4s} threads={c[1]}: median {m.median:6.2f} [{m.lo:.2f}..{m.hi:.2f}]   "
                  f"p10 {f.median:6.2f} [{f.lo:.2f}..{f.hi:.2f}]")
        print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
