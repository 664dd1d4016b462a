"""Tensor-parallel layers: the collectives a sharded decoder needs, in one place.

A ``TPGroup`` is this rank's shard (``tp_shard.TPShard``) plus its torch.distributed
group. With one rank every collective is a no-op and the layers are plain torch, so a
single-device model computes exactly what it did before sharding existed.

- ``ColumnLinear`` (fused q/k/v, gate/up, Starcoder2's c_fc, the LM head, the MoE router)
  holds this rank's output columns (all of them where replicated): no communication.
- ``RowLinear`` (o_proj, down_proj, c_proj) multiplies this rank's input slice and
  all-reduces the partial sums: one all-reduce per layer; the bias is added once (rank 0).
- ``VocabEmbedding`` holds one vocabulary range; ids outside it embed to zero and an
  all-reduce sums the ranges. The LM head's logits are gathered along the vocabulary.
- ``ShardedRMSNorm`` normalises over a projection split across ranks (OLMo 2's q/k norm):
  the sum of squares is all-reduced.

Every matmul goes through the group's ``Numerics`` (``batch_invariant``): padded to a
batch-invariant row count in the deterministic mode. Sums over ranks stay batch-invariant
too: two ranks' partial sums add in either order to the same bits; from three ranks on,
the deterministic mode gathers the partials and adds them in rank order (a ring
all-reduce's order depends on which chunk of the tensor an element falls in).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from gpu_worker.batch_invariant import Numerics
from gpu_worker.tp_shard import TPShard


class TPGroup:
    def __init__(self, shard: TPShard, group=None, numerics: Numerics | None = None) -> None:
        self.shard = shard
        self.group = group  # the process group activations travel on (None: world)
        self.numerics = numerics or Numerics()

    @property
    def rank(self) -> int:
        return self.shard.rank

    @property
    def size(self) -> int:
        return self.shard.size

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        if self.size > 2 and self.numerics.deterministic:
            parts = self._gather(x)
            total = parts[0]
            for part in parts[1:]:
                total += part
            return x.copy_(total)
        if self.size > 1:
            import torch.distributed as dist
            dist.all_reduce(x, group=self.group)
        return x

    def _gather(self, x: torch.Tensor) -> list[torch.Tensor]:
        import torch.distributed as dist
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(self.size)]
        dist.all_gather(parts, x, group=self.group)
        return parts

    def gather_last(self, x: torch.Tensor) -> torch.Tensor:
        """Concatenate every rank's ``x`` along the last dimension (rank order)."""
        if self.size == 1:
            return x
        return torch.cat(self._gather(x), dim=-1)


class ColumnLinear(nn.Linear):
    """``y = x W_c^T (+ b_c)`` over this rank's output columns."""

    def __init__(self, in_features: int, out_features: int, bias: bool, tp: TPGroup) -> None:
        super().__init__(in_features, out_features, bias=bias)
        self.tp = tp

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.tp.numerics.linear(x, self.weight, self.bias)


class RowLinear(nn.Linear):
    """``y = x_r W_r^T`` summed over ranks (+ bias once)."""

    def __init__(self, in_features: int, out_features: int, bias: bool, tp: TPGroup) -> None:
        super().__init__(in_features, out_features, bias=bias)
        self.tp = tp

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.tp.numerics.linear(x, self.weight, self.bias if self.tp.rank == 0 else None)
        return self.tp.all_reduce(y)


class VocabEmbedding(nn.Module):
    """An embedding table over this rank's vocabulary range ``[start, start + rows)``."""

    def __init__(self, shard: TPShard, hidden: int, tp: TPGroup) -> None:
        super().__init__()
        self.tp = tp
        self.start, self.rows = shard.vocab_start, shard.vocab_rows
        self.weight = nn.Parameter(torch.empty(shard.vocab_per_rank, hidden))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        local = ids - self.start
        outside = (local < 0) | (local >= self.rows)
        out = F.embedding(local.masked_fill(outside, 0), self.weight)
        out.masked_fill_(outside.unsqueeze(-1), 0.0)
        return self.tp.all_reduce(out)


class ShardedRMSNorm(nn.Module):
    """RMS norm over a vector whose ``full`` elements are spread over the ranks (each
    holds ``weight.numel()``; replicated KV heads count once per copy, which the mean
    over ``size * local`` elements accounts for)."""

    def __init__(self, local: int, eps: float, one_plus: bool, tp: TPGroup) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(local))
        self.eps, self.one_plus, self.tp = eps, one_plus, tp

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        sq = x32.pow(2).sum(-1, keepdim=True)
        mean = self.tp.all_reduce(sq) / (x.shape[-1] * self.tp.size)
        x32 = x32 * torch.rsqrt(mean + self.eps)
        if self.one_plus:
            return (x32 * (1.0 + self.weight.float())).type_as(x)
        return self.weight * x32.to(x.dtype)
