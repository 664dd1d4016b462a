"""/v1/score, /v1/rerank, /v2/rerank and /classify through the real processes, on tiny
random BERT cross-encoders built with transformers' own classes, against
sentence-transformers' CrossEncoder on the same checkpoint; and what a generation
server answers on these routes."""

from __future__ import annotations

import math

import numpy as np
import pytest

from tests.support.server import CandorServer

pytest.importorskip("sentence_transformers")

from tests.support import encoder_zoo  # noqa: E402

QUERY = "What is the capital of France?"
DOCS = ["Paris is the capital of France.", "Berlin is the capital of Germany.",
        "The quick brown fox jumps over the lazy dog.", "a cat"]


@pytest.fixture(scope="module")
def reranker(tmp_path_factory):
    return encoder_zoo.build("bert", tmp_path_factory.mktemp("ce") / "bert-ce", classifier=True,
                             num_labels=1)


@pytest.fixture(scope="module")
def rerank_server(reranker):
    srv = CandorServer(reranker, "--served-model-name", "tiny-reranker", "--runner", "pooling").start()
    yield srv
    assert srv.stop() == 0


def _cross_encoder(path):
    from sentence_transformers import CrossEncoder
    return CrossEncoder(str(path), device="cpu")


def test_cross_encoder_scores_equal_sentence_transformers_cross_encoder(rerank_server, reranker):
    want = _cross_encoder(reranker).predict([(QUERY, d) for d in DOCS])
    status, body = rerank_server.post_json("/v1/score", {"model": "tiny-reranker",
                                                         "text_1": QUERY, "text_2": DOCS})
    assert status == 200, body
    assert body["object"] == "list" and [d["index"] for d in body["data"]] == [0, 1, 2, 3]
    np.testing.assert_allclose([d["score"] for d in body["data"]], want, atol=1e-5)
    assert body["usage"]["prompt_tokens"] > 0
    # two lists pair item by item
    status, body = rerank_server.post_json("/v1/score", {"model": "tiny-reranker",
                                                         "text_1": [QUERY, DOCS[3]],
                                                         "text_2": [DOCS[0], DOCS[1]]})
    assert status == 200, body
    pair_want = _cross_encoder(reranker).predict([(QUERY, DOCS[0]), (DOCS[3], DOCS[1])])
    np.testing.assert_allclose([d["score"] for d in body["data"]], pair_want, atol=1e-5)
    for route in ("/v1/rerank", "/v2/rerank"):
        status, body = rerank_server.post_json(route, {"model": "tiny-reranker", "query": QUERY,
                                                       "documents": DOCS})
        assert status == 200, body
        got = {r["index"]: r["relevance_score"] for r in body["results"]}
        np.testing.assert_allclose([got[i] for i in range(len(DOCS))], want, atol=1e-5)
        assert [r["index"] for r in body["results"]] == list(np.argsort(-want, kind="stable"))
        assert body["usage"]["total_tokens"] > 0


@pytest.mark.parametrize("name", ["roberta", "xlm-roberta"])
def test_a_roberta_cross_encoder_pairs_without_token_types_as_sentence_transformers(name, tmp_path):
    """A RoBERTa / XLM-R cross-encoder (no token types: its tokenizer pairs the texts as
    <s> a </s></s> b </s>, every type 0) through /v1/score and /v1/rerank equals
    sentence-transformers' CrossEncoder on the same checkpoint."""
    path = encoder_zoo.build(name, tmp_path / name, classifier=True, num_labels=1)
    from transformers import AutoTokenizer
    pair = AutoTokenizer.from_pretrained(path)(QUERY, DOCS[0])
    assert set(pair.get("token_type_ids", [0])) == {0}  # the case this test is for
    want = _cross_encoder(path).predict([(QUERY, d) for d in DOCS])
    assert np.ptp(want) > 1e-3, want
    srv = CandorServer(path, "--served-model-name", name, "--runner", "pooling").start()
    try:
        status, body = srv.post_json("/v1/score", {"model": name, "text_1": QUERY, "text_2": DOCS})
        assert status == 200, body
        np.testing.assert_allclose([d["score"] for d in body["data"]], want, atol=1e-5, rtol=0)
        status, body = srv.post_json("/v1/rerank", {"model": name, "query": QUERY,
                                                    "documents": DOCS, "top_n": 3})
        assert status == 200, body
        assert [r["index"] for r in body["results"]] == list(np.argsort(-want, kind="stable")[:3])
    finally:
        assert srv.stop() == 0


def test_rerank_sorts_cuts_to_top_n_and_drops_documents(rerank_server, reranker):
    want = _cross_encoder(reranker).predict([(QUERY, d) for d in DOCS])
    status, body = rerank_server.post_json("/v1/rerank", {
        "model": "tiny-reranker", "query": QUERY, "documents": DOCS, "top_n": 2,
        "return_documents": False})
    assert status == 200, body
    assert [r["index"] for r in body["results"]] == list(np.argsort(-want, kind="stable")[:2])
    assert all("document" not in r for r in body["results"])
    status, body = rerank_server.post_json("/v1/rerank", {
        "model": "tiny-reranker", "query": QUERY, "documents": DOCS, "top_n": 1})
    best = int(np.argmax(want))
    assert body["results"] == [{"index": best, "relevance_score": pytest.approx(float(want[best]), abs=1e-5),
                                "document": {"text": DOCS[best]}}]


def test_classify_gives_softmax_probs_and_labels(tmp_path):
    path = encoder_zoo.build("bert", tmp_path / "clf", classifier=True, num_labels=3)
    texts = ["a quick fox", DOCS[0]]
    srv = CandorServer(path, "--served-model-name", "clf", "--runner", "pooling").start()
    try:
        status, body = srv.post_json("/classify", {"model": "clf", "input": texts})
        assert status == 200, body
        for text, row in zip(texts, body["data"]):
            ref = encoder_zoo.hf_logits(path, _bert_ids(path, text)).tolist()
            exps = [math.exp(x - max(ref)) for x in ref]
            probs = [e / sum(exps) for e in exps]
            np.testing.assert_allclose(row["probs"], probs, atol=1e-5)
            assert row["num_classes"] == 3
            assert row["label"] == f"LABEL_{int(np.argmax(probs))}"
        # a classifier with 3 labels does not rerank; nor does it embed
        status, body = srv.post_json("/v1/rerank", {"model": "clf", "query": "q", "documents": ["d"]})
        assert (status, body["error"]["code"]) == (400, "wrong_model_task"), body
        status, body = srv.post_json("/v1/embeddings", {"model": "clf", "input": "d"})
        assert (status, body["error"]["code"]) == (400, "wrong_model_task"), body
    finally:
        assert srv.stop() == 0


def test_classify_on_one_label_is_the_sigmoid_of_its_logit(rerank_server, reranker):
    """A one-label head (a cross-encoder) on /classify: the probability of its label is the
    sigmoid of the logit, as vLLM's classify pooler gives it (a softmax over one label
    would answer 1.0 to every input)."""
    texts = ["a quick fox", DOCS[0], DOCS[1]]
    status, body = rerank_server.post_json("/classify", {"model": "tiny-reranker", "input": texts})
    assert status == 200, body
    probs = [row["probs"] for row in body["data"]]
    want = [[1.0 / (1.0 + math.exp(-encoder_zoo.hf_logits(reranker, _bert_ids(reranker, t)).item()))]
            for t in texts]
    np.testing.assert_allclose(probs, want, atol=1e-5)
    assert len({p[0] for p in probs}) == 3 and all(row["num_classes"] == 1 for row in body["data"])


def _bert_ids(path, text):
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(path)(text)["input_ids"]


def _error(status, body, want_status, param, code):
    assert status == want_status, body
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"}, err
    assert (err["param"], err["code"]) == (param, code), err
    return err["message"]


def test_bad_inputs_are_400s_naming_the_field(rerank_server):
    post = rerank_server.post_json
    _error(*post("/v1/score", {"model": "tiny-reranker", "text_1": ["a", "b"],
                               "text_2": ["a", "b", "c"]}), 400, "text_2", "invalid_value")
    _error(*post("/v1/score", {"model": "tiny-reranker", "text_1": "a", "text_2": ["b", ""]}),
           400, "text_2[1]", "invalid_value")
    _error(*post("/v1/rerank", {"model": "tiny-reranker", "query": "q", "documents": []}),
           400, "documents", "invalid_value")
    _error(*post("/v1/rerank", {"model": "tiny-reranker", "query": "q",
                                "documents": ["fine", "word " * 200]}),
           400, "documents[1]", "context_length_exceeded")
    _error(*post("/v1/rerank", {"model": "tiny-reranker", "query": "q", "documents": ["d"],
                                "truncate_prompt_tokens": 8}), 400, "truncate_prompt_tokens",
           "unsupported_field")
    _error(*post("/v1/rerank", {"model": "nope", "query": "q", "documents": ["d"]}),
           404, "model", "model_not_found")
    _error(*post("/classify", {"model": "tiny-reranker", "input": "x", "priority": 3}),
           400, "priority", "unsupported_field")
    status, body = post("/v1/score", {"model": "tiny-reranker", "text_1": "a", "text_2": "b",
                                      "user": "u", "colour": 1})
    assert status == 200, body
    assert {n["field"] for n in body["candor"]["ignored"]} >= {"user", "colour"}
    assert post("/v1/score", {"model": "tiny-reranker", "text_1": "a", "text_2": "b",
                              "user": "u", "strict": True})[0] == 400
    # the engine is still serving
    assert post("/v1/score", {"model": "tiny-reranker", "text_1": "a", "text_2": "b"})[0] == 200


def test_a_generation_server_answers_score_routes_with_a_404_naming_what_to_serve(server):
    for path, body in (("/v1/score", {"model": "tiny-llama", "text_1": "a", "text_2": "b"}),
                       ("/v1/rerank", {"model": "tiny-llama", "query": "a", "documents": ["b"]}),
                       ("/v2/rerank", {"model": "tiny-llama", "query": "a", "documents": ["b"]}),
                       ("/classify", {"model": "tiny-llama", "input": "a"})):
        message = _error(*server.post_json(path, body), 404, "model", "model_not_found")
        assert "--runner pooling" in message and "tiny-llama" in message


# Qwen3-Reranker's prompt as its model card writes it (format_instruction, the system
# prefix, the empty <think> suffix), with its default instruction
_QWEN3_PROMPT = ('<|im_start|>system\nJudge whether the Document meets the requirements based '
                 'on the Query and the Instruct provided. Note that the answer can only be '
                 '"yes" or "no".<|im_end|>\n<|im_start|>user\n<Instruct>: Given a web search '
                 'query, retrieve relevant passages that answer the query\n<Query>: {q}\n'
                 '<Document>: {d}<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n')


def test_a_yes_no_reranker_as_published_serves_rerank_under_vllms_hf_overrides(tmp_path, tiny_model_dir):
    """A tiny random Qwen3ForCausalLM served with vLLM's command line for Qwen3-Reranker
    (--hf-overrides, --task score), through the real processes: /v1/rerank and /v1/score
    format each pair in the reranker's prompt and score it P(yes) = softmax([l_no,
    l_yes])[1] at its last token, equal to transformers on the causal LM within 1e-5;
    sorted, cut to top_n; a client that formats the prompt itself (vLLM's earlier
    examples) gets the same scores."""
    import json

    from tests.support import reranker_zoo

    lm = reranker_zoo.build(tmp_path / "Qwen3-Reranker-tiny", tiny_model_dir)
    want = reranker_zoo.reference_scores(lm, [_QWEN3_PROMPT.format(q=QUERY, d=d) for d in DOCS])
    assert max(want) - min(want) > 0.01, want  # documents score apart: the order is checked
    srv = CandorServer(lm, "--task", "score", "--hf-overrides", json.dumps(reranker_zoo.HF_OVERRIDES),
                       env={"CANDOR_HF_OVERRIDES_CACHE": str(tmp_path / "overrides")}).start()
    try:
        name = "Qwen3-Reranker-tiny"
        status, body = srv.post_json("/v1/rerank", {"model": name, "query": QUERY, "documents": DOCS})
        assert status == 200, body
        got = {r["index"]: r["relevance_score"] for r in body["results"]}
        np.testing.assert_allclose([got[i] for i in range(len(DOCS))], want, atol=1e-5, rtol=0)
        order = list(np.argsort(-np.array(want), kind="stable"))
        assert [r["index"] for r in body["results"]] == order
        status, body = srv.post_json("/v2/rerank", {"model": name, "query": QUERY,
                                                    "documents": DOCS, "top_n": 2})
        assert status == 200, body
        assert [r["index"] for r in body["results"]] == order[:2]
        assert [r["document"]["text"] for r in body["results"]] == [DOCS[i] for i in order[:2]]
        status, body = srv.post_json("/v1/score", {"model": name, "text_1": QUERY, "text_2": DOCS})
        assert status == 200, body
        np.testing.assert_allclose([d["score"] for d in body["data"]], want, atol=1e-5, rtol=0)
        prefix, _, suffix = _QWEN3_PROMPT.partition("<Document>: {d}")
        status, body = srv.post_json("/v1/score", {
            "model": name, "text_1": prefix.format(q=QUERY),
            "text_2": ["<Document>: " + d + suffix for d in DOCS]})
        assert status == 200, body
        np.testing.assert_allclose([d["score"] for d in body["data"]], want, atol=1e-5, rtol=0)
        status, caps = srv.get("/v1/capabilities")
        pooling = [m for m in json.loads(caps)["models"] if m.get("pooling")][0]["pooling"]
        assert (pooling["task"], pooling["labels"], pooling["pair_format"]) == (
            "classify", ["yes"], "qwen3_reranker")
    finally:
        assert srv.stop() == 0
