"""Fused paged attention for CPU, built from ``paged_decode.cpp`` on first use.

Why: the torch path gathers each decode's KV blocks into a scratch copy before SDPA,
so every KV byte is read from DRAM, written, then read again. The kernel reads the
cache in place, once per pass, in memory order, with AVX2+FMA where the CPU has them
(~2x the torch path per layer on a (b)-shaped batch: 32 streams, 12 heads, contexts
128-256, about 2.8 ms a layer; the V pass walks memory in order and exp is vectorised).
It also returns each head's log-sum-exp, so the cascade path merges it with a shared
prefix's attention.

Any query row works, not only a decode's: ``row_seq`` names each row's block table, and
consecutive rows on one table (a prefill chunk, each row attending its causal prefix)
share each K/V read. A row's arithmetic depends on its own keys only, never on the other
rows, their number or the split of a prompt into chunks: the deterministic mode runs
every row through it. It is compiled with ``-ffp-contract=off`` (the compiler may not fuse
a multiply and an add into one FMA in one call site and not in another) with the system
C++ compiler via ``torch.utils.cpp_extension`` (~45 s the first time, then cached under
``TORCH_EXTENSIONS_DIR``); where that fails, ``load`` returns None and the torch path
stays in use. ``CANDOR_CPU_DECODE_KERNEL=0`` turns it off.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from gpu_worker.cpu_extension import build

_SOURCE = Path(__file__).with_name("paged_decode.cpp")
CFLAGS = ("-ffp-contract=off",)
_NO_ROWS = torch.empty(0, dtype=torch.long)


def load(device: torch.device, dtype: torch.dtype):
    """The compiled ``paged_attention(q, k_cache, v_cache, tables, lens, scale, window=None,
    softcap=None, row_seq=None) -> (out, lse)``, or None when it does not apply (not
    CPU/fp32, disabled) or cannot be built. Row b of ``q`` attends keys 0..lens[b]-1 of
    block table ``tables[row_seq[b]]`` (``row_seq`` None: ``tables[b]``). ``window``: each
    row attends its last ``window`` keys only; ``softcap``: scores pass through
    ``softcap * tanh(score / softcap)`` first."""
    if device.type != "cpu" or dtype != torch.float32:
        return None
    if os.environ.get("CANDOR_CPU_DECODE_KERNEL", "1") == "0":
        return None
    module = build(_SOURCE, ["paged_attention"], openmp=True, cflags=CFLAGS)
    if module is None:
        return None
    kernel = module.paged_attention

    def paged_attention(q, k_cache, v_cache, tables, lens, scale, window=None, softcap=None, row_seq=None):
        return kernel(q, k_cache, v_cache, tables, _NO_ROWS if row_seq is None else row_seq, lens, scale,
                      window or 0, softcap or 0.0)

    return paged_attention
