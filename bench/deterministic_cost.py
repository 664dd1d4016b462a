"""What the deterministic mode costs at the worker: the same steps, batch-invariant or fast.

    python -m bench.deterministic_cost [--models tiny-hd64,llama-100m] [--rounds 5]

Each round runs, for each mode in turn (the order alternating by round), a fresh
``ModelRunner`` in its own process (``--deterministic`` sets ``MKL_CBWR`` before torch
loads, as the worker does): 32 sequences of 128 prompt tokens prefilled in 1024-token
steps (8 prompts each), then ``--decode-steps`` greedy decode steps of all 32 at once
(workload (a)'s shape). Start-up (the kernel build, the row-count measurement) is not
timed. Prints every round, then each mode's min / median / max tok/s and the
deterministic/fast ratio per round pair: on a shared box trust a ratio whose range stays
on one side of 1.00x. ``bench.ab --base main`` measures the same through every process.
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

MODES = ("deterministic", "fast")
SEQS, PROMPT, STEP_TOKENS = 32, 128, 1024
DEFAULT_MODELS_DIR = Path.home() / ".cache" / "candor" / "bench" / "models"


def _child(mode: str, model: str, decode_steps: int, threads: int) -> dict:
    if mode == "deterministic":
        os.environ["MKL_CBWR"] = "AUTO,STRICT"  # before torch loads, as gpu_worker/__main__ does
    import torch

    from bench.runner_batch import RunnerBatch
    from gpu_worker.model_runner import ModelRunner

    torch.set_num_threads(threads)
    batch = RunnerBatch(SEQS, PROMPT, decode_steps, STEP_TOKENS)
    runner = ModelRunner(model, num_blocks=batch.num_blocks, deterministic=mode == "deterministic")
    assert runner.deterministic is (mode == "deterministic"), runner.deterministic_note
    started = time.perf_counter()
    plans = batch.prefill_plans(1)
    for plan in plans:
        batch.took(plan, runner.execute(plan).sampled)
    prefill_s = time.perf_counter() - started
    started = time.perf_counter()
    for n in range(decode_steps):
        plan = batch.decode_plan(len(plans) + 1 + n, n)
        batch.took(plan, runner.execute(plan).sampled)
    decode_s = time.perf_counter() - started
    return {"prefill_tok_s": SEQS * PROMPT / prefill_s, "decode_tok_s": SEQS * decode_steps / decode_s,
            "note": runner.deterministic_note}


def _run(mode: str, model: Path, decode_steps: int, threads: int) -> dict:
    out = subprocess.run([sys.executable, "-m", "bench.deterministic_cost", "--child", mode, str(model),
                          "--decode-steps", str(decode_steps), "--threads", str(threads)],
                         check=True, capture_output=True, text=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def _spread(values: list[float]) -> str:
    s = Spread.of(values)
    return f"{s.lo:8.0f} / {s.median:8.0f} / {s.hi:8.0f}"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", default="tiny-hd64,llama-100m")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--decode-steps", type=int, default=32)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--models-dir", type=Path, default=DEFAULT_MODELS_DIR)
    p.add_argument("--child", nargs=2, metavar=("MODE", "MODEL"), help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.child:
        print(json.dumps(_child(a.child[0], a.child[1], a.decode_steps, a.threads)))
        return 0
    paths = build_models(a.models_dir, a.models.split(","))
    for name, path in paths.items():
        rounds: dict[str, list[dict]] = {m: [] for m in MODES}
        for r in range(a.rounds):
            for mode in (MODES if r % 2 == 0 else MODES[::-1]):
                res = _run(mode, path, a.decode_steps, a.threads)
                rounds[mode].append(res)
                print(f"[{name} r{r}] {mode:13s} prefill {res['prefill_tok_s']:8.0f} tok/s  "
                      f"decode {res['decode_tok_s']:8.0f} tok/s  ({res['note']})", flush=True)
        print(f"\n{name}: {a.rounds} rounds, {a.threads} thread(s); min / median / max tok/s")
        for key in ("prefill_tok_s", "decode_tok_s"):
            det = [x[key] for x in rounds["deterministic"]]
            fast = [x[key] for x in rounds["fast"]]
            ratios = Spread.of(pair_ratios(det, fast))
            print(f"  {key:14s} deterministic {_spread(det)}   fast {_spread(fast)}   "
                  f"det/fast {ratios.median:.2f}x [{ratios.lo:.2f}..{ratios.hi:.2f}]")
        print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
