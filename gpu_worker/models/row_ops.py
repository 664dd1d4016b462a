"""Row-wise fp32 CPU ops of a decoder layer and the sampler (``row_ops.cpp``), built on
first use (the runner builds them at start-up).

Why: a small model's decode step is mostly per-op dispatch, not arithmetic. torch's CPU
``rms_norm`` is a composite of about ten ops (pow, mean, add, rsqrt, two muls and their
dtype checks), RoPE's ``x * cos + rotate_half(x) * sin`` six more and a copy for the
attention kernel's contiguous q, the invariant SiLU * up five; each call of these kernels
is one (per op, 1 thread: a 32 x 64 norm 11 -> 3 µs, SiLU * up at 32 x 1024 55 -> 22 µs).
The sampler's greedy pick (``row_argmax``) replaces torch's indexed max, one scalar pass
(58 µs for 32 x 2048 logits), with a vectorised max and a vectorised search for its first
occurrence (7.5 µs). ``python -m bench.step_bench --interleave`` times decode steps with
the kernels on and off in turn.

Numerics: RoPE and the residual add give torch's bits exactly (the same products and
sums, compiled with ``-ffp-contract=off``), ``row_argmax`` torch.max's (max is exact;
ties go to the first index, NaN counts as the max). SiLU uses its own fixed ``exp``
polynomial (within 1e-6 of float64 SiLU) for every element. The norm sums a row's squares in a fixed order of its own
(16 lanes, then a fixed tree) where torch's reduction order is another, so it differs
from HF's in the last bit now and then, never in greedy tokens on the zoo
(``tests/unit/gpu_worker/test_model_registry.py``); the rest is HF's order of operations.
Every row is computed by the same instructions whatever the batch, its place in it or the thread
count, so the deterministic mode holds (``tests/unit/gpu_worker/test_batch_invariance.py``).

Used for float32 tensors on CPU; anything else, or a machine where the build fails,
keeps the torch path. ``CANDOR_CPU_ROW_OPS=0`` turns it off (a check against torch).
"""

from __future__ import annotations

import functools
import os
from pathlib import Path

import torch

from gpu_worker.cpu_extension import build

_SOURCE = Path(__file__).with_name("row_ops.cpp")
DISABLE_ENV = "CANDOR_CPU_ROW_OPS"
CFLAGS = ("-ffp-contract=off",)


@functools.cache
def load():
    """The compiled module (``rms_norm``, ``add_rms_norm``, ``rope``, ``rope_qkv``,
    ``silu_mul``, ``row_argmax``), or None."""
    if os.environ.get(DISABLE_ENV, "1") == "0":
        return None
    return build(_SOURCE, ["rms_norm", "add_rms_norm", "rope", "rope_qkv", "silu_mul", "row_argmax", "kernel_abi"],
                 openmp=True,
                 cflags=CFLAGS)


def applies(x: torch.Tensor) -> bool:
    """Whether the kernels can compute on ``x`` (they are built on first use)."""
    return x.is_cpu and x.dtype == torch.float32 and load() is not None
