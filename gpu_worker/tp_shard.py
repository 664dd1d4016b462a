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


def shard_problems(cfg: ModelConfig, size: int) -> list[str]:
    """Why ``cfg`` cannot be split over ``size`` ranks (empty: it can)."""
    out = []
    if cfg.num_heads % size:
        out.append(f"num_attention_heads={cfg.num_heads} is not divisible by "
                   f"tensor_parallel={size}")
    kv = cfg.num_kv_heads
    if (kv >= size and kv % size) or (kv < size and size % kv):
        out.append(f"num_key_value_heads={kv} and tensor_parallel={size}: one must divide "
                   "the other")
    if cfg.intermediate_size % size and any(not layer.moe for layer in cfg.layers):
        out.append(f"intermediate_size={cfg.intermediate_size} is not divisible by "
                   f"tensor_parallel={size}")
    if cfg.moe is not None and cfg.moe.num_experts % size:
        out.append(f"num_experts={cfg.moe.num_experts} is not divisible by "
                   f"tensor_parallel={size} (experts are placed whole)")
    return out


def tp_shard(cfg: ModelConfig, rank: int = 0, size: int = 1) -> TPShard:
    problems = shard_problems(cfg, size)
    if problems:
        raise ShardError("; ".join(problems))
    heads = cfg.num_heads // size
    if cfg.num_kv_heads >= size:
        kv_heads, kv_start = cfg.num_kv_heads // size, rank * (cfg.num_kv_heads // size)
    else:
        kv_heads, kv_start = 1, rank * cfg.num_kv_heads // size
    experts = cfg.moe.num_experts // size if cfg.moe is not None else 0
    return TPShard(rank=rank, size=size, heads=heads, q_start=rank * heads, kv_heads=kv_heads,
                   kv_start=kv_start, head_dim=cfg.head_dim,
                   intermediate=cfg.intermediate_size // size if size > 1 else cfg.intermediate_size,
                   experts=experts, vocab_per_rank=-(-cfg.vocab_size // size),
                   vocab=cfg.vocab_size)
