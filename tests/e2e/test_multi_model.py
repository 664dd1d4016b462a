"""Two models behind one gateway (DESIGN's policy row: routed by ``model``): a generation
model and an embedding model in one topology, each with its own scheduler, gpu_worker and
tokenizer worker, behind the same frontend. The embedding model is a plain causal-LM
checkpoint served with ``runner: pooling`` and no sentence-transformers files, so it pools
as vLLM does by default (the last token, L2-normalised), checked against transformers."""

from __future__ import annotations

import asyncio

import aiohttp
import numpy as np
import pytest

from tests.support.embedding_zoo import hf_last_token, two_model_server

GEN = "tiny-llama"
EMB = "tiny-embed"
TEXTS = ["The quick brown fox", "hello world, " * 10]


@pytest.fixture(scope="module")
def two_models(tiny_model_dir, tmp_path_factory):
    srv = two_model_server(tmp_path_factory.mktemp("topo"), tiny_model_dir, GEN,
                           [EMB, "embed-alias"], generate_len=512, embed_len=256)
    yield srv
    assert srv.stop() == 0


async def _post(server, path: str, body: dict) -> tuple[int, dict]:
    async with aiohttp.ClientSession() as session, session.post(
            server.base_url + path, json=body) as resp:
        return resp.status, await resp.json()


def _get(server, path: str) -> dict:
    import json
    status, body = server.get(path)
    assert status == 200, body
    return json.loads(body)


def test_models_lists_both_with_their_names(two_models):
    ids = [m["id"] for m in _get(two_models, "/v1/models")["data"]]
    assert ids == [GEN, EMB, "embed-alias"]
    caps = _get(two_models, "/v1/capabilities")
    runners = {m["id"]: m["runner"] for m in caps["models"]}
    assert runners == {GEN: "generate", EMB: "pooling"}
    assert {"chat.completions", "embeddings"} <= set(caps["serves"])
    pooling = next(m for m in caps["models"] if m["id"] == EMB)["pooling"]
    assert (pooling["method"], pooling["normalize"]) == ("last", True)


async def test_each_route_reaches_its_model(two_models, tiny_model_dir):
    """Chat and embeddings at the same time, each on its own engine; the embeddings equal
    transformers' last hidden state of the last token, L2-normalised (any alias)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    chat = _post(two_models, "/v1/chat/completions", {
        "model": GEN, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8,
        "temperature": 0})
    embed = _post(two_models, "/v1/embeddings", {"model": "embed-alias", "input": TEXTS,
                                                 "encoding_format": "float"})
    (cs, cbody), (es, ebody) = await asyncio.gather(chat, embed)
    assert cs == 200 and cbody["model"] == GEN and cbody["usage"]["completion_tokens"] > 0
    assert es == 200 and ebody["model"] == "embed-alias", ebody
    for got, text in zip(ebody["data"], TEXTS):
        ref = hf_last_token(tiny_model_dir, tok(text)["input_ids"])
        vec = np.asarray(got["embedding"])
        assert float(vec @ ref / np.linalg.norm(vec) / np.linalg.norm(ref)) >= 0.99999
    # each engine counted its own work; both at rest afterwards
    health = _get(two_models, "/health")
    assert health["status"] == "ok"
    two_models.wait_all_blocks_free(timeout=30)


def test_health_generate_probes_each_models_engine(two_models):
    """The probe pushes a token through the generation model's replica and an input
    through the embedding model's: both answer."""
    import json
    status, body = two_models.get("/health/generate", timeout=60)
    assert status == 200, body
    reply = json.loads(body)
    assert reply["status"] == "ok" and [(r["replica"], r["status"]) for r in reply["replicas"]] \
        == [(0, "ok"), (1, "ok")], reply


async def test_wrong_kind_of_model_is_a_400_naming_the_runner(two_models):
    status, body = await _post(two_models, "/v1/embeddings", {"model": GEN, "input": "x"})
    err = body["error"]
    assert status == 400 and (err["param"], err["code"]) == ("model", "wrong_model_runner")
    assert "runner generate" in err["message"] and EMB in err["message"], err
    for path, body in (("/v1/chat/completions",
                        {"messages": [{"role": "user", "content": "hi"}]}),
                       ("/v1/completions", {"prompt": "hi"}),
                       ("/v1/responses", {"input": "hi"})):
        status, reply = await _post(two_models, path, {"model": EMB, **body})
        err = reply["error"]
        assert status == 400 and err["code"] == "wrong_model_runner", (path, reply)
        assert "runner pooling" in err["message"] and GEN in err["message"], err
    status, body = await _post(two_models, "/v1/embeddings", {"model": "other", "input": "x"})
    assert status == 404 and GEN in body["error"]["message"] and EMB in body["error"]["message"]


async def test_dimensions_on_a_model_without_matryoshka_is_a_400(two_models):
    status, body = await _post(two_models, "/v1/embeddings", {"model": EMB, "input": "x",
                                                              "dimensions": 8})
    err = body["error"]
    assert status == 400 and err["param"] == "dimensions", body
    assert "Matryoshka" in err["message"]


async def test_an_input_longer_than_its_models_context_is_a_400(two_models):
    """Each model keeps its own context: 300 tokens fit the generation model's 512, not
    the embedding model's 256."""
    status, body = await _post(two_models, "/v1/embeddings", {
        "model": EMB, "input": [[1] * 10, [1] * 300]})
    assert status == 400 and body["error"]["param"] == "input[1]", body
    assert "256" in body["error"]["message"]
    status, body = await _post(two_models, "/v1/completions", {
        "model": GEN, "prompt": [1] * 300, "max_tokens": 1})
    assert status == 200, body
