"""Assembling OpenAI responses and SSE frames from engine deltas: what chat and
completions share.

One assembler per request builds every choice (``n``), usage and prompt logprobs, and
attaches the ``candor`` report to the whole body or to a stream's first frame; each
endpoint's own (``endpoints/chat/assembler.py``, ``endpoints/completions/assembler.py``)
adds its body shapes, its logprobs shape (chat: ``content[]`` entries with bytes and
top_logprobs; completions: parallel ``tokens``/``token_logprobs``/``top_logprobs``/
``text_offset`` lists) and echo.
"""

from __future__ import annotations

import msgspec
from msgspec import UNSET

from protocol import ipc
from protocol.openai_api import (CandorReport, CompletionTokensDetails, PromptLogprob,
                                 PromptLogprobs, PromptTokensDetails, Usage)

_ENCODER = msgspec.json.Encoder()
DONE_FRAME = b"data: [DONE]\n\n"


def sse(obj: msgspec.Struct) -> bytes:
    return b"data: " + _ENCODER.encode(obj) + b"\n\n"


def usage_of(delta: ipc.TextDelta, reasoning_tokens: int | None = None) -> Usage:
    """``reasoning_tokens``: where a reasoning parser split the reply (None: none did)."""
    return Usage(delta.prompt_tokens, delta.completion_tokens,
                 delta.prompt_tokens + delta.completion_tokens,
                 PromptTokensDetails(delta.cached_tokens), _details(reasoning_tokens))


def _details(reasoning_tokens: int | None):
    return UNSET if reasoning_tokens is None else CompletionTokensDetails(reasoning_tokens)


class Collected:
    """A whole (non-streamed) generation of one choice: text, ids, logprobs, last delta."""

    def __init__(self) -> None:
        self.parts: list[str] = []
        self.token_ids: list[int] = []
        self.prompt_token_ids: list[int] | None = None
        self.logprobs: list[ipc.DecodedLogprob] = []
        self.prompt_logprobs: list[ipc.DecodedLogprob] | None = None
        self.last: ipc.TextDelta | None = None
        self.completion_tokens: list[int] = []  # each delta's (cumulative), beside ``parts``
        self.text_offset: list[int] = []  # each logprobs entry's, in the generated text
        self._chars = 0

    def add(self, delta: ipc.TextDelta) -> None:
        """Offsets as a stream computes them (each delta's tokens from the start of its
        text), so the whole answer's ``text_offset`` is the streamed one's concatenation."""
        self.text_offset += offsets_of(delta, self._chars)
        self._chars += len(delta.text)
        self.parts.append(delta.text)
        self.completion_tokens.append(delta.completion_tokens)
        self.token_ids.extend(delta.token_ids)
        if delta.prompt_token_ids is not None:
            self.prompt_token_ids = delta.prompt_token_ids
        if delta.logprobs:
            self.logprobs.extend(delta.logprobs)
        if delta.prompt_logprobs is not None:
            self.prompt_logprobs = delta.prompt_logprobs
        self.last = delta

    @property
    def text(self) -> str:
        return "".join(self.parts)


def offsets_of(delta: ipc.TextDelta, emitted: int) -> list[int]:
    """The text offsets of a delta's logprobs entries: the detokenizer's (where each
    token starts in the generated text), else counted from ``emitted``, the characters
    of the deltas before it (``running_offsets``)."""
    if delta.text_offsets is not None:
        return list(delta.text_offsets)
    return running_offsets(delta.logprobs or [], emitted)


def running_offsets(entries: list[ipc.DecodedLogprob], offset: int) -> list[int]:
    """Text offsets of one delta's tokens: the first at ``offset`` (where the delta's text
    starts in the choice's text), the next ones after the texts before them."""
    out = []
    for e in entries:
        out.append(offset)
        offset += len(e.token)
    return out


def prompt_logprobs(entries: list[ipc.DecodedLogprob] | None, k: int) -> PromptLogprobs:
    """vLLM's ``prompt_logprobs``: per prompt token, its own entry then the top ``k``
    (ranked 1..k), keyed by token id; None for the first token."""
    out: PromptLogprobs = []
    for e in entries or []:
        if e.logprob is None:
            out.append(None)
            continue
        row = {e.token_id: PromptLogprob(e.logprob, e.rank, e.token)}
        for rank, t in enumerate(e.top[:k], start=1):
            row.setdefault(t.token_id, PromptLogprob(t.logprob, rank, t.token))
        out.append(row)
    return out


class Assembler:
    def __init__(self, response_id: str, created: int, model: str, with_ids: bool,
                 n: int = 1, report: CandorReport | None = None,
                 logprobs: bool = False, logprobs_k: int = 0,
                 prompt_logprobs_k: int | None = None) -> None:
        self.id, self.created, self.model = response_id, created, model
        self.with_ids = with_ids
        self.n = n
        self.report = report
        self.logprobs = logprobs
        self.logprobs_k = logprobs_k  # alternatives per token in ``logprobs``
        self.prompt_logprobs_k = prompt_logprobs_k  # the extension, when asked for
        self._report_sent = False

    def _prompt_logprobs(self, got: "Collected"):
        if self.prompt_logprobs_k is None:
            return UNSET
        return prompt_logprobs(got.prompt_logprobs, self.prompt_logprobs_k)

    def _ids(self, ids: list[int] | None):
        return list(ids or []) if self.with_ids else UNSET

    def _candor(self):
        """The report, once: on the whole body, or on a stream's first frame."""
        if self.report is None or self._report_sent:
            return UNSET
        self._report_sent = True
        return self.report

    def usage(self, choices: list[Collected]) -> Usage:
        return sum_usage([c.last for c in choices], self.n)

    def opening_chunks(self, num_choices: int) -> list[msgspec.Struct]:
        """What a stream sends before any delta (chat: each choice's role)."""
        return []

    def first_chunk(self, choice: int, delta: ipc.TextDelta) -> msgspec.Struct | None:
        """What a stream sends before a choice's first delta (completions: the echo)."""
        return None


def sum_usage(lasts: list[ipc.TextDelta], n: int,
              reasoning_tokens: int | None = None) -> Usage:
    """Summed over prompts; the n choices of one prompt share it, so each prompt (and its
    prefix-cache hit) is counted once. ``lasts`` is in choice order (p * n + i);
    ``reasoning_tokens``: every choice's, where a reasoning parser split the replies."""
    groups = [lasts[p:p + n] for p in range(0, len(lasts), n)]
    prompt = sum(g[0].prompt_tokens for g in groups)
    completion = sum(d.completion_tokens for d in lasts)
    cached = sum(max(d.cached_tokens for d in g) for g in groups)
    return Usage(prompt, completion, prompt + completion, PromptTokensDetails(cached),
                 _details(reasoning_tokens))
