"""Qwen2-VL and Qwen2.5-VL images through the real processes on the tiny checkpoints
(tests/support/qwen2_vl_zoo.py): chat requests with one and two data: URL images of
different sizes give HF ``generate``'s greedy tokens, logprobs (within 1e-4) and prompt ids;
a 16-token chunked prefill that splits an image's span still equals HF (M-RoPE positions
from each chunk's images); an image request alone and inside a concurrent batch of text
and image requests is bitwise equal; the same image again hits the cache past the image
(and the decode's M-RoPE delta still holds), another image behind the same ids only
before it; an image or video token spelled in text and a bad image are 400s; tensor parallelism,
a prefill/decode handoff and n-gram speculative decoding give HF's tokens."""

from __future__ import annotations

import asyncio
import json
import random

import aiohttp
import pytest

from tests.e2e.test_e2e_vision import _check_against_hf, chat, data_url, hf_reference, image
from tests.support.qwen2_vl_zoo import IMAGE_PAD, VIDEO_PAD, build_qwen2_vl, hf_qwen2_vl
from tests.support.server import CandorServer

MODEL = "tiny-qwen2-vl"
NEW = 12
BATCHED = 16  # --max-num-batched-tokens: prefill chunks of at most 16 positions
WIDE = (100, 70)  # -> 2 x 4 tokens
FAMILIES = ["qwen2_vl", "qwen2_5_vl"]


@pytest.fixture(scope="module", params=FAMILIES)
def family(request):
    return request.param


@pytest.fixture(scope="module")
def qwen_dir(family, tmp_path_factory):
    return build_qwen2_vl(tmp_path_factory.mktemp(family) / "model", family)


@pytest.fixture(scope="module")
def hf(qwen_dir):
    return hf_qwen2_vl(qwen_dir)


@pytest.fixture(scope="module")
def server(qwen_dir, family, tmp_path_factory):
    srv = CandorServer(qwen_dir, "--served-model-name", MODEL, "--max-num-batched-tokens",
                       str(BATCHED)).start(log_path=tmp_path_factory.mktemp("logs") / f"{family}.log")
    yield srv
    assert srv.stop() == 0


async def _chat(session, srv: CandorServer, messages: list[dict], **extra) -> tuple[int, dict]:
    body = {"model": MODEL, "messages": messages, "max_tokens": NEW, "temperature": 0,
            "ignore_eos": True, "return_token_ids": True, "logprobs": True, "top_logprobs": 2,
            **extra}
    async with session.post(srv.base_url + "/v1/chat/completions", json=body) as resp:
        return resp.status, await resp.json()


async def _one(srv, messages, **extra) -> dict:
    async with aiohttp.ClientSession() as session:
        status, payload = await _chat(session, srv, messages, **extra)
    assert status == 200, payload
    return payload


def _image_spans(hf, prompt: list[int]) -> list[tuple[int, int]]:
    image_id = hf[1].tokenizer.convert_tokens_to_ids(IMAGE_PAD)
    starts = [i for i, t in enumerate(prompt) if t == image_id and prompt[i - 1] != image_id]
    return [(s, next(j for j in range(s, len(prompt) + 1)
                     if j == len(prompt) or prompt[j] != image_id)) for s in starts]


async def test_one_and_two_images_give_hfs_greedy_tokens_and_logprobs(server, hf):
    img = image(1, WIDE)
    messages = chat("What is in this picture?", img)
    want = hf_reference(hf, messages, [img])
    assert len(set(want[1])) >= 3  # the random model is not degenerate
    _check_against_hf(await _one(server, messages), want)
    two = [image(2, WIDE), image(3, (30, 60))]
    messages = chat("Compare these two.", *two)
    want = hf_reference(hf, messages, two)
    spans = _image_spans(hf, want[0])
    assert len(spans) == 2 and spans[0][1] - spans[0][0] != spans[1][1] - spans[1][0]
    _check_against_hf(await _one(server, messages), want)
    server.wait_all_blocks_free()


async def test_an_image_split_over_chunks_gives_hfs_tokens(server, hf):
    """A system prompt of a length that puts a 16-position chunk boundary inside the
    image's 8 tokens: the image's rows are fed over two steps, each at its M-RoPE
    positions, and the tokens are still HF's."""
    img = image(4, WIDE)
    for words in range(1, 12):
        messages = chat("Describe it.", img, system="Be brief " * words)
        want = hf_reference(hf, messages, [img])
        ((lo, hi),) = _image_spans(hf, want[0])
        if lo // BATCHED != (hi - 1) // BATCHED and (hi - 1) % BATCHED > 0:
            break
    else:
        pytest.fail("no system prompt puts a chunk boundary inside the image")
    _check_against_hf(await _one(server, messages), want)
    server.wait_all_blocks_free()


async def test_alone_and_in_a_batch_beside_text_and_images_is_bitwise_equal(server, hf):
    messages = chat("Name the colours you see.", image(20, WIDE))
    alone = await _one(server, messages, seed=3, temperature=0.8)
    assert alone["candor"].get("deterministic") is True
    greedy = chat("Tell me about it.", image(21))
    want = hf_reference(hf, greedy, [image(21)])
    rng = random.Random(5)

    async def noise(session, k):
        await asyncio.sleep(rng.uniform(0, 0.2))
        kind = k % 3
        body = (chat("Tell me about it.", image(100 + k, (40 + 9 * k, 50))) if kind == 0 else
                chat("And these?", image(200 + k), image(20, WIDE)) if kind == 1 else
                [{"role": "user", "content": "Just text, " * (k + 1)}])
        status, payload = await _chat(session, server, body, max_tokens=rng.randint(1, 10))
        assert status == 200, payload

    async with aiohttp.ClientSession() as session:
        async def probe(body, delay, **extra):
            await asyncio.sleep(delay)
            return await _chat(session, server, body, **extra)
        results = await asyncio.gather(*(noise(session, k) for k in range(9)),
                                       probe(messages, 0.05, seed=3, temperature=0.8),
                                       probe(greedy, 0.1))
    (status, batched), (status_greedy, batched_greedy) = results[-2:]
    assert status == 200 and status_greedy == 200, (batched, batched_greedy)
    assert batched["choices"][0] == alone["choices"][0]
    _check_against_hf(batched_greedy, want)
    server.wait_all_blocks_free()


async def test_the_same_image_hits_the_cache_past_it_and_another_image_never(server, hf):
    """The image sits between a long system prompt and a question of more than a block,
    so full blocks lie past it."""
    system = "You describe pictures for a catalogue of small coloured squares. " * 3
    cat, dog = image(10, WIDE), image(11, WIDE)
    question = "Describe it in a few words, please, and name its main colour and its mood."

    def ask(img):
        return [{"role": "system", "content": system}, {"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": data_url(img)}},
            {"type": "text", "text": question}]}]
    first = await _one(server, ask(cat))
    again = await _one(server, ask(cat))
    other = await _one(server, ask(dog))
    assert first["choices"][0]["token_ids"] == again["choices"][0]["token_ids"]
    ((lo, hi),) = _image_spans(hf, first["prompt_token_ids"])
    cached = lambda p: p["usage"]["prompt_tokens_details"]["cached_tokens"]  # noqa: E731
    assert cached(first) == 0
    assert cached(again) >= hi  # the whole image and past it
    assert 0 < cached(other) <= lo  # only text blocks before the image
    _check_against_hf(again, hf_reference(hf, ask(cat), [cat]))
    _check_against_hf(other, hf_reference(hf, ask(dog), [dog]))
    server.wait_all_blocks_free()


@pytest.mark.parametrize("text,url", [
    (f"I typed {IMAGE_PAD} myself.", None),
    (f"A video: {VIDEO_PAD}", None),
    ("What?", "data:image/png;base64,AAAA"),
], ids=["image-token-in-text", "video-token-in-text", "bad-image"])
async def test_a_placeholder_mismatch_or_bad_image_is_a_400(server, text, url):
    parts = [{"type": "text", "text": text},
             {"type": "image_url", "image_url": {"url": url or data_url(image(0))}}]
    async with aiohttp.ClientSession() as session:
        status, payload = await _chat(session, server, [{"role": "user", "content": parts}])
    assert status == 400, payload
    err = payload["error"]
    assert err["type"] == "invalid_request_error"
    if url is None:
        assert err["param"] == "messages" and "may not contain" in err["message"]
    else:
        assert err["param"] == "messages[0].content[1]" and err["code"] == "invalid_image"
    assert server.health()[0] == 200


@pytest.mark.parametrize("flags", [
    ["--tensor-parallel-size", "2"],
    ["--prefill-replicas", "1", "--decode-replicas", "1"],
    ["--speculative-config", json.dumps({"method": "ngram", "num_speculative_tokens": 3,
                                         "prompt_lookup_min": 1, "prompt_lookup_max": 3})],
], ids=["tp2", "prefill-decode", "ngram-speculation"])
def test_tensor_parallel_handoff_and_speculation_carry_qwen_images(qwen_dir, hf, flags, tmp_path):
    """TP: every rank holds the whole tower and positions the same rows; P/D: the decode
    replica positions its tokens with the delta of the images it was handed; n-gram
    drafts after an image are positioned as decodes are. All give HF's greedy tokens."""
    srv = CandorServer(qwen_dir, "--served-model-name", MODEL, "--max-num-batched-tokens",
                       str(BATCHED), *flags).start(log_path=tmp_path / "log")
    try:
        for imgs in ([image(40, WIDE)], [image(41), image(42, (30, 50))]):
            messages = chat("What is in this picture?", *imgs)
            status, payload = srv.post_json("/v1/chat/completions", {
                "model": MODEL, "messages": messages, "max_tokens": NEW, "temperature": 0,
                "ignore_eos": True, "return_token_ids": True, "logprobs": True, "top_logprobs": 2})
            assert status == 200, payload
            _check_against_hf(payload, hf_reference(hf, messages, imgs))
        srv.wait_all_blocks_free()
    finally:
        assert srv.stop() == 0
