"""Mixed batches: each row of a step with its own adapter (or none), punica-style.

The runner groups the step's token rows by adapter once (``LoraBatch.set``); every
adapted layer then adds, for each adapter present, ``(x[rows] A^T) Bt`` to its output rows
(``LoraSite.add_delta``): one matmul pair per adapter present per layer, over that
adapter's rows only, so the cost follows the rows that use adapters and a step without
adapter rows costs nothing. Rows of the base model are never touched (their output is
bit-identical to a server without adapters), and a row's delta is computed from its own
input and its own adapter's weights: which other adapters share the step, and where
their rows sit, never enters it. (The number of rows of the same adapter sets the
matmul's row count, exactly as the batch size does for the base layers' matmuls.)
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

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


class LoraSite:
    """The adapter hook of one adapted layer (``ColumnParallelLinear.lora`` /
    ``RowParallelLinear.lora``): its key into each adapter's pairs, and the batch."""

    def __init__(self, key: SiteKey, batch: LoraBatch) -> None:
        self.key = key
        self.batch = batch

    def add_delta(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        for weights, rows in self.batch.groups:
            pair = weights.pairs.get(self.key)
            if pair is None:  # this adapter leaves the layer alone
                continue
            a, bt = pair
            if isinstance(rows, slice):
                y[rows] += torch.mm(F.linear(x[rows], a), bt)
            else:
                y.index_add_(0, rows, torch.mm(F.linear(x.index_select(0, rows), a), bt))
        return y


MODULES = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")


def attach_sites(model: nn.Module, batch: LoraBatch) -> int:
    """Give every layer an adapter may target its hook; the number of hooks."""
    n = 0
    for i, block in enumerate(model.model.layers):
        for module in MODULES:
            owner = block.self_attn if module in ("qkv_proj", "o_proj") else block.mlp
            if hasattr(owner, module):
                adapted_layer(model, i, module).lora = LoraSite((i, module), batch)
                n += 1
    return n
