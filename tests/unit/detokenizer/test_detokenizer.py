"""Incremental detokenization: no broken characters in any delta, stop strings trimmed
even when they straddle tokens, and held-back text released at the end."""

from __future__ import annotations

import random
import time

import pytest
from tokenizers import Tokenizer

from detokenizer.incremental import RequestDetokenizer
from detokenizer.stops import StopMatcher
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


def test_min_tokens_holds_back_stop_strings_ending_inside_them(tokenizer):
    """vLLM's rule: a stop string counts only where it ends after the first min_tokens
    tokens' text; one that straddles that boundary still stops."""
    ids = tokenizer.encode(TEXT, add_special_tokens=False).ids
    cut = next(k for k in range(1, len(ids)) if "café" in tokenizer.decode(ids[:k]))
    deltas, detok = _run(tokenizer, TEXT, DetokParams(stop=["café"], min_tokens=cut))
    assert not detok.stopped and "".join(deltas) == TEXT
    deltas, detok = _run(tokenizer, TEXT, DetokParams(stop=["café"], min_tokens=cut - 1))
    assert detok.stopped and "".join(deltas) == "Über "
    deltas, _ = _run(tokenizer, TEXT, DetokParams(stop=["café", "emoji"], min_tokens=cut))
    assert "".join(deltas) == TEXT[:TEXT.index("emoji")]


def test_earliest_of_several_stop_strings_wins(tokenizer):
    deltas, detok = _run(tokenizer, TEXT, DetokParams(stop=["emoji", "café"]))
    assert "".join(deltas) == "Über "
    assert detok.stop_string == "café"  # which one stopped it (Anthropic's stop_sequence)


def test_no_stop_string_named_when_none_matched(tokenizer):
    _, detok = _run(tokenizer, TEXT, DetokParams(stop=["nowhere in it"]))
    assert not detok.stopped and detok.stop_string is None


def test_holdback_released_when_no_stop_matches(tokenizer):
    # the text ends with "end.", the start of this stop string: held back until final
    deltas, detok = _run(tokenizer, TEXT, DetokParams(stop=["end. And then more"]))
    assert not detok.stopped and "".join(deltas) == TEXT
    assert deltas[-1].endswith("end.")


def test_only_a_possible_stop_start_is_held_back(tokenizer):
    """Text that cannot begin a stop string streams at once, however long the stops."""
    detok = RequestDetokenizer(tokenizer, DetokParams(stop=["x" * 500, "plain wordy"]))
    sent = ""
    for token_id in tokenizer.encode(TEXT, add_special_tokens=False).ids:
        detok.add_token(token_id)
        sent += detok.take_delta(final=False)
        if detok.text.endswith("then "):
            assert sent == detok.text  # no tail starts "x..." or "plain wordy"
        if detok.text.endswith("plain word"):
            assert sent == detok.text[:-len("plain word")]  # this tail might still stop
    assert not detok.stopped
    assert sent + detok.take_delta(final=True) == TEXT


def _naive_stop(text: str, stops: list[str]) -> tuple[int, int] | None:
    """The reference: earliest start, ties to the stop listed first."""
    hits = [(text.find(s), i, s) for i, s in enumerate(stops) if s and s in text]
    if not hits:
        return None
    at, _, s = min(hits)
    return at, at + len(s)


def test_stop_matcher_agrees_with_naive_search_on_random_streams():
    rng = random.Random(7)
    for _ in range(300):
        stops = ["".join(rng.choice("abc") for _ in range(rng.randint(1, 5)))
                 for _ in range(rng.randint(1, 6))]
        pieces = ["".join(rng.choice("abcd") for _ in range(rng.randint(1, 3)))
                  for _ in range(12)]
        matcher, text, expected = StopMatcher(stops), "", None
        for piece in pieces:
            text += piece
            got = matcher.feed(text)
            expected = _naive_stop(text, stops)
            assert got == expected, (stops, text)
            if got is not None:
                break
            # nothing before hold_from can start a stop; the held tail can
            assert not any(text[i:] and any(s.startswith(text[i:]) for s in stops)
                           for i in range(matcher.hold_from))
            tail = text[matcher.hold_from:]
            assert not tail or any(s.startswith(tail) for s in stops)


def test_many_stop_strings_cost_per_token_stays_flat(tokenizer):
    """10k stop strings: a token's matching time is within a small factor of one stop's."""
    ids = tokenizer.encode(TEXT * 20, add_special_tokens=False).ids

    def per_token(stops: list[str]) -> float:
        detok = RequestDetokenizer(tokenizer, DetokParams(stop=stops))
        started = time.perf_counter()
        for token_id in ids:
            detok.add_token(token_id)
            detok.take_delta(final=False)
        assert not detok.stopped
        return (time.perf_counter() - started) / len(ids)

    many = [f"zq{i:05d} never" for i in range(10_000)]
    one, lots = min(per_token(many[:1]) for _ in range(3)), min(per_token(many) for _ in range(3))
    assert lots < 5 * one + 20e-6, (one, lots)


def test_special_tokens_skipped_or_kept(tokenizer):
    eot = tokenizer.token_to_id("<|eot_id|>")
    ids = tokenizer.encode("hi", add_special_tokens=False).ids + [eot]
    for skip, expect in ((True, "hi"), (False, "hi<|eot_id|>")):
        detok = RequestDetokenizer(tokenizer, DetokParams(skip_special_tokens=skip))
        for i in ids:
            detok.add_token(i)
        assert detok.take_delta(final=True) == expect


@pytest.mark.parametrize("include", [False, True])
def test_stopping_token_counts_but_its_text_is_left_out(tokenizer, include):
    """The id that ended the sequence (EOS, a stop_token_ids id) is consumed and counted;
    its text reaches the answer only with include_stop_str_in_output (as vLLM)."""
    ids = tokenizer.encode("plain words at the end", add_special_tokens=False).ids
    detok = RequestDetokenizer(tokenizer, DetokParams(skip_special_tokens=False,
                                                      include_stop_str_in_output=include))
    detok.add_tokens(ids[:-1])
    detok.add_tokens(ids[-1:], stopping=True)
    head = tokenizer.decode(ids[:-1])
    assert detok.num_tokens == len(ids)
    assert detok.take_delta(final=True) == (tokenizer.decode(ids) if include else head)


def test_token_bytes_keep_what_the_text_of_a_partial_character_loses(tokenizer, tmp_path):
    """Logprobs' ``bytes`` source: a token holding part of a UTF-8 character (byte-level
    BPE piece, or sentencepiece ``<0xHH>`` byte fallback) decodes alone to U+FFFD, and
    carries its own bytes beside; whole tokens carry none (their text's UTF-8 is them)."""
    from detokenizer.logprobs import TokenTexts
    from tests.support.sentencepiece_zoo import build_sentencepiece_tokenizer
    spm = Tokenizer.from_file(str(build_sentencepiece_tokenizer(tmp_path, 600)
                                  / "tokenizer.json"))
    for tok in (tokenizer, spm):
        texts = TokenTexts(tok)
        ids = tok.encode("ℵ₿", add_special_tokens=False).ids  # rare: split into bytes
        got = [texts.get(i) for i in ids]
        assert any(raw is not None for _, raw in got)
        rebuilt = b"".join(raw if raw is not None else text.encode() for text, raw in got)
        assert rebuilt.strip() == "ℵ₿".encode()
        for text, raw in got:
            assert (raw is None) == ("\ufffd" not in text)
