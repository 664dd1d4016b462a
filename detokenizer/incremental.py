"""Per-request incremental detokenization with stop strings.

Text comes from ``tokenizers``' DecodeStream, which buffers ids until they form whole
UTF-8 characters, so no stream delta ever carries half a character. Stop strings are
matched by ``StopMatcher`` (cost per token independent of how many there are); a stream
holds back exactly the tail that could still be the start of a stop string the next
token completes (stop strings are trimmed from output), and nothing else.
"""

from __future__ import annotations

from tokenizers import Tokenizer
from tokenizers.decoders import DecodeStream

from detokenizer.stops import StopMatcher
from protocol.ipc import DetokParams

# Prompt ids fed to the stream first, so the first generated token decodes in context
# (e.g. SentencePiece's leading-space rule); only a few are needed.
_CONTEXT_IDS = 6


class RequestDetokenizer:
    """Turns one request's generated ids into text deltas."""

    def __init__(self, tokenizer: Tokenizer, params: DetokParams,
                 prompt_tail: list[int] | None = None) -> None:
        self._tokenizer = tokenizer
        self._params = params
        self._stream = DecodeStream(ids=list(prompt_tail or [])[-_CONTEXT_IDS:],
                                    skip_special_tokens=params.skip_special_tokens)
        self._stops = StopMatcher(params.stop)
        self.text = ""          # all text produced so far (after trimming, once stopped)
        self._emitted = 0       # characters of self.text already sent
        self.num_tokens = 0     # generated tokens consumed (usage.completion_tokens)
        self.stopped = False    # a stop string matched
        self.stop_string: str | None = None  # which one (the first in the text)
        self._min_end = 0       # stop strings must end after this (min_tokens' text)
        # per consumed token, where its text starts in ``text`` (the characters decoded
        # before it): logprobs' text_offset, the same however the ids are grouped into
        # deltas (several per delta under speculative decoding)
        self.offsets: list[int] = []

    def add_tokens(self, token_ids: list[int], stopping: bool = False) -> None:
        """Consume generated ids; ``stopping``: the last one ended the sequence (EOS or a
        stop_token_ids id): it counts, but its text is left out of the answer unless
        ``include_stop_str_in_output`` (as vLLM)."""
        last = len(token_ids) - 1
        for i, token_id in enumerate(token_ids):
            self.add_token(token_id, text=not (stopping and i == last)
                           or self._params.include_stop_str_in_output)

    def add_token(self, token_id: int, text: bool = True) -> None:
        """Consume one generated id (``text`` False: count it, decode nothing). After a
        stop string matches, later ids are ignored."""
        if self.stopped:
            return
        self.num_tokens += 1
        self.offsets.append(len(self.text))
        if not text:
            return
        piece = self._stream.step(self._tokenizer, token_id)
        if not piece:
            return
        self.text += piece
        if self.num_tokens <= self._params.min_tokens:
            self._min_end = len(self.text)
        if self._stops.active:
            self._check_stops()

    def _check_stops(self) -> None:
        found = self._stops.feed(self.text, self._min_end)
        if found is None:
            return
        at, stop_end = found
        self.stop_string = self.text[at:stop_end]
        end = stop_end if self._params.include_stop_str_in_output else at
        self.text = self.text[:end]
        self._emitted = min(self._emitted, end)
        self.stopped = True

    def take_delta(self, final: bool) -> str:
        """Text not yet sent. Holds back a possible stop-string prefix unless final."""
        limit = len(self.text)
        if not final and not self.stopped and self._stops.active:
            limit = max(self._emitted, self._stops.hold_from)
        delta = self.text[self._emitted:limit]
        self._emitted = limit
        return delta
