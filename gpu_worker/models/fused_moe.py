"""The fused CPU mixture-of-experts kernel (``fused_moe.cpp``), built on first use.

Why: the torch path runs a handful of ops per routed expert (gather, gate|up matmul,
split, activation, down matmul, scale, ``index_add_``), about 60 µs of dispatch and small
matmuls per expert per layer at 8 rows; the kernel does the routing groups, both
projections, SiLU and the weighted sum over a token's experts in one call, reading each
expert's weights in place (HF's layout; each 16 columns are transposed into a small
panel as they are used) as outer-product tiles: up to 6 rows x 16 columns of sums in
registers, each weight read once per tile, which keeps it level with or ahead of
per-expert MKL GEMMs at prefill sizes too.
Each output element is one chain of FMAs in input order (see the source), so a token's
result never depends on the rest of the batch or the thread count: it serves the
deterministic mode as is. Against HF's per-expert ``linear`` it differs in the last bits
(a different summation order), not in greedy tokens.

Used for float32 on CPU with SiLU experts (every MoE family the registry has); anything
else, or a machine where the build fails, keeps the torch path.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Callable

import torch

from gpu_worker.cpu_extension import build

_SOURCE = Path(__file__).with_name("fused_moe.cpp")
# (x [N, H], weights [N, K] fp32, chosen [N, K] int64, w13 [E, 2I, H], w2 [E, H, I],
#  first expert held) -> [N, H]
Kernel = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, int],
                  torch.Tensor]


@functools.cache
def load() -> Kernel | None:
    """The compiled kernel (one build per process, shared by every layer), or None."""
    module = build(_SOURCE, ["fused_moe"], openmp=True, cflags=("-ffp-contract=off",))
    return None if module is None else module.fused_moe


def applies(x: torch.Tensor, act: str) -> bool:
    """Whether the kernel can compute this layer's experts for ``x``."""
    return x.device.type == "cpu" and x.dtype == torch.float32 and act == "silu"
