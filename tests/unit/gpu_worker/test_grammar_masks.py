"""The compiled CPU bitmask kernel against the torch path it replaces: same logits,
bit for bit, on masks with whole-clear, whole-set and mixed words, a subset of rows,
and a vocabulary wider than the mask (those tokens are never allowed)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from gpu_worker.cpu_extension import build, build_dir
from gpu_worker.grammar import apply_masks


SOURCE = Path(__file__).resolve().parents[3] / "gpu_worker" / "bitmask.cpp"


@pytest.fixture(scope="module")
def kernel():
    module = build(SOURCE, ["apply_bitmask"])
    assert module is not None, "the bitmask kernel must build where the decode kernel does"
    return module.apply_bitmask


def test_a_dead_builders_lock_does_not_block_the_next_build(kernel, tmp_path):
    """torch's ``lock`` file, left by a builder killed mid-build, made every later load
    wait forever; a new build clears it and loads (in a fresh process, as a worker would)."""
    import subprocess
    import sys

    lock = Path(build_dir(SOURCE)[1]) / "lock"
    lock.touch()
    code = ("from pathlib import Path; from gpu_worker.cpu_extension import build; "
            f"assert build(Path({str(SOURCE)!r}), ['apply_bitmask']) is not None")
    run = subprocess.run([sys.executable, "-c", code], cwd=SOURCE.parents[1], timeout=300,
                         capture_output=True, text=True)
    assert run.returncode == 0, run.stderr[-2000:]
    assert not lock.exists()


def _mask(rows: int, words: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    mask = torch.randint(-2**31, 2**31 - 1, (rows, words), dtype=torch.int32, generator=g)
    mask[:, ::3] = 0     # whole words disallowed
    mask[:, 1::5] = -1   # whole words allowed
    return mask


@pytest.mark.parametrize("vocab, words, rows", [(2048, 64, [0, 1, 2, 3]), (100, 4, [2, 0]),
                                                (130, 4, [1]), (64, 2, [3])])
def test_kernel_equals_the_torch_path(kernel, vocab, words, rows):
    logits = torch.randn(4, vocab, generator=torch.Generator().manual_seed(1))
    mask = _mask(len(rows), words, seed=vocab)
    want, got = logits.clone(), logits.clone()
    if 32 * words >= vocab:
        apply_masks(want, rows, mask)
    else:  # the torch path needs a mask covering the vocabulary; pad it with clear bits
        padded = torch.zeros(len(rows), -(-vocab // 32), dtype=torch.int32)
        padded[:, :words] = mask
        apply_masks(want, rows, padded)
    kernel(got, mask, torch.tensor(rows, dtype=torch.int64))
    assert torch.equal(torch.isinf(want), torch.isinf(got))
    assert torch.equal(want, got)
    untouched = [r for r in range(4) if r not in rows]
    assert torch.equal(got[untouched], logits[untouched])


def test_kernel_refuses_a_row_out_of_range(kernel):
    with pytest.raises(RuntimeError, match="row out of range"):
        kernel(torch.zeros(2, 64), torch.zeros(1, 2, dtype=torch.int32),
               torch.tensor([5], dtype=torch.int64))


def test_each_ninja_builds_in_its_own_directory(tmp_path, monkeypatch):
    """Two ninja versions on one machine (the system's and the venv's pip package, picked
    by whichever is first on PATH) hash build commands differently, so each treated the
    other's objects as stale and rebuilt the kernel (about a minute) at every start."""
    fake = tmp_path / "ninja"
    fake.write_text("#!/bin/sh\necho 0.0.1-fake\n")
    fake.chmod(0o755)
    real = build_dir(SOURCE)
    monkeypatch.setenv("PATH", f"{tmp_path}:{__import__('os').environ['PATH']}")
    other = build_dir(SOURCE)
    assert other[0] != real[0] and other[1] != real[1]
