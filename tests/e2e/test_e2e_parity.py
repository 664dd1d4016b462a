"""Greedy output through the full five-process server equals HF transformers, token for
token, for 8 prompts of different lengths sent concurrently."""

from __future__ import annotations

import asyncio

import aiohttp
import torch

MAX_NEW = 24

_SENTENCE = ("Candor serves language models over an OpenAI compatible API and reports what "
             "it did with every field. ")
PROMPTS = [
    "Hi",
    "The quick brown fox",
    "def fibonacci(n):\n    if n < 2:\n        return n\n",
    "Über café naïve résumé — 中文 🙂 mixed text",
    _SENTENCE * 2,
    _SENTENCE * 5,
    "Once upon a time, " * 20,
    _SENTENCE * 12,   # several hundred tokens: crosses chunk and block boundaries
]


def _hf_greedy(model, ids: list[int]) -> list[int]:
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                             max_new_tokens=MAX_NEW, do_sample=False)
    return out[0, len(ids):].tolist()


async def _complete(session: aiohttp.ClientSession, url: str, body: dict) -> dict:
    async with session.post(url, json=body) as resp:
        assert resp.status == 200, await resp.text()
        return await resp.json()


async def test_concurrent_greedy_completions_match_hf(server, hf_model):
    model, tok = hf_model
    async with aiohttp.ClientSession() as session:
        results = await asyncio.gather(*[
            _complete(session, server.base_url + "/v1/completions",
                      {"model": "tiny-llama", "prompt": p, "max_tokens": MAX_NEW,
                       "temperature": 0, "return_token_ids": True}) for p in PROMPTS])
    lengths = set()
    for prompt, result in zip(PROMPTS, results):
        ids = tok(prompt)["input_ids"]
        lengths.add(len(ids))
        assert result["prompt_token_ids"] == ids
        choice = result["choices"][0]
        assert choice["token_ids"] == _hf_greedy(model, ids), prompt
        assert result["usage"]["completion_tokens"] == len(choice["token_ids"])
        assert result["usage"]["prompt_tokens"] == len(ids)
    assert len(lengths) == len(PROMPTS) and max(lengths) > 200
    server.wait_all_blocks_free()


async def test_chat_greedy_matches_hf_with_the_checkpoint_template(server, hf_model):
    model, tok = hf_model
    messages = [{"role": "system", "content": "You are terse."},
                {"role": "user", "content": "Name three colours."}]
    async with aiohttp.ClientSession() as session:
        result = await _complete(session, server.base_url + "/v1/chat/completions",
                                 {"model": "tiny-llama", "messages": messages,
                                  "max_tokens": MAX_NEW, "temperature": 0,
                                  "return_token_ids": True})
    ids = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                  return_dict=False)
    assert result["prompt_token_ids"] == list(ids)
    assert result["choices"][0]["token_ids"] == _hf_greedy(model, list(ids))
