"""Mixed batches: each row of a step with its own adapter (or none), punica-style.

The runner groups the step's token rows by adapter once (``LoraBatch.set``); every
adapted layer then adds, for each adapter present, ``(x[rows] A^T) Bt`` to its output rows
(``LoraSite.add_delta``): one matmul pair per adapter present per layer, over that
adapter's rows only, so the cost follows the rows that use adapters and a step without
adapter rows costs nothing. Rows of the base model are never touched (their output is
bit-identical to a server without adapters), and a row's delta is computed from its own
input and its own adapter's weights: which other adapters share the step, and where
their rows sit, never enters it.

The number of rows of the same adapter sets the delta's matmul row count, and BLAS takes
other paths for few rows (MKL: fewer than 4 at one thread; a thread left with a few rows
at several, so the count grows with the threads: 16 rows at 2 threads for an
``A`` [16, 64], 64 at 16). In the deterministic mode a group with fewer rows than the
adapter's ``min_rows`` is padded with zero rows up to it, as ``Numerics.linear`` pads a
base matmul; ``measure_delta_rows`` measures that count when the adapter is read, on its
own pairs, at every thread count the worker may run (``thread_governor``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from gpu_worker.batch_invariant import PROBE_ROWS, Numerics, agrees_from, pad_rows
from gpu_worker.lora.weights import AdapterWeights, SiteKey, adapted_layer

Rows = slice | torch.Tensor


class LoraBatch:
    """This step's rows per adapter; empty while no row uses one."""

    def __init__(self) -> None:
        self.groups: list[tuple[AdapterWeights, Rows]] = []

    def set(self, spans: list[tuple[AdapterWeights, list[tuple[int, int]]]], device: torch.device) -> None:
        """``spans``: per adapter, its (first row, row count) runs in the flattened batch."""
        groups = []
        for weights, runs in spans:
            if len(runs) == 1:
                start, n = runs[0]
                rows: Rows = slice(start, start + n)
            else:
                rows = torch.cat([torch.arange(s, s + n) for s, n in runs]).to(device)
            groups.append((weights, rows))
        self.groups = groups

    def clear(self) -> None:
        self.groups = []


# Padding a LoRA delta costs ``r / out`` of the base layer's matmul per padded row, so
# it may go further than the base layers' MAX_MIN_ROWS: far enough for 64 threads.
DELTA_PROBE_ROWS = (*PROBE_ROWS, 192, 255, 256, 257)
MAX_DELTA_ROWS = 256


def delta(x: torch.Tensor, a: torch.Tensor, bt: torch.Tensor) -> torch.Tensor:
    """``(x A^T) Bt``: the adapter's change to the layer's output rows ``x`` produce."""
    return torch.mm(F.linear(x, a), bt)


def measure_delta_rows(pairs: list[tuple[torch.Tensor, torch.Tensor]],
                       thread_counts: range) -> tuple[int | None, str]:
    """The row count from which ``delta`` gives every row bitwise the same result whatever
    the group's size, for each distinct shape of ``pairs`` at each of ``thread_counts``
    (``batch_invariant.agrees_from``); (None, why) past ``MAX_DELTA_ROWS``. Restores the
    thread count it found."""
    gen = torch.Generator().manual_seed(0)
    before = torch.get_num_threads()
    need, seen = 1, set()
    try:
        for a, bt in pairs:
            key = (tuple(a.shape), tuple(bt.shape), a.dtype, a.device)
            if key in seen:
                continue
            seen.add(key)
            x = torch.randn(max(DELTA_PROBE_ROWS), a.shape[1], generator=gen).to(a.dtype).to(a.device)
            for threads in thread_counts:
                torch.set_num_threads(threads)
                found = agrees_from(lambda rows: delta(rows, a, bt), x, DELTA_PROBE_ROWS, gen)
                need = max(need, found)
                if need > MAX_DELTA_ROWS:
                    return None, (f"its delta over A {tuple(a.shape)}, B^T {tuple(bt.shape)} gives "
                                  f"rows that depend on the batch up to {found - 1} rows at "
                                  f"{threads} threads (the deterministic mode pads to at most "
                                  f"{MAX_DELTA_ROWS}; --no-deterministic serves it)")
    finally:
        torch.set_num_threads(before)
    return need, ""


class LoraSite:
    """The adapter hook of one adapted layer (``ColumnParallelLinear.lora`` /
    ``RowParallelLinear.lora``): its key into each adapter's pairs, the batch, and the
    layer's numerics (whether a group is padded to its adapter's ``min_rows``)."""

    def __init__(self, key: SiteKey, batch: LoraBatch, numerics: Numerics) -> None:
        self.key = key
        self.batch = batch
        self.numerics = numerics

    def add_delta(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        for weights, rows in self.batch.groups:
            pair = weights.pairs.get(self.key)
            if pair is None:  # this adapter leaves the layer alone
                continue
            a, bt = pair
            rows_x = x[rows] if isinstance(rows, slice) else x.index_select(0, rows)
            m = rows_x.shape[0]
            if self.numerics.deterministic and m < weights.min_rows:
                d = delta(pad_rows(rows_x, weights.min_rows), a, bt)[:m]
            else:
                d = delta(rows_x, a, bt)
            if isinstance(rows, slice):
                y[rows] += d
            else:
                y.index_add_(0, rows, d)
        return y


MODULES = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")


def attach_sites(model: nn.Module, batch: LoraBatch) -> int:
    """Give every layer an adapter may target its hook; the number of hooks."""
    n = 0
    for i, block in enumerate(model.model.layers):
        for module in MODULES:
            owner = block.self_attn if module in ("qkv_proj", "o_proj") else block.mlp
            if hasattr(owner, module):
                layer = adapted_layer(model, i, module)
                layer.lora = LoraSite((i, module), batch, layer.tp.numerics)
                n += 1
    return n
