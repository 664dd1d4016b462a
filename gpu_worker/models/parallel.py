"""Tensor-parallel layers: each one knows its shard, its collectives and its slice of a
checkpoint tensor.

A ``TPGroup`` is this rank's shard (``tp_shard.TPShard``) plus its torch.distributed
group. With one rank every collective is a no-op and each layer computes what its plain
torch counterpart does, so a single-device model computes exactly what it did before
sharding existed.

- Column-parallel (``ColumnParallelLinear``; ``MergedColumnParallelLinear`` for gate|up;
  ``QKVParallelLinear``, which keeps a replicated KV head where there are fewer KV heads
  than ranks): this rank's output rows, no communication.
- ``RowParallelLinear`` (o_proj, down_proj, c_proj): this rank's input columns; the
  partial sums are all-reduced (one all-reduce per layer); the bias is added once (rank 0).
- ``VocabParallelEmbedding``: one vocabulary range (the last padded); ids outside it embed
  to zero and an all-reduce sums the ranges. As an LM head (``logits``) the ranges'
  logits are gathered along the vocabulary.
- ``ShardedRMSNorm``: normalises over a projection split across ranks (OLMo 2's q/k norm):
  the sum of squares is all-reduced.
- ``ReplicatedLinear`` (the MoE router): the whole matrix on every rank.
- ``Experts`` (in ``decoder``) are placed whole, ``experts / size`` per rank.

Every matmul goes through the group's ``Numerics`` (``batch_invariant``): padded to a
batch-invariant row count in the deterministic mode. Sums over ranks stay batch-invariant
too: two ranks' partial sums add in either order to the same bits; from three ranks on,
the deterministic mode gathers the partials and adds them in rank order (a ring
all-reduce's order depends on which chunk of the tensor an element falls in).

Loading: ``weight_loader(param, source, shard_id)`` narrows the checkpoint tensor
(``weights.CheckpointTensor``) to this rank's part and copies it in. It works on any
parameter sharded like the layer's own: a column-parallel layer slices dimension 0 of
whatever it is given, a row-parallel one the last dimension of a matrix, so an adapter
(a LoRA pair: B [out, r] sharded like a column layer's output, A [r, in] like a row
layer's input) loads through the layer it wraps.

Adapters: a column or row layer whose ``lora`` hook is set (``gpu_worker.lora.batch``)
adds each adapter row group's delta to its output, before a row layer's all-reduce (the
delta of a row layer is a partial sum too). Unset (the default), forward is unchanged.
"""

from __future__ import annotations

import torch
from torch import nn

from gpu_worker.batch_invariant import Numerics
from gpu_worker.models.blocks import RMSNorm
from gpu_worker.models.linear_method import MethodOwner, QuantizableLinear, narrow
from gpu_worker.models.weights import CheckpointTensor, copy_into
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

    def max_over_ranks(self, x: torch.Tensor) -> torch.Tensor:
        """Elementwise max of ``x`` over the ranks, in place (order-free, so exact)."""
        if self.size > 1:
            import torch.distributed as dist
            dist.all_reduce(x, op=dist.ReduceOp.MAX, group=self.group)
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


class ReplicatedLinear(QuantizableLinear):
    """The whole ``y = x W^T (+ b)`` on every rank (the MoE router)."""

    def __init__(self, input_size: int, output_size: int, bias: bool, tp: TPGroup) -> None:
        super().__init__(input_size, output_size, bias=bias)
        self.tp = tp

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.method.apply(self, x, self.bias)


class ColumnParallelLinear(ReplicatedLinear):
    """``output_size`` output features split evenly: this rank holds rows
    ``[rank * n, (rank + 1) * n)`` of the weight and bias."""

    lora = None  # gpu_worker.lora.batch.LoraSite where adapters may target this layer

    def __init__(self, input_size: int, output_size: int, bias: bool, tp: TPGroup) -> None:
        super().__init__(input_size, output_size // tp.size, bias, tp)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.method.apply(self, x, self.bias)
        return y if self.lora is None else self.lora.add_delta(x, y)

    def checkpoint_rows(self, part=None) -> int:
        return self.out_features * self.tp.size

    def weight_loader(self, param: torch.Tensor, source: CheckpointTensor, shard_id=None) -> int:
        axis = self.axes_of(param).out
        if axis is None:
            return copy_into(param, source)
        n = axis.length(param)
        return copy_into(param, narrow(source, axis, self.tp.rank * n, n, "output", own=False))

    def _part(self, param: torch.Tensor, source: CheckpointTensor, here: tuple[int, int], there: int) -> int:
        """Copy the ``here`` = (start, size) logical rows of ``param`` from rows ``there``..
        of ``source``; a tensor whole along the output (GPTQ's ``g_idx``) comes with every
        part and must be the same in each: the first to arrive writes it, the others are
        checked against it."""
        axis = self.axes_of(param).out
        if axis is not None:
            start, size = here
            return copy_into(narrow(param, axis, start, size, "output", own=True),
                             narrow(source, axis, there, size, "output", own=False))
        shared = self.__dict__.setdefault("_shared_loaded", set())
        if id(param) not in shared:
            shared.add(id(param))
            return copy_into(param, source)
        if not torch.equal(param, source.read().to(param.dtype)):
            raise ValueError(f"{source.name}: differs between the parts of a fused layer, which share it")
        return 0


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel outputs in one matmul (gate|up), each split evenly; this
    rank's parts sit side by side. ``shard_id``: which output a checkpoint tensor is;
    None: the checkpoint holds them merged too (Phi-3's ``gate_up_proj``)."""

    def __init__(self, input_size: int, output_sizes: list[int], bias: bool, tp: TPGroup) -> None:
        self.output_sizes = output_sizes
        super().__init__(input_size, sum(output_sizes), bias, tp)

    def part_rows(self) -> dict:
        """Each part's (first row, rows) on this rank."""
        n = self.tp.size
        return {i: (sum(self.output_sizes[:i]) // n, size // n) for i, size in enumerate(self.output_sizes)}

    def checkpoint_rows(self, part=None) -> int:
        return sum(self.output_sizes) if part is None else self.output_sizes[part]

    def weight_loader(self, param: torch.Tensor, source: CheckpointTensor, shard_id: int | None = None) -> int:
        if shard_id is None:
            axis = self.axes_of(param).out
            offsets = [sum(self.output_sizes[:i]) for i in range(len(self.output_sizes))]
            return sum(self.weight_loader(param, narrow(source, axis, offset, size, "output", own=False), i)
                       for i, (offset, size) in enumerate(zip(offsets, self.output_sizes)))
        start, size = self.part_rows()[shard_id]
        return self._part(param, source, (start, size), self.tp.rank * size)


class QKVParallelLinear(ColumnParallelLinear):
    """Fused [q; k; v] projection over this rank's query heads and KV heads (a KV head is
    replicated on every rank whose query heads read it, see ``tp_shard``). ``shard_id``:
    "q", "k" or "v"; None: the checkpoint holds them fused too (Phi-3's ``qkv_proj``)."""

    def __init__(self, hidden: int, head_dim: int, num_heads: int, num_kv_heads: int, bias: bool,
                 tp: TPGroup) -> None:
        s = tp.shard
        nn.Linear.__init__(self, hidden, (s.heads + 2 * s.kv_heads) * head_dim, bias=bias)
        self.tp = tp
        q, kv = s.q_size, s.kv_size
        # shard id -> (rows here, rows in the full separate tensor, rows before it in a fused one)
        self.parts = {"q": (0, q, s.q_start * head_dim, 0),
                      "k": (q, kv, s.kv_start * head_dim, num_heads * head_dim),
                      "v": (q + kv, kv, s.kv_start * head_dim, (num_heads + num_kv_heads) * head_dim)}
        self.full_sizes = {"q": num_heads * head_dim, "k": num_kv_heads * head_dim, "v": num_kv_heads * head_dim}

    def part_rows(self) -> dict:
        return {i: (start, size) for i, (start, size, _, _) in self.parts.items()}

    def checkpoint_rows(self, part=None) -> int:
        return sum(self.full_sizes.values()) if part is None else self.full_sizes[part]

    def weight_loader(self, param: torch.Tensor, source: CheckpointTensor, shard_id: str | None = None) -> int:
        if shard_id is None:
            axis = self.axes_of(param).out
            return sum(self.weight_loader(param, narrow(source, axis, self.parts[i][3], self.full_sizes[i],
                                                        "output", own=False), i)
                       for i in self.parts)
        start, size, src, _ = self.parts[shard_id]
        return self._part(param, source, (start, size), src)


class RowParallelLinear(QuantizableLinear):
    """``y = x_r W_r^T`` summed over ranks (+ bias once): ``input_size`` input features
    split evenly, this rank holding columns ``[rank * n, (rank + 1) * n)``."""

    lora = None  # as ColumnParallelLinear's

    def __init__(self, input_size: int, output_size: int, bias: bool, tp: TPGroup) -> None:
        super().__init__(input_size // tp.size, output_size, bias=bias)
        self.tp = tp
        self.input_shards = tp.size

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.method.apply(self, x, self.bias if self.tp.rank == 0 else None)
        if self.lora is not None:
            y = self.lora.add_delta(x, y)
        return self.tp.all_reduce(y)

    def weight_loader(self, param: torch.Tensor, source: CheckpointTensor, shard_id=None) -> int:
        axis = self.axes_of(param).inp
        if axis is None:  # the bias (whole on every rank, added by rank 0); GPTQ's act-order scales
            return copy_into(param, source)
        n = axis.length(param)
        return copy_into(param, narrow(source, axis, self.tp.rank * n, n, "input", own=False))


class VocabParallelEmbedding(MethodOwner, nn.Module):
    """An embedding table over this rank's vocabulary range ``[start, start + rows)``,
    padded to ``vocab_per_rank`` rows (zeros, never a real token); also the LM head. Its
    method looks rows up (``embed``) and computes logits (``apply``): dense, or GGUF
    blocks read in place for both."""

    def __init__(self, hidden: int, tp: TPGroup) -> None:
        super().__init__()
        shard = tp.shard
        self.tp = tp
        self.start, self.rows, self.vocab = shard.vocab_start, shard.vocab_rows, shard.vocab
        self.out_features, self.in_features = shard.vocab_per_rank, hidden
        self.weight = nn.Parameter(torch.empty(shard.vocab_per_rank, hidden))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return self.method.embed(self, ids)
        local = ids - self.start
        outside = (local < 0) | (local >= self.rows)
        out = self.method.embed(self, local.masked_fill(outside, 0))
        out.masked_fill_(outside.unsqueeze(-1), 0.0)
        return self.tp.all_reduce(out)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[rows, vocab] logits over the whole vocabulary (every rank's range, padding dropped)."""
        logits = self.method.apply(self, hidden, None)
        if self.tp.size > 1:
            logits = self.tp.gather_last(logits)[:, :self.vocab]
        return logits

    def weight_loader(self, param: torch.Tensor, source: CheckpointTensor, shard_id=None) -> int:
        param[self.rows:].zero_()
        return copy_into(param[:self.rows], source.narrow(0, self.start, self.rows)) + param[self.rows:].numel()


class ShardedRMSNorm(RMSNorm):
    """RMS norm over a vector whose elements are spread over the ranks: this rank holds
    ``[start, start + size)`` of the weight (replicated KV heads count once per copy,
    which the mean over ``ranks * size`` elements accounts for)."""

    def __init__(self, start: int, size: int, eps: float, one_plus: bool, tp: TPGroup) -> None:
        super().__init__(size, eps, one_plus)
        self.start, self.tp = start, tp

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return super().forward(x)
        x32 = x.float()
        sq = x32.pow(2).sum(-1, keepdim=True)
        mean = self.tp.all_reduce(sq) / (x.shape[-1] * self.tp.size)
        x32 = x32 * torch.rsqrt(mean + self.eps)
        if self.one_plus:
            return (x32 * (1.0 + self.weight.float())).type_as(x)
        return self.weight * x32.to(x.dtype)

    def weight_loader(self, param: torch.Tensor, source: CheckpointTensor, shard_id=None) -> int:
        return copy_into(param, source.narrow(0, self.start, param.shape[0]))
