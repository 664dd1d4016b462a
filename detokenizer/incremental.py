"""Per-request incremental detokenization with stop strings.

Text comes from ``tokenizers``' DecodeStream, which buffers ids until they form whole
UTF-8 characters, so no stream delta ever carries half a character. Stop strings are
matched on the accumulated text; while stop strings are active, the last
``longest_stop - 1`` characters are held back, because they could be the start of a
stop string that the next token completes (and stop strings are trimmed from output).
"""

from __future__ import annotations

from tokenizers import Tokenizer
from tokenizers.decoders import DecodeStream

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
        self._stops = [s for s in params.stop if s]
        self._holdback = max((len(s) for s in self._stops), default=1) - 1
        self.text = ""          # all text produced so far (after trimming, once stopped)
        self._emitted = 0       # characters of self.text already sent
        self.num_tokens = 0     # generated tokens consumed (usage.completion_tokens)
        self.stopped = False    # a stop string matched

    def add_token(self, token_id: int) -> None:
        """Consume one generated id. After a stop string matches, later ids are ignored."""
        if self.stopped:
            return
        self.num_tokens += 1
        piece = self._stream.step(self._tokenizer, token_id)
        if not piece:
            return
        search_from = max(0, len(self.text) - self._holdback)
        self.text += piece
        if self._stops:
            self._check_stops(search_from)

    def _check_stops(self, search_from: int) -> None:
        best: tuple[int, str] | None = None
        for stop in self._stops:
            at = self.text.find(stop, search_from)
            if at != -1 and (best is None or at < best[0]):
                best = (at, stop)
        if best is None:
            return
        at, stop = best
        end = at + len(stop) if self._params.include_stop_str_in_output else at
        self.text = self.text[:end]
        self._emitted = min(self._emitted, end)
        self.stopped = True

    def take_delta(self, final: bool) -> str:
        """Text not yet sent. Holds back a possible stop-string prefix unless final."""
        limit = len(self.text)
        if not final and not self.stopped and self._stops:
            limit = max(self._emitted, len(self.text) - self._holdback)
        delta = self.text[self._emitted:limit]
        self._emitted = limit
        return delta
