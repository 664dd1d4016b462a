"""Every sampling field honoured for real, through the running server (shared fixture)."""

from __future__ import annotations

import asyncio

import aiohttp
import pytest
import torch

MODEL = "tiny-llama"
PROMPT = "The quick brown fox"


async def _complete(server, body: dict, status: int = 200) -> dict:
    async with aiohttp.ClientSession() as session:
        async with session.post(server.base_url + "/v1/completions",
                                json={"model": MODEL, "prompt": PROMPT, **body}) as resp:
            payload = await resp.json()
            assert resp.status == status, payload
            return payload


def _ids(body: dict, i: int = 0) -> list[int]:
    return body["choices"][i]["token_ids"]


def _hf_penalized_greedy(model, prompt_ids, n, presence=0.0, frequency=0.0, repetition=1.0):
    """Reference: greedy decoding with penalties applied by hand on HF logits."""
    ids = list(prompt_ids)
    with torch.no_grad():
        for _ in range(n):
            logits = model(torch.tensor([ids])).logits[0, -1].float()
            for t in set(ids):
                x = logits[t]
                logits[t] = x / repetition if x > 0 else x * repetition
            gen = ids[len(prompt_ids):]
            for t in set(gen):
                logits[t] -= frequency * gen.count(t) + presence
            ids.append(int(logits.argmax()))
    return ids[len(prompt_ids):]


@pytest.mark.parametrize("penalties", [
    {"frequency_penalty": 1.5},
    {"presence_penalty": 2.0},
    {"repetition_penalty": 1.8},
    {"presence_penalty": -0.5, "frequency_penalty": 0.7, "repetition_penalty": 1.3},
])
async def test_penalties_match_hf_reference(server, hf_model, penalties):
    model, tok = hf_model
    body = await _complete(server, {"max_tokens": 16, "temperature": 0, "ignore_eos": True,
                                    "return_token_ids": True, **penalties})
    plain = await _complete(server, {"max_tokens": 16, "temperature": 0, "ignore_eos": True,
                                     "return_token_ids": True})
    expected = _hf_penalized_greedy(model, tok(PROMPT)["input_ids"], 16,
                                    penalties.get("presence_penalty", 0.0),
                                    penalties.get("frequency_penalty", 0.0),
                                    penalties.get("repetition_penalty", 1.0))
    assert _ids(body) == expected
    assert _ids(body) != _ids(plain)  # the field changed something


async def test_logit_bias_forces_and_bans_tokens(server):
    forced = await _complete(server, {"max_tokens": 6, "temperature": 1.0, "ignore_eos": True,
                                      "return_token_ids": True, "logit_bias": {"300": 100}})
    assert _ids(forced) == [300] * 6
    plain = await _complete(server, {"max_tokens": 6, "temperature": 0, "ignore_eos": True,
                                     "return_token_ids": True})
    banned = await _complete(server, {"max_tokens": 6, "temperature": 0, "ignore_eos": True,
                                      "return_token_ids": True,
                                      "logit_bias": {str(t): -100 for t in set(_ids(plain))}})
    assert not set(_ids(banned)) & set(_ids(plain))


@pytest.mark.parametrize("bias, message", [({"999999": 1}, "outside the vocabulary"),
                                           ({"abc": 1}, "token ids"),
                                           ({"5": 101}, "")])
async def test_logit_bias_errors_name_the_field(server, bias, message):
    body = await _complete(server, {"max_tokens": 2, "logit_bias": bias}, status=400)
    assert body["error"]["param"].startswith("logit_bias") and message in body["error"]["message"]


async def test_top_k_1_and_min_p_1_are_greedy(server):
    greedy = await _complete(server, {"max_tokens": 10, "temperature": 0, "ignore_eos": True,
                                      "return_token_ids": True})
    for extra in ({"top_k": 1}, {"min_p": 1.0}):
        body = await _complete(server, {"max_tokens": 10, "temperature": 1.5, "ignore_eos": True,
                                        "return_token_ids": True, **extra})
        assert _ids(body) == _ids(greedy), extra


async def test_stop_token_ids_min_tokens_and_ignore_eos(server, hf_model):
    _, tok = hf_model
    greedy = await _complete(server, {"max_tokens": 8, "temperature": 0, "ignore_eos": True,
                                      "return_token_ids": True})
    first = _ids(greedy)[0]
    stopped = await _complete(server, {"max_tokens": 8, "temperature": 0, "return_token_ids": True,
                                       "stop_token_ids": [first]})
    assert _ids(stopped) == [first] and stopped["choices"][0]["finish_reason"] == "stop"
    held = await _complete(server, {"max_tokens": 8, "temperature": 0, "return_token_ids": True,
                                    "stop_token_ids": [first], "min_tokens": 4})
    assert len(_ids(held)) >= 4 and first not in _ids(held)[:4]
    eos = tok.eos_token_id
    to_eos = await _complete(server, {"max_tokens": 5, "temperature": 0, "return_token_ids": True,
                                      "logit_bias": {str(eos): 100}})
    assert to_eos["choices"][0]["finish_reason"] == "stop" and len(_ids(to_eos)) == 1
    ignoring = await _complete(server, {"max_tokens": 5, "temperature": 0, "return_token_ids": True,
                                        "logit_bias": {str(eos): 100}, "ignore_eos": True})
    assert ignoring["choices"][0]["finish_reason"] == "length" and _ids(ignoring) == [eos] * 5


async def test_stop_string_include_stop_str_in_output(server):
    full = (await _complete(server, {"max_tokens": 16, "temperature": 0, "ignore_eos": True}))
    text = full["choices"][0]["text"]
    stop = text[4:7]
    kept = await _complete(server, {"max_tokens": 16, "temperature": 0, "ignore_eos": True,
                                    "stop": [stop, "zzzz"], "include_stop_str_in_output": True})
    assert kept["choices"][0]["text"] == text[:text.index(stop) + len(stop)]


async def test_min_tokens_holds_back_stop_strings(server):
    """A stop string inside the first min_tokens tokens does not end the request (as in
    vLLM, min_tokens holds back every stop condition)."""
    full = await _complete(server, {"max_tokens": 12, "temperature": 0, "ignore_eos": True,
                                    "return_token_ids": True})
    text = full["choices"][0]["text"]
    stop = text[1:3]
    early = await _complete(server, {"max_tokens": 12, "temperature": 0, "ignore_eos": True,
                                     "stop": [stop]})
    assert early["choices"][0]["finish_reason"] == "stop", "the stop string must occur early"
    assert early["usage"]["completion_tokens"] < 6
    held = await _complete(server, {"max_tokens": 12, "temperature": 0, "ignore_eos": True,
                                    "stop": [stop], "min_tokens": 6, "return_token_ids": True})
    assert _ids(held)[:6] == _ids(full)[:6] and len(_ids(held)) >= 6
    assert held["choices"][0]["text"].startswith(text[:3])


async def test_seed_gives_same_tokens_alone_and_in_a_busy_batch(server):
    seeded = {"max_tokens": 12, "temperature": 1.0, "seed": 1234, "ignore_eos": True,
              "return_token_ids": True}
    alone = _ids(await _complete(server, seeded))
    others = [{"max_tokens": 12 + i, "temperature": 0.9, "ignore_eos": True, "prompt": f"noise {i}",
               "seed": i if i % 2 else None} for i in range(16)]
    results = await asyncio.gather(_complete(server, seeded),
                                   *[_complete(server, o) for o in others])
    assert _ids(results[0]) == alone
    server.wait_all_blocks_free()


async def test_n_choices_sampled_and_greedy(server):
    body = await _complete(server, {"max_tokens": 8, "temperature": 1.0, "seed": 7, "n": 3,
                                    "ignore_eos": True, "return_token_ids": True})
    assert [c["index"] for c in body["choices"]] == [0, 1, 2]
    assert len({tuple(_ids(body, i)) for i in range(3)}) > 1
    assert body["usage"]["completion_tokens"] == 24
    again = await _complete(server, {"max_tokens": 8, "temperature": 1.0, "seed": 7, "n": 3,
                                     "ignore_eos": True, "return_token_ids": True})
    assert [_ids(again, i) for i in range(3)] == [_ids(body, i) for i in range(3)]
    greedy = await _complete(server, {"max_tokens": 8, "temperature": 0, "n": 4,
                                      "ignore_eos": True, "return_token_ids": True})
    assert len(greedy["choices"]) == 4
    assert len({tuple(_ids(greedy, i)) for i in range(4)}) == 1
    server.wait_all_blocks_free()


async def test_max_completion_tokens_wins(server):
    async with aiohttp.ClientSession() as session:
        async with session.post(server.base_url + "/v1/chat/completions", json={
                "model": MODEL, "messages": [{"role": "user", "content": "hi"}], "temperature": 0,
                "ignore_eos": True, "max_tokens": 9, "max_completion_tokens": 3}) as resp:
            body = await resp.json()
    assert body["usage"]["completion_tokens"] == 3
