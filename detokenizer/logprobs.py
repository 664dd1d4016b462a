"""Token texts for logprobs: each id decoded on its own, as OpenAI's ``token`` field."""

from __future__ import annotations

from tokenizers import Tokenizer

from protocol.ipc import DecodedLogprob, TokenLogprob, TopLogprob


class TokenTexts:
    """Decodes single ids (special tokens kept) with a cache; the vocabulary bounds it."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self._tokenizer = tokenizer
        self._cache: dict[int, str] = {}

    def text(self, token_id: int) -> str:
        text = self._cache.get(token_id)
        if text is None:
            text = self._tokenizer.decode([token_id], skip_special_tokens=False)
            self._cache[token_id] = text
        return text

    def decode(self, entries: list[TokenLogprob] | None) -> list[DecodedLogprob] | None:
        if entries is None:
            return None
        return [DecodedLogprob(e.token_id, self.text(e.token_id), e.logprob,
                               [TopLogprob(i, self.text(i), v)
                                for i, v in zip(e.top_ids, e.top_logprobs)], e.rank)
                for e in entries]
