"""The quantized-matmul CPU kernels (``quant_linear.cpp``), built on first use (the runner
builds them at start-up where a quantized model is served; ``candor build-kernels`` ahead).

Used for float32 activations on CPU; anything else, or a machine where the build fails,
keeps each method's torch path (dequantize a slab of rows, then a dense matmul).
``CANDOR_CPU_QUANT_KERNELS=0`` turns them off (a check against the torch path).
"""

from __future__ import annotations

import functools
import os
from pathlib import Path

import torch

from gpu_worker.cpu_extension import build, int_dot_flags, wide_flags

_SOURCE = Path(__file__).with_name("quant_linear.cpp")
DISABLE_ENV = "CANDOR_CPU_QUANT_KERNELS"
FUNCTIONS = ["ggml_linear", "ggml_dequantize", "ggml_packs", "ggml_pack", "ggml_linear_packed", "ggml_apply_packed",
             "ggml_unpack_rows",
             "int4_linear", "int4_dequantize", "fp8_linear", "fp8_dequantize", "kernel_abi"]


@functools.cache
def load():
    """The compiled module (``FUNCTIONS``), or None."""
    if os.environ.get(DISABLE_ENV, "1") == "0":
        return None
    flags = ("-ffp-contract=off", *wide_flags())
    ints = int_dot_flags()  # a compiler without them still builds the float kernels
    return (build(_SOURCE, FUNCTIONS, openmp=True, cflags=(*flags, *ints))
            or (build(_SOURCE, FUNCTIONS, openmp=True, cflags=flags) if ints else None))


def applies(x: torch.Tensor) -> bool:
    """Whether the kernels can compute on activations ``x``."""
    return x.is_cpu and x.dtype == torch.float32 and load() is not None
