"""Where a qwen3moe-256 step's time goes at runner level, beside the same-width qwen3-256.

    python -m bench.moe_runner [--threads 1] [--repeats 15] [--models qwen3-256,qwen3moe-256]

In process, no servers: a ``ModelRunner`` (deterministic mode, as the worker's CPU
default) runs ``bench.arch_bench``'s shapes at Candor's default step budget: prefill steps
of 8 x 128-token prompts (1024 rows) and decode steps of 32 rows (128 tokens into the
context). Each of ``--repeats`` rounds (after one dropped warm-up round) prefills 32 fresh
sequences and decodes them ``DECODES`` steps; the median ms per step is printed with the
min and max. For the MoE model the MoE blocks' share is split into the router (gate
matmul, softmax, top-k, renormalisation) and the fused experts kernel; "rest" is
everything else in the step (attention, norms, dense matmuls, sampling). The split wraps
those calls with a timer, so it costs a few µs each.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path

SEQS, PROMPT, PER_PREFILL, DECODES = 32, 128, 8, 4  # DECODES: decode steps per round


class _Clock:
    """Seconds spent inside the wrapped calls since the last ``take``."""

    def __init__(self) -> None:
        self.total = 0.0

    def wrap(self, fn):
        def timed(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.total += time.perf_counter() - t0
        return timed

    def take(self) -> float:
        out, self.total = self.total, 0.0
        return out


def _spread(ms: list[float]) -> str:
    return f"{statistics.median(ms):7.2f} [{min(ms):6.2f}..{max(ms):6.2f}]"


def bench_model(path: Path, repeats: int) -> dict[str, dict[str, list[float]]]:
    """{step kind: {part: [ms per step]}} over ``repeats`` steps of each kind."""
    from bench.runner_batch import RunnerBatch
    from gpu_worker.model_runner import ModelRunner
    from gpu_worker.models import decoder, fused_moe
    from protocol.ipc import StepPlan

    moe_clock, kernel_clock = _Clock(), _Clock()
    load, forward = fused_moe.load, decoder.SparseMoE.forward
    kernel = load()
    decoder.SparseMoE.forward = moe_clock.wrap(forward)
    fused_moe.load = lambda: None if kernel is None else kernel_clock.wrap(kernel)
    try:
        shape = dict(seqs=SEQS, prompt=PROMPT, decodes=DECODES, step_tokens=PER_PREFILL * PROMPT)
        runner = ModelRunner(str(path), num_blocks=RunnerBatch(**shape).num_blocks)
        parts: dict[str, dict[str, list[float]]] = {"prefill 1024 rows": {}, "decode 32 rows": {}}
        step, done = 0, []

        def run(kind: str, plan: StepPlan):
            moe_clock.take(), kernel_clock.take()
            t0 = time.perf_counter()
            result = runner.execute(plan)
            total = time.perf_counter() - t0
            moe, kern = moe_clock.take(), kernel_clock.take()
            for name, v in (("step", total), ("moe router", moe - kern), ("moe kernel", kern),
                            ("rest", total - moe)):
                parts[kind].setdefault(name, []).append(v * 1e3)
            return result

        for r in range(repeats + 1):  # round 0 warms up and is dropped
            # every round's sequences reuse the same blocks (each prefill rewrites them)
            batch = RunnerBatch(**shape, salt=r)
            for plan in batch.prefill_plans(step + 1, released=done):
                step += 1
                batch.took(plan, run("prefill 1024 rows", plan).sampled)
            for n in range(DECODES):
                step += 1
                plan = batch.decode_plan(step, n)
                batch.took(plan, run("decode 32 rows", plan).sampled)
            done = batch.rids
        for kind in parts:
            for name in parts[kind]:
                parts[kind][name] = parts[kind][name][SEQS // PER_PREFILL if kind.startswith("prefill") else DECODES:]
        return parts
    finally:
        decoder.SparseMoE.forward, fused_moe.load = forward, load


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--repeats", type=int, default=15)
    p.add_argument("--models", default="qwen3-256,qwen3moe-256")
    p.add_argument("--models-dir", type=Path, default=Path(tempfile.gettempdir()) / "candor-moe-runner")
    a = p.parse_args(argv)
    os.environ.setdefault("MKL_CBWR", "AUTO,STRICT")  # before torch loads, as the worker does
    import torch

    from bench.models import build_arch, build_tiny

    torch.set_num_threads(a.threads)
    tiny = build_tiny(a.models_dir)
    print(f"{a.threads} thread(s); ms per step, median [min..max] of {a.repeats * DECODES} decode "
          f"and {a.repeats * SEQS // PER_PREFILL} prefill steps")
    for name in a.models.split(","):
        parts = bench_model(build_arch(a.models_dir, tiny, name), a.repeats)
        for kind, by_part in parts.items():
            cells = "  ".join(f"{part} {_spread(ms)}" for part, ms in by_part.items()
                              if part == "step" or "moe" in name)
            rows = 1024 if kind.startswith("prefill") else 32
            tok_s = rows / statistics.median(by_part["step"]) * 1e3
            print(f"{name:13s} {kind:18s} {tok_s:8.0f} tok/s  {cells}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
