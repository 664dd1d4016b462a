"""Logprobs in OpenAI's two shapes, equal to HF's log-softmax, parsed by the openai SDK."""

from __future__ import annotations

import math

import openai
import pytest
import torch

MODEL = "tiny-llama"


@pytest.fixture
def client(server):
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0)


def _hf_logprobs(model, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), -1)


def _token_bytes(tok) -> dict[int, bytes]:
    """Each id's own bytes (the reference): byte-level BPE pieces mapped back through
    GPT-2's byte alphabet; added tokens are their text."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode
    byte_of = {char: byte for byte, char in bytes_to_unicode().items()}
    added = {i: t.content for i, t in tok.added_tokens_decoder.items()}
    return {i: added[i].encode() if i in added else
            bytes(byte_of[c] for c in tok.convert_ids_to_tokens(i)) for i in range(len(tok))}


def test_chat_logprobs_match_hf_and_parse(client, hf_model):
    model, tok = hf_model
    messages = [{"role": "user", "content": "Name a colour."}]
    out = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=6,
                                         temperature=0.7, seed=5, logprobs=True, top_logprobs=3,
                                         extra_body={"ignore_eos": True, "return_token_ids": True})
    choice = out.choices[0]
    content = choice.logprobs.content
    gen = choice.model_extra["token_ids"]
    assert len(content) == len(gen) == 6
    prompt = list(tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                          return_dict=False))
    ref = _hf_logprobs(model, prompt + gen)
    own = _token_bytes(tok)
    for i, entry in enumerate(content):
        row = ref[len(prompt) - 1 + i]
        assert math.isclose(entry.logprob, row[gen[i]].item(), abs_tol=1e-3)
        assert bytes(entry.bytes) == own[gen[i]]
        assert [t.logprob for t in entry.top_logprobs] == pytest.approx(
            row.topk(3).values.tolist(), abs=1e-3)
        top = row.topk(3).indices.tolist()
        assert [t.token for t in entry.top_logprobs] == [tok.decode([t]) for t in top]
        assert [bytes(t.bytes) for t in entry.top_logprobs] == [own[t] for t in top]
    assert "".join(e.token for e in content) == choice.message.content


def test_completion_logprobs_with_echo_match_hf(client, hf_model):
    model, tok = hf_model
    prompt = "Once upon a time"
    out = client.completions.create(model=MODEL, prompt=prompt, max_tokens=4, temperature=0,
                                    logprobs=2, echo=True,
                                    extra_body={"ignore_eos": True, "return_token_ids": True})
    choice = out.choices[0]
    prompt_ids = tok(prompt)["input_ids"]
    gen = choice.model_extra["token_ids"]
    ids = prompt_ids + gen
    ref = _hf_logprobs(model, ids)
    lp = choice.logprobs
    assert choice.text.startswith(prompt)
    assert len(lp.tokens) == len(ids) and lp.token_logprobs[0] is None
    for pos in range(1, len(ids)):
        assert math.isclose(lp.token_logprobs[pos], ref[pos - 1, ids[pos]].item(), abs_tol=1e-3)
        top = lp.top_logprobs[pos]
        best = ref[pos - 1].topk(2)
        assert max(top.values()) == pytest.approx(best.values[0].item(), abs=1e-3)
    assert lp.text_offset == sorted(lp.text_offset)
    no_echo = client.completions.create(model=MODEL, prompt=prompt, max_tokens=4, temperature=0,
                                        logprobs=0, extra_body={"ignore_eos": True})
    assert len(no_echo.choices[0].logprobs.tokens) == 4


@pytest.mark.parametrize("stream", [False, True])
def test_chat_logprob_bytes_are_the_tokens_own_bytes(client, hf_model, stream):
    """A token holding part of a UTF-8 character has no text of its own (``token`` is
    U+FFFD); ``bytes`` are still its real bytes, in top_logprobs too, so a client can
    rebuild the characters, as OpenAI's ``bytes`` let it (they were the UTF-8 of U+FFFD)."""
    _, tok = hf_model
    own = _token_bytes(tok)
    by_text: dict[str, set[bytes]] = {}
    for i, raw in own.items():
        by_text.setdefault(tok.decode([i]), set()).add(raw)
    text = "ñ日本ü"  # the tiny vocabulary splits these characters across tokens
    kwargs = dict(model=MODEL, messages=[{"role": "user", "content": "Say it."}],
                  max_tokens=16, temperature=0, logprobs=True, top_logprobs=20,
                  extra_body={"guided_regex": text, "return_token_ids": True})
    if stream:
        entries, ids, content = [], [], ""
        for chunk in client.chat.completions.create(stream=True, **kwargs):
            for choice in chunk.choices:
                content += choice.delta.content or ""
                ids += choice.model_extra.get("token_ids") or []
                entries += choice.logprobs.content if choice.logprobs else []
    else:
        choice = client.chat.completions.create(**kwargs).choices[0]
        entries, ids = choice.logprobs.content, choice.model_extra["token_ids"]
        content = choice.message.content
    assert content == text and len(entries) == len(ids)
    assert any("\ufffd" in e.token for e in entries), "no token splits a character"
    assert [bytes(e.bytes) for e in entries] == [own[i] for i in ids]
    texts = [(e.token, i) for e, i in zip(entries, ids) if i not in tok.all_special_ids]
    assert b"".join(own[i] for _, i in texts) == text.encode()
    tops = [t for e in entries for t in e.top_logprobs]
    assert any("\ufffd" in t.token for t in tops), "no alternative splits a character"
    for t in tops:
        assert bytes(t.bytes) in by_text[t.token], (t.token, t.bytes)


def test_streamed_chat_logprobs(client):
    chunks = list(client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=5, temperature=0,
        logprobs=True, top_logprobs=1, stream=True, extra_body={"ignore_eos": True}))
    entries = [e for c in chunks if c.choices and c.choices[0].logprobs
               for e in c.choices[0].logprobs.content]
    assert len(entries) == 5 and all(len(e.top_logprobs) == 1 for e in entries)


def test_logprobs_validation(client):
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}],
                                       top_logprobs=2)
    assert err.value.body["param"] == "top_logprobs"
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}],
                                       logprobs=True, top_logprobs=21)
    assert err.value.body["param"] == "top_logprobs"
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model=MODEL, prompt="x", logprobs=21)  # max_logprobs 20
    assert err.value.body["param"] == "logprobs"


_LONG_PROMPT = ("Prompt logprobs score every token of a prompt, which is how evaluation "
                "harnesses compute loglikelihoods; a prefix-cache hit must not shorten them. ") * 2


def _check_prompt_entry(entry: dict, token_id: int, row: torch.Tensor, k: int, tok) -> None:
    """One vLLM-shaped prompt_logprobs entry against HF's log-softmax row."""
    own = entry[str(token_id)]
    assert math.isclose(own["logprob"], row[token_id].item(), abs_tol=1e-3)
    # the rank HF's row gives, up to tokens within float noise of this one (the engine's
    # batch-invariant kernels sum in another order than HF's: a near-tie may swap)
    target = row[token_id].item()
    surely_above = int((row > target + 1e-5).sum())
    maybe_tied = int((row >= target - 1e-5).sum())
    assert surely_above + 1 <= own["rank"] <= maybe_tied, (own, surely_above, maybe_tied)
    assert own["decoded_token"] == tok.decode([token_id])
    best = row.topk(k)
    for r, (i, v) in enumerate(zip(best.indices.tolist(), best.values.tolist()), start=1):
        assert math.isclose(entry[str(i)]["logprob"], v, abs_tol=1e-3)
        if i != token_id:
            assert entry[str(i)]["rank"] == r
    assert len(entry) in (k, k + 1)


def test_echo_logprobs_are_whole_on_a_prefix_cache_hit(client, hf_model):
    model, tok = hf_model
    prompt_ids = tok(_LONG_PROMPT)["input_ids"]
    assert len(prompt_ids) > 40  # several full KV blocks: the second request could hit them
    outs = [client.completions.create(model=MODEL, prompt=_LONG_PROMPT, max_tokens=3,
                                      temperature=0, logprobs=1, echo=True,
                                      extra_body={"ignore_eos": True})
            for _ in range(2)]
    ref = _hf_logprobs(model, prompt_ids)
    for out in outs:
        lp = out.choices[0].logprobs
        assert len(lp.tokens) == len(prompt_ids) + 3
        assert lp.token_logprobs[0] is None
        for pos in range(1, len(prompt_ids)):
            assert math.isclose(lp.token_logprobs[pos], ref[pos - 1, prompt_ids[pos]].item(),
                                abs_tol=1e-3)
    assert outs[0].choices[0].logprobs == outs[1].choices[0].logprobs
    # the request that needs every prompt position computes them: no hit reported
    assert outs[1].usage.prompt_tokens_details.cached_tokens == 0


def test_prompt_logprobs_extension_on_completions_matches_hf(client, hf_model):
    model, tok = hf_model
    prompt_ids = tok(_LONG_PROMPT)["input_ids"]
    ref = _hf_logprobs(model, prompt_ids)
    bodies = [client.completions.create(model=MODEL, prompt=_LONG_PROMPT, max_tokens=2,
                                        temperature=0, extra_body={"prompt_logprobs": 3})
              .choices[0].model_extra["prompt_logprobs"] for _ in range(2)]
    assert bodies[0] == bodies[1]
    entries = bodies[0]
    assert len(entries) == len(prompt_ids) and entries[0] is None
    for pos in range(1, len(prompt_ids)):
        _check_prompt_entry(entries[pos], prompt_ids[pos], ref[pos - 1], 3, tok)


def test_prompt_logprobs_extension_on_chat_is_top_level(client, hf_model):
    model, tok = hf_model
    messages = [{"role": "user", "content": _LONG_PROMPT}]
    prompt_ids = list(tok.apply_chat_template(messages, add_generation_prompt=True,
                                              tokenize=True, return_dict=False))
    ref = _hf_logprobs(model, prompt_ids)
    outs = [client.chat.completions.create(model=MODEL, messages=messages, max_tokens=2,
                                           temperature=0, extra_body={"prompt_logprobs": 0})
            for _ in range(2)]
    entries = outs[0].model_extra["prompt_logprobs"]
    assert entries == outs[1].model_extra["prompt_logprobs"]
    assert len(entries) == len(prompt_ids) and entries[0] is None
    assert "prompt_logprobs" not in outs[0].choices[0].model_extra
    for pos in range(1, len(prompt_ids)):
        assert list(entries[pos]) == [str(prompt_ids[pos])]
        _check_prompt_entry(entries[pos], prompt_ids[pos], ref[pos - 1], 0, tok)
    assert "prompt_logprobs" in outs[0].model_extra["candor"]["extensions"]


def test_prompt_logprobs_validation(client):
    for body, stream in (({"prompt_logprobs": 21}, False), ({"prompt_logprobs": -1}, False),
                         ({"prompt_logprobs": 1}, True)):
        with pytest.raises(openai.BadRequestError) as err:
            client.completions.create(model=MODEL, prompt="x", max_tokens=1, stream=stream,
                                      extra_body=body)
        assert err.value.body["param"] == "prompt_logprobs", err.value.body
        with pytest.raises(openai.BadRequestError) as err:
            client.chat.completions.create(model=MODEL, max_tokens=1, stream=stream,
                                           messages=[{"role": "user", "content": "x"}],
                                           extra_body=body)
        assert err.value.body["param"] == "prompt_logprobs", err.value.body


@pytest.mark.parametrize("prompt", ["Once upon a time", "Zürich – a café"])
def test_echo_text_offsets_index_the_returned_text_whole_and_streamed(client, prompt):
    """`text_offset[i]` is where token i starts in the choice's `text`: the BOS the tokenizer
    adds is not in the echoed prompt, so it has no width (the offsets used to count its
    text, ending past the end); the streamed chunks concatenate to the whole answer."""
    kwargs = dict(model=MODEL, prompt=prompt, max_tokens=5, temperature=0, logprobs=1,
                  echo=True, extra_body={"ignore_eos": True})
    choice = client.completions.create(**kwargs).choices[0]
    text, lp = choice.text, choice.logprobs
    assert text.startswith(prompt)
    assert lp.text_offset == sorted(lp.text_offset) and lp.text_offset[-1] <= len(text)
    n_prompt = len(lp.tokens) - 5
    assert lp.text_offset[0] == 0 and lp.text_offset[n_prompt] == len(prompt)
    covered = "".join(text[a:b] for a, b in zip(lp.text_offset[:n_prompt],
                                                  lp.text_offset[1:n_prompt + 1]))
    assert covered == prompt
    for token, at in zip(lp.tokens[1:n_prompt], lp.text_offset[1:n_prompt]):
        assert "\ufffd" in token or text.startswith(token, at), (token, at)
    s_text, s_tokens, s_offsets = "", [], []
    for chunk in client.completions.create(stream=True, **kwargs):
        for c in chunk.choices:
            s_text += c.text
            if c.logprobs:
                s_tokens += c.logprobs.tokens
                s_offsets += c.logprobs.text_offset
    assert (s_text, s_tokens, s_offsets) == (text, lp.tokens, lp.text_offset)
