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

import hashlib
import logging
import os
from pathlib import Path

import torch

_SOURCE = Path(__file__).with_name("paged_decode.cpp")
log = logging.getLogger(__name__)


def _isa_flags() -> tuple[str, list[str]]:
    """AVX2+FMA code where torch's own dispatch found AVX2 (or better) on this CPU.

    The ISA is part of the extension's name, so a build cache shared between machines
    never hands an AVX2 binary to a CPU without it."""
    if torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512"):
        return "avx2", ["-mavx2", "-mfma"]
    return "generic", []


def load(device: torch.device, dtype: torch.dtype):
    """The compiled ``paged_decode(q, k_cache, v_cache, tables, lens, scale, window=None,
    softcap=None) -> (out, lse)``, or None when it does not apply (not CPU/fp32, disabled)
    or cannot be built. ``window``: each decode attends its last ``window`` keys only;
    ``softcap``: scores pass through ``softcap * tanh(score / softcap)`` first."""
    if device.type != "cpu" or dtype != torch.float32:
        return None
    if os.environ.get("CANDOR_CPU_DECODE_KERNEL", "1") == "0":
        return None
    try:
        from torch.utils.cpp_extension import load_inline

        isa, flags = _isa_flags()
        source = _SOURCE.read_text()
        # The source's hash is in the name too: checkouts with different kernels sharing one
        # build cache must never load each other's binary (the signature may differ).
        digest = hashlib.sha256(source.encode()).hexdigest()[:12]
        module = load_inline(
            f"candor_paged_decode_{isa}_{digest}",
            cpp_sources=[source],
            functions=["paged_decode"],
            extra_cflags=["-O3", "-fopenmp", *flags],
        )
    except Exception as exc:  # no compiler, no headers, ...: the torch path still works
        log.warning("CPU decode kernel unavailable, using the torch path: %s", exc)
        return None
    kernel = module.paged_decode

    def paged_decode(q, k_cache, v_cache, tables, lens, scale, window=None, softcap=None):
        return kernel(q, k_cache, v_cache, tables, lens, scale, window or 0, softcap or 0.0)

    return paged_decode
