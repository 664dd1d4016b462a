"""/v1/embeddings through the real processes (``--runner pooling``), against
sentence-transformers on the same checkpoint: a tiny decoder saved by
sentence-transformers itself (``modules.json``, ``1_Pooling/config.json``: mean pooling,
``Normalize``) that declares Matryoshka sizes. Prefill chunks are kept small so a long
input's mean is accumulated across several scheduler steps."""

from __future__ import annotations

import asyncio
import base64
import json

import aiohttp
import numpy as np
import pytest

from tests.support.server import CandorServer
from tests.support.faults import slow_env

pytest.importorskip("sentence_transformers")

from tests.support.embedding_zoo import build_embedding_model, st_encode  # noqa: E402

MODEL = "tiny-embed"
MATRYOSHKA = [16, 32]
TEXTS = ["The quick brown fox jumps over the lazy dog.",
         "hi",
         "Embeddings map text to vectors, " * 4,
         "A much longer passage, so that it spans several prefill chunks and blocks: " * 6]


@pytest.fixture(scope="module")
def st_model(tiny_model_dir, tmp_path_factory):
    return build_embedding_model(tmp_path_factory.mktemp("embed") / "st-mean", tiny_model_dir,
                                 pooling="mean", matryoshka_dimensions=MATRYOSHKA)


@pytest.fixture(scope="module")
def embed_server(st_model):
    # steps slowed a little: a loaded box's tokenizer worker can hand inputs over one per
    # step otherwise, and the batching test would measure the box, not the scheduler
    srv = CandorServer(st_model, "--served-model-name", MODEL, "--runner", "pooling",
                       "--max-num-batched-tokens", "48", env=slow_env(0.1)).start()
    yield srv
    assert srv.stop() == 0


@pytest.fixture(scope="module")
def tokenizer(st_model):
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(st_model)


def _cos(a, b) -> float:
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    return float(a @ b / (np.linalg.norm(a) * np.linalg.norm(b)))


def _close(got, ref) -> None:
    assert len(got) == len(ref)
    assert _cos(got, ref) >= 0.99999
    np.testing.assert_allclose(np.asarray(got, dtype=np.float32), ref, atol=1e-4)


async def _post(server, body: dict, path: str = "/v1/embeddings") -> tuple[int, dict, dict]:
    async with aiohttp.ClientSession() as session, session.post(
            server.base_url + path, json=body) as resp:
        return resp.status, await resp.json(), dict(resp.headers)


def _error(status: int, payload: dict, want_status: int, param: str | None, code: str) -> str:
    assert status == want_status, payload
    err = payload["error"]
    assert set(err) == {"message", "type", "param", "code"}, err
    assert (err["param"], err["code"]) == (param, code), err
    return err["message"]


def test_input_forms_match_sentence_transformers_through_the_sdk(embed_server, st_model,
                                                                 tokenizer):
    """A string, a list of strings, token ids and lists of token ids, in the SDK's default
    encoding (base64) and in float: each vector equals sentence-transformers'."""
    from openai import OpenAI

    client = OpenAI(base_url=embed_server.base_url + "/v1", api_key="x")
    reference = st_encode(st_model, TEXTS)
    ids = [tokenizer(t)["input_ids"] for t in TEXTS]

    one = client.embeddings.create(model=MODEL, input=TEXTS[0])  # base64 on the wire
    assert one.model == MODEL and len(one.data) == 1
    _close(one.data[0].embedding, reference[0])
    assert one.usage.prompt_tokens == one.usage.total_tokens == len(ids[0])

    many = client.embeddings.create(model=MODEL, input=TEXTS, encoding_format="float")
    assert [d.index for d in many.data] == list(range(len(TEXTS)))
    for got, ref in zip(many.data, reference):
        _close(got.embedding, ref)
    assert many.usage.prompt_tokens == sum(map(len, ids))

    as_ids = client.embeddings.create(model=MODEL, input=ids[2])
    _close(as_ids.data[0].embedding, reference[2])
    assert as_ids.usage.prompt_tokens == len(ids[2])
    lists = client.embeddings.create(model=MODEL, input=ids, encoding_format="float")
    for got, ref in zip(lists.data, reference):
        _close(got.embedding, ref)


async def test_base64_is_little_endian_float32_of_the_float_vector(embed_server):
    body = {"model": MODEL, "input": TEXTS[:2]}
    s1, floats, _ = await _post(embed_server, {**body, "encoding_format": "float"})
    s2, packed, _ = await _post(embed_server, {**body, "encoding_format": "base64"})
    assert s1 == s2 == 200
    for f, b in zip(floats["data"], packed["data"]):
        decoded = np.frombuffer(base64.b64decode(b["embedding"]), dtype="<f4")
        # two requests: their chunks may fall into steps differently (float rounding)
        np.testing.assert_allclose(decoded, f["embedding"], atol=1e-6)
        assert abs(np.linalg.norm(decoded) - 1.0) < 1e-5  # the Normalize module


async def test_dimensions_only_where_the_model_declares_matryoshka(embed_server, st_model):
    """Declared sizes: the vector is cut, then normalised (as sentence-transformers'
    truncate_dim with normalisation); any other size is a 400 naming the sizes. (A model
    that declares none: tests/e2e/test_multi_model.py.)"""
    reference = st_encode(st_model, TEXTS, truncate_dim=16, normalize_embeddings=True)
    status, body, _ = await _post(embed_server, {"model": MODEL, "input": TEXTS,
                                                 "dimensions": 16})
    assert status == 200, body
    for got, ref in zip(body["data"], reference):
        assert len(got["embedding"]) == 16
        assert abs(np.linalg.norm(got["embedding"]) - 1.0) < 1e-5
        _close(got["embedding"], ref)
    status, body, _ = await _post(embed_server, {"model": MODEL, "input": "x",
                                                 "dimensions": 20})
    assert "[16, 32]" in _error(status, body, 400, "dimensions", "unsupported_value")
    status, body, _ = await _post(embed_server, {"model": MODEL, "input": "x",
                                                 "dimensions": 0})
    assert status == 400 and body["error"]["param"] == "dimensions", body


async def test_bad_inputs_are_400s_naming_the_index(embed_server):
    cases = [
        ({"input": ""}, "input", "invalid_value"),
        ({"input": []}, "input", "invalid_value"),
        ({"input": ["fine", ""]}, "input[1]", "invalid_value"),
        ({"input": ["fine", 5]}, "input[1]", "invalid_value"),
        ({"input": [[1, 2], [3, 99999]]}, "input[1]", "invalid_token_id"),
        ({"input": [[1, 2], list(range(600))]}, "input[1]", "context_length_exceeded"),
        ({"input": ["fine", "word " * 700]}, "input[1]", "context_length_exceeded"),
        ({"input": "x", "priority": 3}, "priority", "unsupported_field"),
        ({"input": ["x"] * 2049}, "input", "limit_exceeded"),
    ]
    for extra, param, code in cases:
        status, body, _ = await _post(embed_server, {"model": MODEL, **extra})
        _error(status, body, 400, param, code)
    status, body, _ = await _post(embed_server, {"model": MODEL, "input": "x",
                                                 "encoding_format": "int8"})
    assert status == 400 and body["error"]["param"] == "encoding_format", body
    status, body, _ = await _post(embed_server, {"model": "nope", "input": "x"})
    assert MODEL in _error(status, body, 404, "model", "model_not_found")
    # the other inputs of a failed request are not left holding KV blocks
    embed_server.wait_all_blocks_free(timeout=30)
    status, body, _ = await _post(embed_server, {"model": MODEL, "input": "still fine"})
    assert status == 200, body


async def test_report_usage_and_strict(embed_server, tokenizer):
    status, body, headers = await _post(embed_server, {
        "model": MODEL, "input": ["hello world", "two"], "user": "u-1", "made_up": 1,
        "priority": 0})
    assert status == 200, body
    assert {n["field"] for n in body["candor"]["ignored"]} == {"user", "made_up"}
    assert json.loads(headers["x-candor-adjustments"]) == body["candor"]
    want = len(tokenizer("hello world")["input_ids"]) + len(tokenizer("two")["input_ids"])
    assert body["usage"] == {"prompt_tokens": want, "total_tokens": want}
    # vLLM's add_special_tokens: without the BOS the tokenizer adds
    status, plain, _ = await _post(embed_server, {"model": MODEL, "input": "hello world",
                                                  "add_special_tokens": False})
    assert status == 200, plain
    assert plain["usage"]["prompt_tokens"] == len(
        tokenizer("hello world", add_special_tokens=False)["input_ids"])
    status, body, _ = await _post(embed_server, {"model": MODEL, "input": "x", "user": "u",
                                                 "strict": True})
    assert status == 400 and body["error"]["param"] == "user", body
    # vLLM's fields Candor does not build: a 400 naming them, a harmless value reported
    for field, value in (("truncate_prompt_tokens", 4), ("normalize", False),
                         ("embed_dtype", "bfloat16")):
        status, body, _ = await _post(embed_server, {"model": MODEL, "input": "x",
                                                     field: value})
        assert status == 400 and body["error"]["param"] == field, body
    status, body, _ = await _post(embed_server, {"model": MODEL, "input": "x",
                                                 "embed_dtype": "float32"})
    assert status == 200 and "embed_dtype" in {n["field"] for n in body["candor"]["ignored"]}


async def test_inputs_are_batched_by_the_scheduler(embed_server, st_model):
    """Many inputs, and many requests at once, share the scheduler's steps (no step loop
    of their own): 24 short inputs take fewer than 24 steps, and every vector still equals
    sentence-transformers'."""
    texts = [f"sentence number {i} about {'cats' if i % 2 else 'dogs'}" for i in range(24)]
    reference = st_encode(st_model, texts)
    at_rest = embed_server.wait_all_blocks_free(timeout=30)
    before = at_rest["steps"]
    status, body, _ = await _post(embed_server, {"model": MODEL, "input": texts,
                                                 "encoding_format": "float"})
    assert status == 200, body
    steps = embed_server.wait_all_blocks_free(timeout=30)["steps"] - before
    # fewer steps than inputs: steps held several inputs (~6 steps when all wait; the
    # slowed steps let the tokenizer worker hand them over while the first one runs)
    assert steps < len(texts), f"{len(texts)} inputs took {steps} steps"
    for got, ref in zip(body["data"], reference):
        _close(got["embedding"], ref)

    async def one(i: int):
        return await _post(embed_server, {"model": MODEL, "input": texts[i],
                                          "encoding_format": "float"})

    replies = await asyncio.gather(*(one(i) for i in range(12)))
    for i, (status, body, _) in enumerate(replies):
        assert status == 200, body
        _close(body["data"][0]["embedding"], reference[i])
    after = embed_server.wait_all_blocks_free(timeout=30)
    # the same inputs twice, prefix caching on (the default): the cache was never asked
    # (mean pooling needs every position's hidden state; a hit would skip some)
    for key in ("prefix_cache_queried_tokens", "prefix_cache_hit_tokens", "cached_blocks"):
        assert after[key] == at_rest[key] == 0, key


def test_tensor_parallel_pooling_equals_sentence_transformers(st_model):
    """Two gpu_worker ranks (gloo on CPU) pool the same vectors: each rank holds the whole
    hidden state after the all-reduce, rank 0's vectors are sent."""
    from openai import OpenAI

    srv = CandorServer(st_model, "--served-model-name", MODEL, "--runner", "pooling",
                       "--tensor-parallel-size", "2", "--max-num-batched-tokens", "48").start()
    try:
        reply = OpenAI(base_url=srv.base_url + "/v1", api_key="x").embeddings.create(
            model=MODEL, input=TEXTS, encoding_format="float")
        for got, ref in zip(reply.data, st_encode(st_model, TEXTS)):
            _close(got.embedding, ref)
    finally:
        assert srv.stop() == 0
