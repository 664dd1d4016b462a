"""Token texts for logprobs: each id decoded on its own, as OpenAI's ``token`` field, and
the token's own bytes where that text is not them.

A token that holds part of a UTF-8 character (a byte-level BPE piece such as ``æĹ``, a
``<0xE6>`` byte-fallback piece) decodes alone to U+FFFD; OpenAI's ``bytes`` field is
there so a client can rebuild such characters, so it must carry the token's real bytes,
not the UTF-8 of U+FFFD."""

from __future__ import annotations

import json
import re

from tokenizers import Tokenizer

from protocol.ipc import DecodedLogprob, TokenLogprob, TopLogprob

_BYTE_PIECE = re.compile(r"<0x([0-9A-Fa-f]{2})>")  # sentencepiece byte fallback


def _byte_alphabet() -> dict[str, int]:
    """Byte-level BPE's alphabet (GPT-2's): the printable character standing for each
    byte in the vocabulary's pieces, mapped back to the byte."""
    kept = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
            *range(ord("®"), ord("ÿ") + 1)]
    chars = {b: chr(b) for b in kept}
    extra = 0
    for b in range(256):
        if b not in chars:
            chars[b] = chr(256 + extra)
            extra += 1
    return {c: b for b, c in chars.items()}


def _uses_byte_level(decoder: dict | None) -> bool:
    if not decoder:
        return False
    if decoder.get("type") == "Sequence":
        return any(_uses_byte_level(d) for d in decoder.get("decoders", ()))
    return decoder.get("type") == "ByteLevel"


class TokenTexts:
    """Decodes single ids (special tokens kept) with a cache; the vocabulary bounds it."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self._tokenizer = tokenizer
        self._cache: dict[int, tuple[str, bytes | None]] = {}
        decoder = json.loads(tokenizer.to_str()).get("decoder")
        self._alphabet = _byte_alphabet() if _uses_byte_level(decoder) else None
        self._added = set(tokenizer.get_added_tokens_decoder())

    def _own_bytes(self, token_id: int, text: str) -> bytes | None:
        """The token's bytes where its text lost some (None: they are its text's UTF-8)."""
        if "\ufffd" not in text:
            return None
        piece = self._tokenizer.id_to_token(token_id) or ""
        if (m := _BYTE_PIECE.fullmatch(piece)) is not None:
            return bytes([int(m.group(1), 16)])
        if (self._alphabet is not None and token_id not in self._added
                and all(c in self._alphabet for c in piece)):
            return bytes(self._alphabet[c] for c in piece)
        return None

    def get(self, token_id: int) -> tuple[str, bytes | None]:
        got = self._cache.get(token_id)
        if got is None:
            text = self._tokenizer.decode([token_id], skip_special_tokens=False)
            got = self._cache[token_id] = (text, self._own_bytes(token_id, text))
        return got

    def decode(self, entries: list[TokenLogprob] | None) -> list[DecodedLogprob] | None:
        if entries is None:
            return None
        out = []
        for e in entries:
            top = []
            for i, v in zip(e.top_ids, e.top_logprobs):
                text, raw = self.get(i)
                top.append(TopLogprob(i, text, v, raw))
            text, raw = self.get(e.token_id)
            out.append(DecodedLogprob(e.token_id, text, e.logprob, top, e.rank, raw))
        return out
