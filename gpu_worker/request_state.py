"""Per-request state the worker keeps beyond the KV cache: token history and prompt logprobs.

The worker sees every token a sequence is fed (prompt chunks, then each sampled token as
the next decode input), so it rebuilds the history from the plan itself instead of having
the scheduler resend it: penalties and min_tokens read it. Only requests whose sampling
needs it pay for it. The one thing it is not fed is a prefix-cache hit: the request's
first chunk then carries the skipped ids (``SeqChunk.context``), once. Prompt logprobs
(``echo`` + ``logprobs``, or ``prompt_logprobs``) are collected chunk by chunk and handed
out once, with the request's first sampled token; the scheduler never serves such a
request's prompt from the prefix cache, so every position is fed and has logits.
"""

from __future__ import annotations

import torch

from gpu_worker.sampler import History, top_logprobs
from protocol.ipc import SamplingParams, SeqChunk, TokenLogprob


class RequestTracker:
    def __init__(self) -> None:
        self._history: dict[str, list[int]] = {}
        self._prompt_lp: dict[str, list[TokenLogprob]] = {}
        # log-softmax row of a chunk's last position, waiting for the next chunk's first token
        self._pending: dict[str, torch.Tensor] = {}
        self._prompt_done: set[str] = set()

    def release(self, rid: str) -> None:
        self._history.pop(rid, None)
        self._prompt_lp.pop(rid, None)
        self._pending.pop(rid, None)
        self._prompt_done.discard(rid)

    def observe(self, seq: SeqChunk, params: SamplingParams | None) -> None:
        """Record the ids fed at ``start_pos..`` (after the cached ``context`` a first
        chunk may carry); a recompute after preemption rewrites them."""
        if params is None or not params.needs_history():
            return
        h = self._history.setdefault(seq.rid, [])
        if seq.context:
            h[:] = seq.context
        if len(h) < seq.start_pos:  # never a history with a hole that looks whole
            raise ValueError(f"{seq.rid}: fed from position {seq.start_pos} but its history "
                             f"holds {len(h)} ids (a prefix-cache hit without its context?)")
        del h[seq.start_pos:]
        h.extend(seq.token_ids)

    def history(self, rid: str, params: SamplingParams) -> History | None:
        h = self._history.get(rid)
        return None if h is None else (h, params.num_prompt_tokens)

    def wants_prompt_logprobs(self, seq: SeqChunk, params: SamplingParams | None) -> bool:
        return (params is not None and params.prompt_logprobs >= 0
                and seq.rid not in self._prompt_done and seq.start_pos < params.num_prompt_tokens)

    def add_prompt_logprobs(self, seq: SeqChunk, params: SamplingParams, logits: torch.Tensor) -> None:
        """``logits``: one row per fed position of ``seq``; row j predicts position start+j+1."""
        rid, start, ids = seq.rid, seq.start_pos, seq.token_ids
        if start == 0:
            self._prompt_lp[rid] = [TokenLogprob(ids[0], None)]
            self._pending.pop(rid, None)
        entries = self._prompt_lp.get(rid)
        if entries is None:  # never a short list that looks complete
            raise ValueError(f"{rid}: prompt logprobs asked for, but its prompt was not fed "
                             f"from position 0 (first chunk at {start})")
        logprobs = torch.log_softmax(logits.float(), dim=-1)
        prev = self._pending.pop(rid, None)
        if prev is not None:  # the previous chunk's last row predicts this chunk's first id
            logprobs = torch.cat([prev[None], logprobs])
            targets = ids
            rows = logprobs[:len(ids)]
        else:
            targets = ids[1:]
            rows = logprobs[:len(ids) - 1]
        if targets:
            chosen = torch.tensor(targets, dtype=torch.long, device=logprobs.device)
            entries.extend(top_logprobs(rows, chosen, [params.prompt_logprobs] * len(targets),
                                        with_rank=True))
        end = start + len(ids)
        if end < params.num_prompt_tokens:
            self._pending[rid] = logprobs[-1]

    def take_prompt_logprobs(self, rid: str) -> list[TokenLogprob] | None:
        """Once, at the first sampled token."""
        if rid in self._prompt_done:
            return None
        entries = self._prompt_lp.pop(rid, None)
        if entries is not None:
            self._prompt_done.add(rid)
        return entries
