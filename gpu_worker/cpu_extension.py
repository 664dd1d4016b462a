"""Builds the worker's small C++ CPU kernels with ``torch.utils.cpp_extension``.

The system C++ compiler builds each source once (seconds to a minute) and torch caches
it under ``TORCH_EXTENSIONS_DIR``. The ISA and a hash of the source are part of the
module's name, so a cache shared between machines never hands an AVX2 binary to a CPU
without it, and checkouts with different sources never load each other's binary.
Where the build fails, ``build`` returns None and the caller keeps its torch path.
"""

from __future__ import annotations

import hashlib
import logging
from pathlib import Path

import torch

log = logging.getLogger(__name__)


def isa_flags() -> tuple[str, list[str]]:
    """AVX2+FMA code where torch's own dispatch found AVX2 (or better) on this CPU."""
    if torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512"):
        return "avx2", ["-mavx2", "-mfma"]
    return "generic", []


def build(source: Path, functions: list[str], openmp: bool = False):
    """The compiled module exposing ``functions``, or None (logged) if it cannot be built."""
    try:
        from torch.utils.cpp_extension import load_inline

        isa, flags = isa_flags()
        text = source.read_text()
        digest = hashlib.sha256(text.encode()).hexdigest()[:12]
        return load_inline(f"candor_{source.stem}_{isa}_{digest}", cpp_sources=[text],
                           functions=functions,
                           extra_cflags=["-O3", *(["-fopenmp"] if openmp else []), *flags])
    except Exception as exc:  # no compiler, no headers, ...: the torch path still works
        log.warning("CPU kernel %s unavailable, using the torch path: %s", source.name, exc)
        return None
