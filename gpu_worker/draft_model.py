"""Speculative decoding's ``draft_model``: a second, smaller checkpoint with the target's
tokenizer that proposes greedy drafts, run by the worker right after a step is verified.

Flow (why here and then): the scheduler plans the drafts a step verifies
(``SeqChunk.draft``) and reserves their KV slots, as for ``ngram``; what differs is who
guesses them. After the target has verified step N, this model feeds each request's real
new ids (the chunk's tokens, the drafts it kept, the token it sampled) and proposes
``SeqChunk.propose`` greedy tokens after them; they go back in ``StepResult.drafts`` and
become step N+1's drafts. Verification stays the runner's, so a draft never changes an
answer: this model's numerics, cache contents or failures cost acceptance, never tokens.

Cache: a paged pool of this model's own K/V whose blocks mirror the target's block ids
(block b here holds the draft model's K/V of the positions block b holds in the target's
cache), plus a scratch pool. Every step feeds this model the real ids at the positions
the target was fed them, through the same block tables, so its cache holds what it
would after computing the same sequence: a prefix-cache hit shares blocks another request
filled (both caches, in the same step), a preempted request recomputes into new blocks,
chunked prefill feeds chunk by chunk. A rejected draft's positions are never trusted:
the next step feeds the real ids from its chunk's start again, rewriting them first.
The proposal pass writes past the request's last real position: into its own blocks
that no one shares (they are not full yet, so not in the prefix cache) and, where the
target has not allocated blocks that far yet, into scratch blocks of this step. A later
step rewrites every such position before it is read.

Under tensor parallelism rank 0 alone holds it, whole, and proposes (the drafts reach
every rank on the next plan). Not with the target's KV connectors (prefill/decode split,
the shared KV store: K/V written by an import has no draft counterpart): the launcher
refuses those at start (launcher/draft_check.py).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from gpu_worker import batch_invariant
from gpu_worker.attention.base import AttentionBackend, AttentionSpec
from gpu_worker.attention.registry import select_backend
from gpu_worker.batch_invariant import Numerics
from gpu_worker.distributed import Ranks
from gpu_worker.model_build import build_model
from gpu_worker.model_config import load_config
from gpu_worker.tp_shard import tp_shard

log = logging.getLogger(__name__)


@dataclass
class DraftFeed:
    """One request's part of a step's draft pass: ``tokens`` (real ids) at positions
    ``start``.. through ``table`` (the target's block ids), then ``propose`` greedy
    drafts after the last of them (0: only fed). ``hidden``: one row per token, for a
    drafter that reads hidden states too (eagle3, gpu_worker/eagle3.py)."""

    start: int
    tokens: list[int]
    table: list[int]
    propose: int = 0
    hidden: torch.Tensor | None = None


class DraftModel:
    """The draft checkpoint at ``path`` on this worker: its weights now, its cache once
    the target's block count is known (``allocate``), its numerics once the target's
    deterministic mode is settled (``settle``)."""

    def __init__(self, path: str, *, k: int, vocab_size: int, device: torch.device,
                 dtype: torch.dtype, block_size: int, max_model_len: int, max_num_seqs: int,
                 load_format: str = "auto", seed: int = 0) -> None:
        self.path = path
        self.config = cfg = load_config(path)
        if cfg.vocab_size != vocab_size:  # (the launcher refuses it first, in one line)
            raise ValueError(f"draft model {path}: vocab_size {cfg.vocab_size}, the target's "
                             f"is {vocab_size}")
        if cfg.encoder is not None or cfg.vision is not None:
            raise ValueError(f"draft model {path}: a text decoder is needed")
        self.device, self.dtype, self.block_size = device, dtype, block_size
        self.max_model_len = max_model_len
        self.shard = tp_shard(cfg)
        self.numerics = Numerics(deterministic=True)  # settled with the target's (settle)
        self.model = build_model(cfg, path, load_format=load_format, seed=seed,
                                 max_positions=max_model_len, device=device, dtype=dtype,
                                 tp=Ranks().tp_group(self.shard, self.numerics))
        log.info("draft model: %s", self.numerics.pack(self.model.matmuls(),
                                                      self.model.matmul_only()))
        log.info("draft model layers: %s", self.model.flatten())
        # scratch blocks per proposing request: its proposals reach k - 1 positions past
        # its last real one, which may run past the blocks the target has allocated
        self.scratch_per_seq = -(-k // block_size) + 1
        self.scratch_seqs = max_num_seqs
        self.num_blocks = 0
        self.kv_caches: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.attn: AttentionBackend | None = None

    @property
    def block_bytes(self) -> int:
        """K and V bytes of one of this model's cache blocks over every layer."""
        elem = torch.empty((), dtype=self.dtype).element_size()
        cfg = self.config
        return 2 * cfg.num_layers * self.block_size * self.shard.kv_heads * cfg.head_dim * elem

    @property
    def scratch_bytes(self) -> int:
        return self.scratch_seqs * self.scratch_per_seq * self.block_bytes

    def allocate(self, num_blocks: int) -> None:
        """The mirrored blocks (``num_blocks``, the target's ids) and the scratch pool after
        them; zeros (padded slots are multiplied, never NaN)."""
        self.num_blocks = num_blocks
        total = num_blocks + self.scratch_seqs * self.scratch_per_seq
        shape = (total, self.block_size, self.shard.kv_heads, self.config.head_dim)
        self.kv_caches = [(torch.zeros(shape, dtype=self.dtype, device=self.device),
                           torch.zeros(shape, dtype=self.dtype, device=self.device))
                          for _ in range(self.config.num_layers)]

    def _spec(self, invariant: bool) -> AttentionSpec:
        cfg = self.config
        return AttentionSpec(self.shard.heads, self.shard.kv_heads, cfg.head_dim,
                             self.block_size, self.dtype, self.device, cfg.scale,
                             tuple((layer.window, cfg.attn_softcap) for layer in cfg.layers),
                             batch_invariant=invariant)

    def settle(self, deterministic: bool) -> str:
        """Batch-invariant numerics where the target runs them and this model can (then a
        draft model equal to the target proposes exactly the target's greedy tokens),
        else the fast ones; returns what was decided, for the log. Either way the drafts
        cannot change an answer."""
        reason = "the target's mode is off"
        if deterministic:
            try:
                backend = select_backend(self._spec(True))
                rows, reason = batch_invariant.measure_min_rows(self.model.matmuls(),
                                                                matmul=self.numerics.matmul)
            except ValueError as err:
                reason = str(err)
            if not reason:
                self.numerics.min_rows = rows
                self.attn = backend
                return f"batch-invariant (matmuls padded to {rows} rows)"
        self.numerics.deterministic = False
        self.attn = select_backend(self._spec(False))
        return f"fast numerics ({reason})"

    def describe(self) -> str:
        cfg = self.config
        return (f"{self.path}: {cfg.model_type}, {cfg.num_layers} layers, hidden "
                f"{cfg.hidden_size}; its cache mirrors the target's {self.num_blocks} blocks "
                f"({self.num_blocks * self.block_bytes / 2**20:.1f} MiB) + "
                f"{self.scratch_seqs * self.scratch_per_seq} scratch blocks")

    # ------------------------------------------------------------------ a step's pass

    def step(self, feeds: list[DraftFeed]) -> list[list[int]]:
        """Feed every ``feeds`` entry's ids, then propose its drafts: one pass over all the
        fed ids (the first drafts come from its rows), then one single-row pass per further
        draft position. Returns the drafts of each feed, in order."""
        out: list[list[int]] = [[] for _ in feeds]
        if not feeds:
            return out
        tables = [f.table for f in feeds]
        wants = [f.propose for f in feeds]
        free = self.num_blocks  # next scratch block
        end = self.num_blocks + self.scratch_seqs * self.scratch_per_seq
        for i, f in enumerate(feeds):
            if not wants[i]:
                continue
            last = f.start + len(f.tokens) - 1 + wants[i]  # one past the last position written
            extra = -(-last // self.block_size) - len(f.table)
            if extra > 0:
                if free + extra > end:  # (more proposing rows than max_num_seqs: none here)
                    wants[i] = 0
                    continue
                tables[i] = [*f.table, *range(free, free + extra)]
                free += extra
        order = [i for i, f in enumerate(feeds) if len(f.tokens) > 1]  # prefills first
        order += sorted((i for i, f in enumerate(feeds) if len(f.tokens) == 1),
                        key=lambda i: feeds[i].start)
        rows: dict[int, int] = {}
        ids: list[int] = []
        positions: list[int] = []
        for i in order:
            f = feeds[i]
            ids.extend(f.tokens)
            positions.extend(range(f.start, f.start + len(f.tokens)))
            rows[i] = len(ids) - 1
        chunks = [(feeds[i].start, len(feeds[i].tokens), tables[i]) for i in order]
        num_decodes = sum(len(feeds[i].tokens) == 1 for i in order)
        proposing = [i for i in order if wants[i]]
        fed = (torch.cat([feeds[i].hidden for i in order])
               if any(f.hidden is not None for f in feeds) else None)
        tokens, state = self._forward(ids, positions, chunks, num_decodes,
                                      [rows[i] for i in proposing], fed)
        for i, t in zip(proposing, tokens):
            out[i].append(t)
        before = proposing  # the feeds of ``state``'s rows, in order
        for j in range(1, max(wants, default=0)):
            active = sorted((i for i in proposing if wants[i] > j),
                            key=lambda i: feeds[i].start)
            at = {i: feeds[i].start + len(feeds[i].tokens) - 1 + j for i in active}
            if state is not None:  # each row's own state from the pass before
                where = {i: n for n, i in enumerate(before)}
                state = state[torch.tensor([where[i] for i in active], device=self.device)]
            tokens, state = self._forward([out[i][-1] for i in active], [at[i] for i in active],
                                          [(at[i], 1, tables[i]) for i in active], len(active),
                                          list(range(len(active))), state)
            before = active
            for i, t in zip(active, tokens):
                out[i].append(t)
        return out

    def _forward(self, ids: list[int], positions: list[int], chunks, num_decodes: int,
                 rows: list[int], hidden: torch.Tensor | None = None
                 ) -> tuple[list[int], torch.Tensor | None]:
        """One pass of this model over a flattened batch: the argmax token of ``rows``, and
        what the next pass of those rows reads besides their token (a draft model: none;
        ``hidden``: that, one row per id, from the feeds or the pass before)."""
        dev = self.device
        meta = self.attn.build(chunks, num_decodes)
        hidden = self.model(torch.tensor(ids, dtype=torch.long, device=dev),
                            torch.tensor(positions, dtype=torch.long, device=dev),
                            self.kv_caches, meta)
        if not rows:
            return [], None
        logits = self.model.compute_logits(hidden[torch.tensor(rows, dtype=torch.long, device=dev)])
        return logits.argmax(dim=-1).tolist(), None
