"""Incremental detokenization: no broken characters in any delta, stop strings trimmed
even when they straddle tokens, and held-back text released at the end."""

from __future__ import annotations

import pytest
from tokenizers import Tokenizer

from detokenizer.incremental import RequestDetokenizer
from protocol.ipc import DetokParams

TEXT = "Über café — 中文 and 🙂🙂 emoji, then plain words at the end."


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    return Tokenizer.from_file(str(tiny_model_dir / "tokenizer.json"))


def _run(tokenizer, text: str, params: DetokParams) -> tuple[list[str], RequestDetokenizer]:
    detok = RequestDetokenizer(tokenizer, params)
    deltas = []
    for token_id in tokenizer.encode(text, add_special_tokens=False).ids:
        detok.add_token(token_id)
        deltas.append(detok.take_delta(final=False))
        if detok.stopped:
            break
    deltas.append(detok.take_delta(final=True))
    return deltas, detok


def test_every_delta_is_whole_characters(tokenizer):
    ids = tokenizer.encode(TEXT, add_special_tokens=False).ids
    assert len(ids) > len(TEXT.split())  # multi-byte characters span several byte tokens
    deltas, detok = _run(tokenizer, TEXT, DetokParams())
    assert all("\ufffd" not in d for d in deltas)
    assert "".join(deltas) == TEXT == tokenizer.decode(ids)
    assert detok.num_tokens == len(ids)


@pytest.mark.parametrize("stop, include, expected", [
    ("中文", False, "Über café — "),
    ("中文", True, "Über café — 中文"),
    ("plain words", False, "Über café — 中文 and 🙂🙂 emoji, then "),
    ("é — 中", False, "Über caf"),
])
def test_stop_strings_are_trimmed_across_tokens(tokenizer, stop, include, expected):
    deltas, detok = _run(tokenizer, TEXT, DetokParams(stop=[stop], include_stop_str_in_output=include))
    assert detok.stopped
    assert "".join(deltas) == expected
    if not include:
        assert all(stop not in d for d in deltas)


def test_earliest_of_several_stop_strings_wins(tokenizer):
    deltas, _ = _run(tokenizer, TEXT, DetokParams(stop=["emoji", "café"]))
    assert "".join(deltas) == "Über "


def test_holdback_released_when_no_stop_matches(tokenizer):
    deltas, detok = _run(tokenizer, TEXT, DetokParams(stop=["never appears anywhere"]))
    assert not detok.stopped and "".join(deltas) == TEXT
    # while streaming, the possible start of a stop string was held back
    assert len(deltas[-1]) > 0


def test_special_tokens_skipped_or_kept(tokenizer):
    eot = tokenizer.token_to_id("<|eot_id|>")
    ids = tokenizer.encode("hi", add_special_tokens=False).ids + [eot]
    for skip, expect in ((True, "hi"), (False, "hi<|eot_id|>")):
        detok = RequestDetokenizer(tokenizer, DetokParams(skip_special_tokens=skip))
        for i in ids:
            detok.add_token(i)
        assert detok.take_delta(final=True) == expect
