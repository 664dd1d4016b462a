"""Assembling /v1/completions bodies and chunks: one choice per prompt and sample,
completions' logprobs shape (parallel lists with text offsets) and echo."""

from __future__ import annotations

import msgspec
from msgspec import UNSET

from api_frontend.assembly import Assembler, Collected, running_offsets, sum_usage, usage_of
from protocol import ipc
from protocol.openai_api import (CompletionChoice, CompletionChunk, CompletionLogprobs,
                                 CompletionResponse)


def completion_logprobs(entries: list[ipc.DecodedLogprob],
                        text_offset: list[int]) -> CompletionLogprobs:
    out = CompletionLogprobs([], [], [], text_offset)
    for e in entries:
        out.tokens.append(e.token)
        out.token_logprobs.append(e.logprob)
        if e.logprob is None:
            out.top_logprobs.append(None)
        else:
            top = {t.token: t.logprob for t in e.top}
            top.setdefault(e.token, e.logprob)
            out.top_logprobs.append(top)
    return out


def _top(entries: list[ipc.DecodedLogprob], k: int) -> list[ipc.DecodedLogprob]:
    """Entries with at most ``k`` alternatives (one prompt computation serves two k's)."""
    return [msgspec.structs.replace(e, top=e.top[:k]) if len(e.top) > k else e
            for e in entries]


class CompletionAssembler(Assembler):
    """Builds /v1/completions bodies and chunks for one request: ``prompts`` prompts of
    ``n`` choices each, choice ``p * n + i`` for the i-th sample of prompt p."""

    def __init__(self, *args, echo_texts: list[str] | None = None,
                 echo_offsets: list[list[int]] | None = None, prompts: int = 1,
                 **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.echo_texts = echo_texts  # each prompt's text, when echo is on
        self.echo_offsets = echo_offsets  # where each prompt token starts in its text
        self.prompts = prompts
        self._offsets: dict[int, int] = {}
        self._echo_lens: dict[int, int] = {}  # per choice: its echoed prompt's length

    def _echo(self, choice: int) -> str | None:
        return None if self.echo_texts is None else self.echo_texts[choice // self.n]

    def _echo_starts(self, choice: int, entries: list[ipc.DecodedLogprob]) -> list[int]:
        """Where each prompt token starts in the echoed prompt (the tokenizer worker's
        ``prompt_offsets``: a BOS the text does not hold has no width); the answer's tokens
        follow from the prompt's end, whole or streamed."""
        starts = self.echo_offsets[choice // self.n] if self.echo_offsets else []
        if len(starts) != len(entries):  # not sent: the prompt's tokens one after another
            starts = running_offsets(entries, 0)
        return starts

    def final(self, choices: list[Collected]) -> CompletionResponse:
        out = []
        several = self.prompts > 1
        for i, got in enumerate(choices):
            echo = self._echo(i)
            lp = None
            if self.logprobs:  # with echo, the prompt's entries come first
                shift = len(echo or "")
                entries, offsets = got.logprobs, [shift + o for o in got.text_offset]
                if echo is not None:
                    head = _top(got.prompt_logprobs or [], self.logprobs_k)
                    entries, offsets = head + entries, self._echo_starts(i, head) + offsets
                lp = completion_logprobs(entries, offsets)
            out.append(CompletionChoice(
                i, (echo or "") + got.text, got.last.finish_reason, lp,
                token_ids=self._ids(got.token_ids),
                prompt_token_ids=self._ids(got.prompt_token_ids) if several else UNSET,
                prompt_logprobs=self._prompt_logprobs(got)))
        return CompletionResponse(
            self.id, self.created, self.model, out, self.usage(choices),
            prompt_token_ids=UNSET if several else self._ids(choices[0].prompt_token_ids),
            candor=self._candor())

    def first_chunk(self, choice: int, delta: ipc.TextDelta) -> CompletionChunk | None:
        return None if self.echo_texts is None else self.echo_chunk(choice, delta)

    def echo_chunk(self, index: int, delta: ipc.TextDelta) -> CompletionChunk:
        """The prompt (and its logprobs) as a choice's first streamed text."""
        text = self._echo(index) or ""
        lp = None
        if self.logprobs and delta.prompt_logprobs:
            entries = _top(delta.prompt_logprobs, self.logprobs_k)
            lp = completion_logprobs(entries, self._echo_starts(index, entries))
        self._offsets[index] = len(text)
        self._echo_lens[index] = len(text)  # the answer's offsets start after it
        return CompletionChunk(self.id, self.created, self.model,
                               [CompletionChoice(index, text, None, lp)], None,
                               candor=self._candor())

    def chunk(self, index: int, delta: ipc.TextDelta, with_usage: bool) -> CompletionChunk:
        lp = None
        if self.logprobs:
            offset = self._offsets.get(index, 0)
            entries = delta.logprobs or []
            starts = (running_offsets(entries, offset) if delta.text_offsets is None else
                      [self._echo_lens.get(index, 0) + o for o in delta.text_offsets])
            lp = completion_logprobs(entries, starts)
            self._offsets[index] = offset + len(delta.text)
        return CompletionChunk(self.id, self.created, self.model,
                               [CompletionChoice(index, delta.text, delta.finish_reason, lp,
                                                 token_ids=self._ids(delta.token_ids))],
                               usage_of(delta) if with_usage else None, candor=self._candor())

    def usage_chunk(self, choices_last: list[ipc.TextDelta]) -> CompletionChunk:
        return CompletionChunk(self.id, self.created, self.model, [],
                               sum_usage(choices_last, self.n))
