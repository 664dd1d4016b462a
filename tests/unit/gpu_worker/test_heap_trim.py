"""The gpu_worker's heap trim (gpu_worker/heap_trim.py) and what its start imports: the
worker's RSS is part of what it costs (issue 34)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import torch

from gpu_worker.grammar import all_allowed
from gpu_worker.heap_trim import HeapTrim, glibc_trim

REPO = Path(__file__).resolve().parents[3]


def test_trims_once_after_steps_and_not_before():
    calls: list[int] = []
    heap = HeapTrim(lambda pad: calls.append(pad) or 1)
    heap.idle()
    assert calls == []
    heap.stepped()
    heap.stepped()
    heap.idle()
    heap.idle()
    assert calls == [0] and heap.trims == 1
    heap.stepped()
    heap.idle()
    assert heap.trims == 2


def test_without_malloc_trim_nothing_happens():
    heap = HeapTrim(None)
    heap.stepped()
    heap.idle()
    assert heap.trims == 0


def test_glibc_trim_is_callable_here():
    trim = glibc_trim()
    if trim is None:  # a C library without malloc_trim (musl, macOS): the None path above
        return
    assert trim(0) in (0, 1)


def test_the_bitmask_allows_every_token_in_llguidances_layout():
    mask = all_allowed(3, 70)
    assert mask.shape == (3, 3) and mask.dtype == torch.int32
    assert bool((mask == -1).all())


def test_the_worker_runner_does_not_import_torch_compile():
    """llguidance.torch imports dynamo and inductor (~120 MiB of RSS) for one torch.full."""
    code = ("import sys, gpu_worker.model_runner, gpu_worker.worker_loop; "
            "print(sorted(m for m in ('torch._dynamo', 'torch._inductor', 'llguidance.torch') "
            "if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True,
                         env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"}, check=True)
    assert out.stdout.strip().splitlines()[-1] == "[]"
