"""Fused paged decode attention for CPU, built from ``paged_decode.cpp`` on first use.

Why: the torch path gathers each decode's KV blocks into a scratch copy before SDPA,
so every KV byte is read from DRAM, written, then read again. The kernel reads the
cache in place, once per pass, in memory order, with AVX2+FMA where the CPU has them
(~2x the torch path per layer on a (b)-shaped batch: 32 streams, 12 heads, contexts
128-256, about 2.8 ms a layer; the V pass walks memory in order and exp is vectorised).
It also returns each head's log-sum-exp, so the cascade path merges it with a shared
prefix's attention. It is compiled with the system C++ compiler via
``torch.utils.cpp_extension`` (~45 s the first time, then cached under
``TORCH_EXTENSIONS_DIR``); where that fails, ``load`` returns None and the torch path
stays in use. ``CANDOR_CPU_DECODE_KERNEL=0`` turns it off.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from gpu_worker.cpu_extension import build

_SOURCE = Path(__file__).with_name("paged_decode.cpp")


def load(device: torch.device, dtype: torch.dtype):
    """The compiled ``paged_decode(q, k_cache, v_cache, tables, lens, scale, window=None,
    softcap=None) -> (out, lse)``, or None when it does not apply (not CPU/fp32, disabled)
    or cannot be built. ``window``: each decode attends its last ``window`` keys only;
    ``softcap``: scores pass through ``softcap * tanh(score / softcap)`` first."""
    if device.type != "cpu" or dtype != torch.float32:
        return None
    if os.environ.get("CANDOR_CPU_DECODE_KERNEL", "1") == "0":
        return None
    module = build(_SOURCE, ["paged_decode"], openmp=True)
    if module is None:
        return None
    kernel = module.paged_decode

    def paged_decode(q, k_cache, v_cache, tables, lens, scale, window=None, softcap=None):
        return kernel(q, k_cache, v_cache, tables, lens, scale, window or 0, softcap or 0.0)

    return paged_decode
