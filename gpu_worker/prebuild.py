"""``candor build-kernels``: compile every CPU kernel now, once, before anything serves.

A gpu_worker builds the kernels it lacks at its first start (``cpu_extension``): tens of
seconds of compiler per kernel beside a starting server, and on a 2-core box beside
whatever else runs. ``make serve`` and ``make test`` call this first (with the venv's
``bin`` on PATH, as the launcher gives its children, so the names match), and a worker
then finds each one built. A kernel that cannot be built is said here; its worker keeps
the torch path, as it would have anyway.
"""

from __future__ import annotations

import os
import time
from concurrent.futures import ThreadPoolExecutor


def build_all(say=print) -> None:
    """Build (or find built) each kernel, as many at once as there are cores; say how
    each went."""
    from gpu_worker.attention import cpu_kernel_backend
    from gpu_worker.grammar import build_bitmask_kernel
    from gpu_worker.models import fused_moe, layer_loop, row_ops
    from gpu_worker.quantization import kernels as quant_kernels

    kernels = {"row_ops (norms, RoPE, SiLU)": row_ops.load,
               "paged attention": cpu_kernel_backend.load,
               "fused MoE": fused_moe.load,
               "grammar bitmask": build_bitmask_kernel,
               "quantized matmuls (GGUF, int4, FP8)": quant_kernels.load,
               "decoder layer loop": layer_loop.load}

    def one(load) -> tuple[bool, float]:
        started = time.perf_counter()
        return load() is not None, time.perf_counter() - started

    with ThreadPoolExecutor(max(1, min(len(kernels), os.cpu_count() or 1))) as pool:
        results = dict(zip(kernels, pool.map(one, kernels.values())))
    for name, (ok, seconds) in results.items():
        say(f"candor: CPU kernel {name}: "
            f"{'ready' if ok else 'NOT built (the torch path serves)'} ({seconds:.1f}s)")
