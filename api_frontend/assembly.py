"""Assembling OpenAI responses and SSE frames from engine deltas.

One assembler per request builds every choice (``n``), the logprobs in OpenAI's two
shapes (chat: ``content[]`` entries with bytes and top_logprobs; completions: parallel
``tokens``/``token_logprobs``/``top_logprobs``/``text_offset`` lists), echo, usage, and
attaches the ``candor`` report to the whole body or to a stream's first frame.
"""

from __future__ import annotations

import msgspec
from msgspec import UNSET

from api_frontend import reasoning
from api_frontend.tool_parsers.stream import ToolCallStream, parse_whole
from api_frontend.tools import ToolPlan
from protocol import ipc
from protocol.openai_api import (AssistantMessage, CandorReport, ChatChoice, ChatChunkChoice,
                                 ChatCompletionChunk, ChatCompletionResponse, ChatDelta,
                                 ChatLogprobEntry, ChatLogprobs, CompletionChoice,
                                 CompletionChunk, CompletionLogprobs, CompletionResponse,
                                 PromptLogprob, PromptLogprobs, PromptTokensDetails,
                                 TopLogprobEntry, Usage)

_ENCODER = msgspec.json.Encoder()
DONE_FRAME = b"data: [DONE]\n\n"


def sse(obj: msgspec.Struct) -> bytes:
    return b"data: " + _ENCODER.encode(obj) + b"\n\n"


def usage_of(delta: ipc.TextDelta) -> Usage:
    return Usage(delta.prompt_tokens, delta.completion_tokens,
                 delta.prompt_tokens + delta.completion_tokens,
                 PromptTokensDetails(delta.cached_tokens))


class Collected:
    """A whole (non-streamed) generation of one choice: text, ids, logprobs, last delta."""

    def __init__(self) -> None:
        self.parts: list[str] = []
        self.token_ids: list[int] = []
        self.prompt_token_ids: list[int] | None = None
        self.logprobs: list[ipc.DecodedLogprob] = []
        self.prompt_logprobs: list[ipc.DecodedLogprob] | None = None
        self.last: ipc.TextDelta | None = None
        self.text_offset: list[int] = []  # each logprobs entry's, in the generated text
        self._chars = 0

    def add(self, delta: ipc.TextDelta) -> None:
        """Offsets as a stream computes them (each delta's tokens from the start of its
        text), so the whole answer's ``text_offset`` is the streamed one's concatenation."""
        self.text_offset += running_offsets(delta.logprobs or [], self._chars)
        self._chars += len(delta.text)
        self.parts.append(delta.text)
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


def _bytes(entry: ipc.DecodedLogprob | ipc.TopLogprob) -> list[int]:
    """The token's own bytes (not the UTF-8 of U+FFFD for part of a character)."""
    return list(entry.raw if entry.raw is not None else entry.token.encode("utf-8"))


def chat_logprobs(entries: list[ipc.DecodedLogprob]) -> ChatLogprobs:
    return ChatLogprobs([ChatLogprobEntry(e.token, e.logprob if e.logprob is not None else 0.0,
                                          _bytes(e),
                                          [TopLogprobEntry(t.token, t.logprob, _bytes(t))
                                           for t in e.top]) for e in entries])


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


def running_offsets(entries: list[ipc.DecodedLogprob], offset: int) -> list[int]:
    """Text offsets of one delta's tokens: the first at ``offset`` (where the delta's text
    starts in the choice's text), the next ones after the texts before them."""
    out = []
    for e in entries:
        out.append(offset)
        offset += len(e.token)
    return out


def _top(entries: list[ipc.DecodedLogprob], k: int) -> list[ipc.DecodedLogprob]:
    """Entries with at most ``k`` alternatives (one prompt computation serves two k's)."""
    return [msgspec.structs.replace(e, top=e.top[:k]) if len(e.top) > k else e
            for e in entries]


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


class _Assembler:
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
        return _sum_usage([c.last for c in choices], self.n)


class CompletionAssembler(_Assembler):
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

    def echo_chunk(self, index: int, delta: ipc.TextDelta) -> CompletionChunk:
        """The prompt (and its logprobs) as a choice's first streamed text."""
        text = self._echo(index) or ""
        lp = None
        if self.logprobs and delta.prompt_logprobs:
            entries = _top(delta.prompt_logprobs, self.logprobs_k)
            lp = completion_logprobs(entries, self._echo_starts(index, entries))
        self._offsets[index] = len(text)
        return CompletionChunk(self.id, self.created, self.model,
                               [CompletionChoice(index, text, None, lp)], None,
                               candor=self._candor())

    def chunk(self, index: int, delta: ipc.TextDelta, with_usage: bool) -> CompletionChunk:
        lp = None
        if self.logprobs:
            offset = self._offsets.get(index, 0)
            entries = delta.logprobs or []
            lp = completion_logprobs(entries, running_offsets(entries, offset))
            self._offsets[index] = offset + len(delta.text)
        return CompletionChunk(self.id, self.created, self.model,
                               [CompletionChoice(index, delta.text, delta.finish_reason, lp,
                                                 token_ids=self._ids(delta.token_ids))],
                               usage_of(delta) if with_usage else None, candor=self._candor())

    def usage_chunk(self, choices_last: list[ipc.TextDelta]) -> CompletionChunk:
        return CompletionChunk(self.id, self.created, self.model, [],
                               _sum_usage(choices_last, self.n))


def _sum_usage(lasts: list[ipc.TextDelta], n: int) -> Usage:
    """Summed over prompts; the n choices of one prompt share it, so each prompt (and its
    prefix-cache hit) is counted once. ``lasts`` is in choice order (p * n + i)."""
    groups = [lasts[p:p + n] for p in range(0, len(lasts), n)]
    prompt = sum(g[0].prompt_tokens for g in groups)
    completion = sum(d.completion_tokens for d in lasts)
    cached = sum(max(d.cached_tokens for d in g) for g in groups)
    return Usage(prompt, completion, prompt + completion, PromptTokensDetails(cached))


def _tool_finish(reason: str | None, made_calls: bool, complete: bool) -> str | None:
    """``tool_calls`` when the choice made calls, each written to its end, and stopped
    (an end token, the grammar's end, a stop after the calls). A reply that ended inside a
    call keeps what ended it, ``stop`` or ``length``: that call was streamed as far as it
    was written, and its arguments do not parse."""
    return "tool_calls" if made_calls and complete and reason == "stop" else reason


class ChatAssembler(_Assembler):
    """Builds /v1/chat/completions bodies and chunks for one request. With tools, each
    choice's text goes through the tool-call parser: whole, or streamed as OpenAI's
    ``tool_calls`` deltas (see ``tool_parsers.stream``)."""

    def __init__(self, *args, echo_text: str | None = None, tools: ToolPlan | None = None,
                 reasoning_parser: str | None = None, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.echo_text = echo_text  # the final assistant message, when echo is on
        self.tools = tools
        self.reasoning_parser = reasoning_parser
        self._streams: dict[int, ToolCallStream] = {}
        self._thinking: dict[int, reasoning.ReasoningStream] = {}

    @property
    def parses_tools(self) -> bool:
        return self.tools is not None and self.tools.mode != "none"

    def _message(self, got: Collected) -> tuple[AssistantMessage, str | None]:
        reason, text, thought = got.last.finish_reason, got.text, UNSET
        if self.reasoning_parser is not None:
            thought, text = reasoning.get(self.reasoning_parser).split(text, True)
            thought = thought or UNSET
        if not self.parses_tools:
            content = (self.echo_text or "") + text
            if thought is not UNSET and not content:
                content = None  # the whole reply was reasoning
            return AssistantMessage(content, reasoning_content=thought), reason
        result = parse_whole(self.tools.parser(), text)
        content = result.content if result.content or thought is UNSET else None
        return (AssistantMessage(content, tool_calls=result.calls or UNSET,
                                 reasoning_content=thought),
                _tool_finish(reason, bool(result.calls), result.complete))

    def final(self, choices: list[Collected]) -> ChatCompletionResponse:
        out = []
        for i, got in enumerate(choices):
            message, reason = self._message(got)
            out.append(ChatChoice(i, message, reason,
                                  chat_logprobs(got.logprobs) if self.logprobs else None,
                                  token_ids=self._ids(got.token_ids)))
        return ChatCompletionResponse(self.id, self.created, self.model, out, self.usage(choices),
                                      prompt_token_ids=self._ids(choices[0].prompt_token_ids),
                                      prompt_logprobs=self._prompt_logprobs(choices[0]),
                                      candor=self._candor())

    def role_chunk(self, index: int = 0) -> ChatCompletionChunk:
        return ChatCompletionChunk(
            self.id, self.created, self.model,
            [ChatChunkChoice(index, ChatDelta(role="assistant", content=self.echo_text or ""))],
            candor=self._candor())

    def chunk(self, index: int, delta: ipc.TextDelta,
              with_usage: bool) -> ChatCompletionChunk | None:
        """None when there is nothing to send yet (text held back as a possible tag)."""
        lp = chat_logprobs(delta.logprobs or []) if self.logprobs else None
        reason = delta.finish_reason
        if self.parses_tools or self.reasoning_parser is not None:
            text, thought = delta.text, ""
            if self.reasoning_parser is not None:
                thinking = self._thinking.get(index)
                if thinking is None:
                    thinking = self._thinking[index] = reasoning.ReasoningStream(
                        reasoning.get(self.reasoning_parser))
                thought, text = thinking.feed(text, reason is not None)
            content, calls = text, []
            if self.parses_tools:
                stream = self._streams.get(index)
                if stream is None:
                    stream = self._streams[index] = ToolCallStream(self.tools.parser())
                content, calls = stream.feed(text, final=reason is not None)
                reason = _tool_finish(reason, stream.made_calls, stream.complete)
            message = ChatDelta(content=content or None, reasoning_content=thought or None,
                                tool_calls=calls or None)
            if (not content and not calls and not thought and reason is None
                    and not with_usage and not (lp and lp.content)
                    and not (self.with_ids and delta.token_ids)):
                return None
        else:
            content = delta.text if delta.text or reason is None else None
            message = ChatDelta(content=content)
        return ChatCompletionChunk(
            self.id, self.created, self.model,
            [ChatChunkChoice(index, message, reason, lp, token_ids=self._ids(delta.token_ids))],
            usage_of(delta) if with_usage else None, candor=self._candor())

    def usage_chunk(self, choices_last: list[ipc.TextDelta]) -> ChatCompletionChunk:
        return ChatCompletionChunk(self.id, self.created, self.model, [],
                                   _sum_usage(choices_last, self.n))
