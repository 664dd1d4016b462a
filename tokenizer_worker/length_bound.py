"""A lower bound on a text's token count from its UTF-8 length, before tokenizing it.

No single token covers more input bytes than the longest vocabulary entry (decoded to the
bytes it stands for), so ``ceil(bytes / longest)`` tokens is a floor that holds for any text.
A prompt whose floor is already past the context can be refused without spending the
tokenizer's time and memory on it, and such a refusal can never hit a prompt that fits.

The floor is only sound when the tokenizer keeps every input byte in some token: a
normalizer or pre-tokenizer that drops or folds text (BERT's whitespace split, NFKC, an
added token that swallows neighbouring spaces) could turn many bytes into few tokens. For
those pipelines ``TokenLengthBound.longest_token_bytes`` is None and no bound is applied.
"""

from __future__ import annotations

import json

from tokenizers import Tokenizer

__all__ = ["TokenLengthBound", "utf8_len"]

# Pipeline steps that never remove input bytes (Replace/Prepend only ever add or swap text).
_LOSSLESS_NORMALIZERS = frozenset({"Prepend", "Replace"})
_LOSSLESS_PRE_TOKENIZERS = frozenset({"ByteLevel", "Metaspace", "Split", "Digits", "Punctuation"})


def utf8_len(text: str) -> int:
    """UTF-8 byte length; O(1) for ASCII text (CPython stores it as one byte per char)."""
    return len(text) if text.isascii() else len(text.encode("utf-8"))


def _byte_level_decoder() -> dict[str, int]:
    """GPT-2's printable stand-in char -> the byte it encodes (byte-level BPE vocabularies)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[chr(b)] = b
        else:
            chars[chr(256 + extra)] = b
            extra += 1
    return chars


def _steps(node: dict | None) -> list[dict]:
    if node is None:
        return []
    if node.get("type") == "Sequence":
        children = node.get("normalizers") or node.get("pretokenizers") or []
        return [s for child in children for s in _steps(child)]
    return [node]


def _lossless(spec: dict) -> bool:
    for step in _steps(spec.get("normalizer")):
        if step.get("type") not in _LOSSLESS_NORMALIZERS:
            return False
        if step.get("type") == "Replace" and not step.get("content"):
            return False
    for step in _steps(spec.get("pre_tokenizer")):
        if step.get("type") not in _LOSSLESS_PRE_TOKENIZERS:
            return False
        if step.get("type") == "Split" and step.get("behavior") == "Removed":
            return False
    # An added token with lstrip/rstrip absorbs any run of whitespace next to it.
    return not any(t.get("lstrip") or t.get("rstrip") for t in spec.get("added_tokens") or [])


class TokenLengthBound:
    """``longest_token_bytes``: the most input bytes one token can cover (None: unknown)."""

    def __init__(self, backend: Tokenizer) -> None:
        spec = json.loads(backend.to_str())
        self.longest_token_bytes: int | None = None
        if not _lossless(spec):
            return
        byte_level = any(s.get("type") == "ByteLevel" for s in _steps(spec.get("pre_tokenizer")))
        to_byte = _byte_level_decoder() if byte_level else {}
        added = {t["content"] for t in spec.get("added_tokens") or []}
        longest = 1
        for token in backend.get_vocab(with_added_tokens=True):
            if token in added or not byte_level:
                # Metaspace's "▁" (3 bytes) stands for one space and "<0x41>" for one byte:
                # the raw UTF-8 length over-counts, which only loosens the floor.
                size = utf8_len(token)
            else:
                size = sum(1 if c in to_byte else len(c.encode("utf-8")) for c in token)
            longest = max(longest, size)
        self.longest_token_bytes = longest

    def min_tokens(self, text_bytes: int) -> int:
        """Fewest tokens ``text_bytes`` bytes of text can encode to (0 when unknown)."""
        if self.longest_token_bytes is None:
            return 0
        return -(-text_bytes // self.longest_token_bytes)

    def max_bytes(self, max_tokens: int) -> int | None:
        """Past this many bytes a text certainly needs more than ``max_tokens`` tokens."""
        if self.longest_token_bytes is None:
            return None
        return max_tokens * self.longest_token_bytes
