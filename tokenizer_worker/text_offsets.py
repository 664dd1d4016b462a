"""Where each prompt token starts in the echoed prompt (``/v1/completions`` echo with
logprobs: ``text_offset``).

Each token's text is what it adds to the decoded text before it (``tokenizers``'
DecodeStream, so a character split over several byte tokens arrives whole, with the token
that completes it, and SentencePiece's spaces come out right). Walking the echoed text with
those pieces gives every token's start; a piece the text does not hold there (the BOS the
tokenizer adds to a string prompt) has no width, and a piece whose only difference is a
leading space a decoder put after such a token counts without it. Offsets never pass the
end of the text, and never go back.
"""

from __future__ import annotations

from tokenizers import Tokenizer
from tokenizers.decoders import DecodeStream

__all__ = ["token_starts"]


def token_starts(backend: Tokenizer, ids: list[int], text: str) -> list[int]:
    stream = DecodeStream(skip_special_tokens=False)
    starts: list[int] = []
    at = 0
    for token_id in ids:
        starts.append(at)
        piece = stream.step(backend, token_id) or ""
        if not text.startswith(piece, at):
            piece = piece.lstrip()
            if not piece or not text.startswith(piece, at):
                continue  # not in the echoed text: no width
        at += len(piece)
    return starts
