"""Pooling: a pooling deployment's output for a request is one vector made from the final
(normed) hidden states of its prompt, not a sampled token.

A long prompt arrives in several prefill chunks, in order, so the pooler keeps what each
method needs between them: the running fp32 sum (mean), the first position's state (cls);
last-token pooling needs only the last chunk. A chunk starting at position 0 starts the
request afresh (a recompute after preemption feeds it again). At the request's last chunk
(the one the plan marks ``sample``) the vector is cut to the request's ``dimensions``
(Matryoshka), normalised where the checkpoint says so, and sent as little-endian float32
bytes (OpenAI's base64 layout).

A classification checkpoint (``PoolingConfig.task`` classify: a cross-encoder) sends its
head's raw logits (``head``: the model's ``classify``, one row at a time, so a row's
logits never depend on the batch) of the pooled state instead; the
frontend applies the activation its route documents.

Under tensor parallelism every rank holds the whole hidden state (the last layer's
all-reduce), and pooling runs no collective, so rank 0's vector is the answer.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F

from cluster.pooling import PoolingConfig
from protocol.ipc import PoolingParams, SeqChunk


class Pooler:
    def __init__(self, config: PoolingConfig, final_norm: Callable[[torch.Tensor], torch.Tensor],
                 head: Callable[[torch.Tensor], torch.Tensor] | None = None) -> None:
        self.config = config
        self.final_norm = final_norm
        self.head = head
        self.params: dict[str, PoolingParams] = {}
        self._partial: dict[str, torch.Tensor] = {}  # mean: fp32 sum so far; cls: first state
        self._ready: list[bytes] = []  # the last step's vectors, until the result takes them

    def register(self, rid: str, params: PoolingParams) -> None:
        self.params[rid] = params

    def release(self, rid: str) -> None:
        self.params.pop(rid, None)
        self._partial.pop(rid, None)

    def take(self) -> list[bytes]:
        """The vectors the last ``pool`` made (once)."""
        ready, self._ready = self._ready, []
        return ready

    def pool(self, ordered: Sequence[SeqChunk], hidden: torch.Tensor, last_row: dict[int, int],
             finishing: Sequence[SeqChunk]) -> None:
        """Accumulate every chunk of ``ordered`` (rows of ``hidden`` up to ``last_row``);
        one vector for each of ``finishing`` (their last chunks), in that order, for
        ``take``."""
        self._ready = []
        method = self.config.method
        if method != "last":
            for s in ordered:
                last = last_row[id(s)]
                rows = hidden[last - len(s.token_ids) + 1:last + 1]
                if method == "mean":
                    total = self.final_norm(rows).float().sum(dim=0)
                    if s.start_pos > 0:
                        total += self._partial[s.rid]
                    self._partial[s.rid] = total
                elif s.start_pos == 0:
                    self._partial[s.rid] = self.final_norm(rows[:1]).float()[0]
        if not finishing:
            return
        if method == "last":
            index = torch.tensor([last_row[id(s)] for s in finishing], device=hidden.device)
            vectors = self.final_norm(hidden[index]).float()
        elif method == "mean":  # every position 0..end was summed, chunk by chunk
            vectors = torch.stack([self._partial.pop(s.rid) / (s.start_pos + len(s.token_ids))
                                   for s in finishing])
        else:
            vectors = torch.stack([self._partial.pop(s.rid) for s in finishing])
        if self.head is not None:  # a classifier's logits, one row at a time (batch-invariant)
            rows = vectors.to(hidden.dtype)
            vectors = torch.cat([self.head(rows[i:i + 1]) for i in range(len(rows))]).float()
        out = []
        for s, vector in zip(finishing, vectors.cpu()):  # one device sync
            dims = self.params.get(s.rid, PoolingParams()).dimensions
            if dims is not None:
                vector = vector[:dims]
            if self.config.normalize and self.head is None:
                vector = F.normalize(vector, dim=-1)
            out.append(vector.numpy().astype("<f4").tobytes())
        self._ready = out
