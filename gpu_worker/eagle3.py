"""Speculative decoding's ``eagle3``: an EAGLE-3 head (gpu_worker/models/eagle3.py) that
drafts from the target's own hidden states, run by the worker right after a step is
verified, as a draft model is (``DraftModel``: its cache, scratch blocks, passes).

What it reads: the target's forward keeps the residual stream entering a few of its
layers (``DecoderForCausalLM.aux_layers``, set only when this method is on: no cost
otherwise) for every row of the step. The head's row at position p takes the target's
states at p and the id at p + 1, so it is one id behind the target: after a step its
real rows are the chunk's positions (drafts kept included) with the ids after each
(the last one: the token just sampled), and the last row's logits give the first draft
(the token after the sampled one). Each further draft feeds the draft before it with
the head's own output state of the row before (``DraftModel.step``'s ``state``).

A chunk that samples nothing (a prefill chunk before the last) does not know the id
after its last position yet: that row's target states are kept (``carry``) and fed
first with the next chunk. A prefix-cache hit starts after blocks another request
filled: the row before its first position is that request's (its id after may differ:
a draft's quality, never an answer). Verification stays the runner's, so the head's
numerics, cache contents or weights cost acceptance, never tokens.

Cache: the head's K/V (one layer) in the ``DraftModel`` layout: blocks mirroring the
target's ids plus scratch blocks, rolled back by rewriting (the next step feeds the
real rows from its chunk's start again). Under tensor parallelism rank 0 alone holds
the head and proposes; the target's states there are whole (every layer ends in an
all-reduce), and a head without embeddings of its own gets the target's table whole
(gathered once at start).
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from gpu_worker.batch_invariant import Numerics
from gpu_worker.distributed import Ranks
from gpu_worker.draft_model import DraftFeed, DraftModel
from gpu_worker.eagle3_config import (HeadError, head_mismatch, read_head_config, target_hidden_size,
                                      tensor_shapes)
from gpu_worker.loader import load_weights
from gpu_worker.model_config import ModelConfig
from gpu_worker.models.eagle3 import Eagle3Head
from gpu_worker.tp_shard import tp_shard

log = logging.getLogger(__name__)


def has_own_embeddings(path: str) -> bool:
    """Whether the head at ``path`` carries ``embed_tokens.weight`` (headers only)."""
    return any(n.removeprefix("model.") == "embed_tokens.weight" for n in tensor_shapes(path))


class Eagle3Drafter(DraftModel):
    """The head at ``path`` drafting for a target of ``target`` config; the target's
    embedding table is given with ``share_embeddings`` where the head has none."""

    def __init__(self, path: str, *, k: int, target: ModelConfig, device: torch.device,
                 dtype: torch.dtype, block_size: int, max_model_len: int, max_num_seqs: int) -> None:
        self.path = path
        try:
            self.head = head = read_head_config(path, target.num_layers)
            shapes = tensor_shapes(path)
        except HeadError as err:  # (the launcher refuses it first, in one line)
            raise ValueError(f"EAGLE-3 head {path}: {err}") from None
        problem = head_mismatch(head, target, shapes, target_hidden_size(path))
        if problem:
            raise ValueError(f"EAGLE-3 head {path}: {problem}")
        self.config = cfg = head.model
        self.device, self.dtype, self.block_size = device, dtype, block_size
        self.max_model_len = max_model_len
        self.shard = tp_shard(cfg)
        self.numerics = Numerics(deterministic=True)  # settled with the target's (settle)
        names = {n.removeprefix("model.") for n in shapes}
        with torch.device("meta"):
            model = Eagle3Head(head, max_positions=max_model_len, device=device, dtype=dtype,
                               tp=Ranks().tp_group(self.shard, self.numerics),
                               own_embeddings="embed_tokens.weight" in names,
                               has_d2t="d2t" in names)
        model = model.to_empty(device=device).to(dtype)
        load_weights(model, path)
        self.model = model.eval()
        log.info("EAGLE-3 head: %s", self.numerics.pack(self.model.matmuls(),
                                                       self.model.matmul_only()))
        self.scratch_per_seq = -(-k // block_size) + 1
        self.scratch_seqs = max_num_seqs
        self.num_blocks = 0
        self.kv_caches = []
        self.attn = None
        # rid -> (position, the target's aux row there) of a chunk that sampled nothing
        self.carry: dict[str, tuple[int, torch.Tensor]] = {}

    @property
    def aux_layers(self) -> tuple[int, ...]:
        return self.head.aux_layers

    def share_embeddings(self, embed: nn.Module) -> None:
        self.model.share_embeddings(embed)

    def describe(self) -> str:
        head = self.head
        return (f"{self.path}: EAGLE-3 head, hidden {self.config.hidden_size}, draft vocabulary "
                f"{head.draft_vocab_size}, target layers {list(head.aux_layers)}; its cache "
                f"mirrors the target's {self.num_blocks} blocks "
                f"({self.num_blocks * self.block_bytes / 2**20:.1f} MiB) + "
                f"{self.scratch_seqs * self.scratch_per_seq} scratch blocks")

    def release(self, rid: str) -> None:
        self.carry.pop(rid, None)

    def feed(self, rid: str, start: int, real: list[int], sampled: int | None, table: list[int],
             propose: int, aux: torch.Tensor) -> DraftFeed | None:
        """One live chunk's feed: its ``real`` ids at ``start``.. (``aux``: the target's
        rows there), the id after them (``sampled``; None: not known yet, the last row
        waits for the next chunk), the row a chunk before it left waiting; None: no row
        can be fed yet."""
        carried = self.carry.pop(rid, None)
        tokens = real[1:] + ([sampled] if sampled is not None else [])
        rows, first = aux, start
        if carried is not None and carried[0] == start - 1:
            tokens, rows, first = real[:1] + tokens, torch.cat([carried[1][None], aux]), start - 1
        if sampled is None:
            self.carry[rid] = (start + len(real) - 1, aux[-1].clone())
            rows, propose = rows[:len(tokens)], 0
        if not tokens:
            return None
        return DraftFeed(first, tokens, table, propose, hidden=rows)

    def step(self, feeds: list[DraftFeed]) -> list[list[int]]:
        """``DraftModel.step`` once the target's rows are folded (``fc``, one matmul for
        every feed)."""
        if feeds:
            combined = self.model.combine(torch.cat([f.hidden for f in feeds]))
            bounds = [0]
            for f in feeds:
                bounds.append(bounds[-1] + len(f.tokens))
            for f, a, b in zip(feeds, bounds, bounds[1:]):
                f.hidden = combined[a:b]
        return super().step(feeds)

    def _forward(self, ids: list[int], positions: list[int], chunks, num_decodes: int,
                 rows: list[int], hidden: torch.Tensor | None = None
                 ) -> tuple[list[int], torch.Tensor | None]:
        dev = self.device
        meta = self.attn.build(chunks, num_decodes)
        prenorm = self.model(torch.tensor(ids, dtype=torch.long, device=dev),
                             torch.tensor(positions, dtype=torch.long, device=dev),
                             hidden, self.kv_caches, meta)
        if not rows:
            return [], None
        picked = prenorm[torch.tensor(rows, dtype=torch.long, device=dev)]
        return self.model.draft_ids(picked).tolist(), picked
