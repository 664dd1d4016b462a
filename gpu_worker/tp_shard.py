"""Which slice of the model one tensor-parallel rank holds (torch-free, so the launcher
can refuse a size that does not divide the model before any process starts).

Attention heads and MLP columns split evenly across ranks; KV heads split too, and when
there are fewer KV heads than ranks each rank keeps the one KV head its query heads
read (replicated). The vocabulary splits into equal ranges (the last one padded). MoE
experts are placed whole, ``num_experts / size`` per rank.
"""

from __future__ import annotations

from dataclasses import dataclass

from gpu_worker.model_config import ModelConfig
from gpu_worker.quantization.spec import block_of


class ShardError(ValueError):
    """This model cannot be split over this many ranks."""


@dataclass(frozen=True)
class TPShard:
    rank: int
    size: int
    heads: int        # query heads on this rank
    q_start: int      # first query head
    kv_heads: int     # KV heads on this rank
    kv_start: int     # first KV head
    head_dim: int
    intermediate: int  # dense MLP columns on this rank
    experts: int      # MoE experts on this rank
    vocab_per_rank: int
    vocab: int        # full vocabulary

    @property
    def q_size(self) -> int:
        return self.heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.kv_heads * self.head_dim

    @property
    def vocab_start(self) -> int:
        return self.rank * self.vocab_per_rank

    @property
    def vocab_rows(self) -> int:
        """Real vocabulary rows on this rank (the rest of ``vocab_per_rank`` is padding)."""
        return max(0, min(self.vocab, self.vocab_start + self.vocab_per_rank) - self.vocab_start)

    @property
    def expert_start(self) -> int:
        return self.rank * self.experts


def kv_slice(num_kv_heads: int, rank: int, size: int) -> tuple[int, int]:
    """(first KV head, KV heads) of ``rank`` out of ``size``: an equal share, or the one
    head its query heads read when there are fewer KV heads than ranks."""
    if num_kv_heads >= size:
        share = num_kv_heads // size
        return rank * share, share
    return rank * num_kv_heads // size, 1


@dataclass(frozen=True)
class KvRoute:
    """A run of KV heads (the model's numbering) that prefill rank ``src`` sends to
    decode rank ``dst`` when a prompt's KV moves between replicas."""

    src: int
    dst: int
    head: int
    heads: int


def kv_routes(num_kv_heads: int, prefill_tp: int, decode_tp: int) -> list[KvRoute]:
    """Every decode rank gets exactly the KV heads its attention shard reads, each head
    from one prefill rank that holds it: of several (replicated heads), the one at the
    same relative position, so equal sizes keep rank k -> rank k and the sends spread."""
    held = [kv_slice(num_kv_heads, src, prefill_tp) for src in range(prefill_tp)]

    def source(h: int, dst: int) -> int:
        holders = [src for src, (first, count) in enumerate(held) if first <= h < first + count]
        return min(holders, key=lambda src: (abs(src * decode_tp - dst * prefill_tp), src))

    routes: list[KvRoute] = []
    for dst in range(decode_tp):
        first, count = kv_slice(num_kv_heads, dst, decode_tp)
        for h in range(first, first + count):
            last = routes[-1] if routes else None
            src = source(h, dst)
            if last is not None and (last.src, last.dst) == (src, dst) \
                    and last.head + last.heads == h:
                routes[-1] = KvRoute(src, dst, last.head, last.heads + 1)
            else:
                routes.append(KvRoute(src, dst, h, 1))
    return routes


def shard_problems(cfg: ModelConfig, size: int, key: str = "tensor_parallel") -> list[str]:
    """Why ``cfg`` cannot be split over ``size`` ranks (empty: it can); ``key``: the
    setting that asked for ``size``, as the messages name it."""
    out = []
    if cfg.num_heads % size:
        out.append(f"num_attention_heads={cfg.num_heads} is not divisible by "
                   f"{key}={size}")
    kv = cfg.num_kv_heads
    if (kv >= size and kv % size) or (kv < size and size % kv):
        out.append(f"num_key_value_heads={kv} and {key}={size}: one must divide "
                   "the other")
    if cfg.intermediate_size % size and any(not layer.moe for layer in cfg.layers):
        out.append(f"intermediate_size={cfg.intermediate_size} is not divisible by "
                   f"{key}={size}")
    if cfg.moe is not None and cfg.moe.num_experts % size:
        out.append(f"num_experts={cfg.moe.num_experts} is not divisible by "
                   f"{key}={size} (experts are placed whole)")
    if not out and size > 1 and cfg.quantization is not None:
        out += _block_problems(cfg, size, key)
    return out


def _block_problems(cfg: ModelConfig, size: int, key: str) -> list[str]:
    """A quantized format's blocks must not be cut: each rank's output rows and input
    columns of a split layer hold whole packed words, groups and scale blocks."""
    rows, cols = block_of(cfg.quantization)
    kv_rows = max(1, cfg.num_kv_heads // size) * cfg.head_dim
    splits = {"output": {"query heads' rows": cfg.q_size // size, "KV heads' rows": kv_rows,
                         "MLP rows": cfg.intermediate_size // size},
              "input": {"o_proj columns": cfg.q_size // size, "down_proj columns": cfg.intermediate_size // size}}
    return [f"{what} per rank ({n}) cut a block of {block} ({dim} dimension) with {key}={size}"
            for dim, block in (("output", rows), ("input", cols)) for what, n in splits[dim].items()
            if n % block]


def tp_shard(cfg: ModelConfig, rank: int = 0, size: int = 1) -> TPShard:
    problems = shard_problems(cfg, size)
    if problems:
        raise ShardError("; ".join(problems))
    heads = cfg.num_heads // size
    kv_start, kv_heads = kv_slice(cfg.num_kv_heads, rank, size)
    experts = cfg.moe.num_experts // size if cfg.moe is not None else 0
    return TPShard(rank=rank, size=size, heads=heads, q_start=rank * heads, kv_heads=kv_heads,
                   kv_start=kv_start, head_dim=cfg.head_dim,
                   intermediate=cfg.intermediate_size // size if size > 1 else cfg.intermediate_size,
                   experts=experts, vocab_per_rank=-(-cfg.vocab_size // size),
                   vocab=cfg.vocab_size)
