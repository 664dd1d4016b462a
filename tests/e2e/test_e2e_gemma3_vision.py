"""Gemma 3 images through the real processes on the tiny Gemma3ForConditionalGeneration
(tests/support/gemma3_vision_zoo.py): chat requests with one and two data: URL images give
HF ``generate``'s greedy tokens, logprobs (within 1e-4) and prompt ids; an image that a
16-token chunked prefill would split is computed in one chunk (and still equals HF); an
image request alone and inside a concurrent batch of text and image requests is bitwise
equal; the same image again hits the cache past the image, another image behind the same
ids only before it; a marker spelled in text and a bad image are 400s; a checkpoint with
pan-and-scan on gives HF's tokens for images it crops and images it does not."""

from __future__ import annotations

import asyncio
import random

import aiohttp
import pytest

from tests.e2e.test_e2e_vision import _check_against_hf, chat, data_url, hf_reference, image
from tests.support.gemma3_vision_zoo import BOI, IMAGE_TOKEN, MM_TOKENS, build_gemma3_vision, hf_gemma3
from tests.support.server import CandorServer

MODEL = "tiny-gemma3"
NEW = 12
BATCHED = 16  # --max-num-batched-tokens: prefill chunks of at most 16 positions


@pytest.fixture(scope="module")
def gemma3_dir(tmp_path_factory):
    return build_gemma3_vision(tmp_path_factory.mktemp("gemma3") / "model")


@pytest.fixture(scope="module")
def hf(gemma3_dir):
    return hf_gemma3(gemma3_dir)


@pytest.fixture(scope="module")
def server(gemma3_dir, tmp_path_factory):
    srv = CandorServer(gemma3_dir, "--served-model-name", MODEL, "--max-num-batched-tokens",
                       str(BATCHED)).start(log_path=tmp_path_factory.mktemp("logs") / "gemma3.log")
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


def _image_starts(hf, prompt: list[int]) -> list[int]:
    image_id = hf[1].tokenizer.convert_tokens_to_ids(IMAGE_TOKEN)
    return [i for i, t in enumerate(prompt) if t == image_id and prompt[i - 1] != image_id]


async def test_one_and_two_images_give_hfs_greedy_tokens_and_logprobs(server, hf):
    img = image(1)
    messages = chat("What is in this picture?", img)
    want = hf_reference(hf, messages, [img])
    assert len(set(want[1])) >= 3  # the random model is not degenerate
    _check_against_hf(await _one(server, messages), want)
    two = [image(2), image(3, (30, 60))]
    messages = chat("Compare these two.", *two)
    want = hf_reference(hf, messages, two)
    assert len(_image_starts(hf, want[0])) == 2
    _check_against_hf(await _one(server, messages), want)
    server.wait_all_blocks_free()


async def test_an_image_a_chunk_would_split_is_computed_whole(server, hf):
    """A system prompt of a length that puts a 16-position chunk boundary inside the
    image's 4 tokens: the chunk stops before the image, the next holds all of it, and the
    tokens are still HF's (a split image would attend half of itself)."""
    img = image(4)
    for words in range(1, 12):
        messages = chat("Describe it.", img, system="Be brief " * words)
        want = hf_reference(hf, messages, [img])
        (at,) = _image_starts(hf, want[0])
        if at // BATCHED != (at + MM_TOKENS - 1) // BATCHED and len(want[0]) > 2 * BATCHED:
            break
    else:
        pytest.fail("no system prompt puts a chunk boundary inside the image")
    _check_against_hf(await _one(server, messages), want)
    server.wait_all_blocks_free()


async def test_alone_and_in_a_batch_beside_text_and_images_is_bitwise_equal(server, hf):
    messages = chat("Name the colours you see.", image(20))
    alone = await _one(server, messages, seed=3, temperature=0.8)
    assert alone["candor"].get("deterministic") is True
    greedy = chat("Tell me about it.", image(21))
    want = hf_reference(hf, greedy, [image(21)])
    rng = random.Random(5)

    async def noise(session, k):
        await asyncio.sleep(rng.uniform(0, 0.2))
        kind = k % 3
        body = (chat("Tell me about it.", image(100 + k)) if kind == 0 else
                chat("And these?", image(200 + k), image(20)) if kind == 1 else
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
    system = "You describe pictures for a catalogue of small coloured squares. " * 3
    cat, dog = image(10), image(11)
    first = await _one(server, chat("Describe it in a few words, please.", cat, system=system))
    again = await _one(server, chat("Describe it in a few words, please.", cat, system=system))
    other = await _one(server, chat("Describe it in a few words, please.", dog, system=system))
    assert first["choices"][0]["token_ids"] == again["choices"][0]["token_ids"]
    (at,) = _image_starts(hf, first["prompt_token_ids"])
    cached = lambda p: p["usage"]["prompt_tokens_details"]["cached_tokens"]  # noqa: E731
    assert cached(first) == 0
    assert cached(again) >= at + MM_TOKENS  # the whole image and past it
    assert 0 < cached(other) <= at  # only text blocks before the image
    messages = chat("Describe it in a few words, please.", dog, system=system)
    _check_against_hf(other, hf_reference(hf, messages, [dog]))
    server.wait_all_blocks_free()


@pytest.mark.parametrize("text,url", [
    (f"I typed {BOI} myself.", None),
    (f"I typed {IMAGE_TOKEN} myself.", None),
    ("What?", "data:image/png;base64,AAAA"),
], ids=["boi-in-text", "image-token-in-text", "bad-image"])
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


PAS_MIN_CROP = 28  # (the default, 256, crops no image of this tiny model's size)


def test_pan_and_scan_crops_give_hfs_greedy_tokens(tmp_path):
    """A checkpoint whose image processor sets ``do_pan_and_scan`` (min crop size 28, the
    other settings Gemma3Processor's defaults: at most 4 crops, from an aspect ratio of 1.2):
    a wide image (3 crops), a wider one (capped at 4), a tall one (3), a square one (none)
    and a wide and a square one together each give HF's prompt ids, greedy tokens and
    logprobs, HF's processor called with the same pan-and-scan settings (its call, not its
    saved image-processor config, decides them: see docs/api.md)."""
    path = build_gemma3_vision(tmp_path / "pas", do_pan_and_scan=True,
                               pan_and_scan_min_crop_size=PAS_MIN_CROP)
    hf = hf_gemma3(path)
    srv = CandorServer(path, "--served-model-name", MODEL, "--max-num-batched-tokens",
                       str(BATCHED)).start(log_path=tmp_path / "log")
    try:
        for imgs, crops in (([image(70, (140, 56))], 3), ([image(71, (300, 56))], 4),
                            ([image(72, (50, 130))], 3), ([image(73, (56, 56))], 0),
                            ([image(74, (140, 56)), image(75, (56, 56))], 3)):
            messages = chat("What is in this picture?", *imgs)
            want = hf_reference(hf, messages, imgs, do_pan_and_scan=True,
                                pan_and_scan_min_crop_size=PAS_MIN_CROP)
            assert len(_image_starts(hf, want[0])) == len(imgs) + crops
            said = hf[1].tokenizer.decode(want[0]).count("here are some crops to help you see better")
            assert said == (1 if crops else 0)
            status, payload = srv.post_json("/v1/chat/completions", {
                "model": MODEL, "messages": messages, "max_tokens": NEW, "temperature": 0,
                "ignore_eos": True, "return_token_ids": True, "logprobs": True, "top_logprobs": 2})
            assert status == 200, payload
            _check_against_hf(payload, want)
        srv.wait_all_blocks_free()
    finally:
        assert srv.stop() == 0


@pytest.mark.parametrize("flags", [["--tensor-parallel-size", "2"],
                                   ["--prefill-replicas", "1", "--decode-replicas", "1"]],
                         ids=["tp2", "prefill-decode"])
def test_tensor_parallel_and_prefill_decode_carry_gemma3_images(gemma3_dir, hf, flags, tmp_path):
    """TP: every rank holds the whole tower and attends the same image spans over its
    heads; P/D: the prefill replica computes the prompt (images whole in their chunks) and
    hands the KV over. Both give HF's greedy tokens."""
    srv = CandorServer(gemma3_dir, "--served-model-name", MODEL, "--max-num-batched-tokens",
                       str(BATCHED), *flags).start(log_path=tmp_path / "log")
    try:
        for imgs in ([image(40)], [image(41), image(42, (30, 50))]):
            messages = chat("What is in this picture?", *imgs)
            status, payload = srv.post_json("/v1/chat/completions", {
                "model": MODEL, "messages": messages, "max_tokens": NEW, "temperature": 0,
                "ignore_eos": True, "return_token_ids": True, "logprobs": True, "top_logprobs": 2})
            assert status == 200, payload
            _check_against_hf(payload, hf_reference(hf, messages, imgs))
        srv.wait_all_blocks_free()
    finally:
        assert srv.stop() == 0
