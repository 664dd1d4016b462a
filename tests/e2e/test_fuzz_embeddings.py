"""Property-based fuzzing of /v1/embeddings and the scoring routes (/v1/score,
/v1/rerank, /v2/rerank, /classify), and of model routing, through a real
two-model topology (a generation model and an embedding model behind one frontend); the
scoring routes also on servers of one cross-encoder each (a BERT one and a decoder yes/no
reranker served as published).

Bodies come from the server's OpenAPI document as in tests/e2e/test_fuzz_api.py (whose
strategies and checks this reuses): schema-valid bodies whose ``model`` names either model
(or neither) and whose ``input`` takes every form (strings, token ids in and out of the
vocabulary, lists of either, empty ones), the same bodies with one field replaced by
arbitrary JSON, arbitrary JSON, and raw bytes. Whatever arrives: no 5xx, OpenAI's error
shape on a refusal, a vector per input on success; afterwards both engines are healthy and
hold no KV block.
"""

from __future__ import annotations

import copy

import pytest
from hypothesis import given
from hypothesis import strategies as st

from tests.support.embedding_zoo import two_model_server
from tests.e2e.test_fuzz_api import (HUGE_INTS, JSON_VALUES, Client, _assert_error_shape,
                                 _check, _settings, from_schema)

GEN = "tiny-llama"
EMB = "tiny-embed"
ROUTE = "/v1/embeddings"
IDS = st.lists(st.integers(min_value=-2, max_value=2100), max_size=6)
TEXT = st.text(max_size=40)


@pytest.fixture(scope="module")
def server(tiny_model_dir, tmp_path_factory):
    srv = two_model_server(tmp_path_factory.mktemp("topo"), tiny_model_dir, GEN, [EMB],
                           generate_len=256, embed_len=128)
    yield srv
    assert srv.stop() == 0


@pytest.fixture(scope="module")
def client(server):
    return Client(server.base_url)


def _embedding_schema(doc: dict) -> tuple[dict, dict]:
    components = copy.deepcopy(doc["components"]["schemas"])
    ref = doc["paths"][ROUTE]["post"]["requestBody"]["content"]["application/json"]["schema"]
    return components[ref["$ref"].rsplit("/", 1)[1]], components


def _bodies(doc: dict) -> st.SearchStrategy:
    body, components = _embedding_schema(doc)
    valid = from_schema(body, components)
    inputs = (TEXT | IDS | st.lists(TEXT, max_size=4) | st.lists(IDS, max_size=4)
              | st.lists(TEXT | IDS | st.integers(0, 10), max_size=4))
    models = st.sampled_from([EMB, EMB, GEN, "nope"])
    # every schema field drawn (most draws then hold some refused value), or only the
    # common ones (so that successes are frequent too)
    narrowed = st.tuples(valid, inputs, models).map(
        lambda t: {**t[0], "input": t[1], "model": t[2]}) | st.fixed_dictionaries(
        {"model": models, "input": inputs},
        optional={"encoding_format": st.sampled_from(["float", "base64"]), "user": TEXT})

    def mutate(b):
        return st.tuples(st.sampled_from(sorted(b)), JSON_VALUES | HUGE_INTS).map(
            lambda kv: {**b, kv[0]: kv[1]})

    return st.one_of(narrowed, narrowed.flatmap(mutate), JSON_VALUES)


def test_embedding_bodies_never_5xx(client):
    doc = client.get("/openapi.json").json()
    statuses: set[int] = set()

    @_settings
    @given(body=_bodies(doc))
    def run(body):
        resp = client.post(ROUTE, json_body=body)
        _check(resp, body)
        statuses.add(resp.status_code)
        if resp.status_code == 200:
            reply = resp.json()
            assert reply["object"] == "list" and reply["model"] == EMB, reply
            inputs = body["input"]
            many = isinstance(inputs, list) and inputs and not isinstance(inputs[0], int)
            assert len(reply["data"]) == (len(inputs) if many else 1), (body, reply)
            assert reply["usage"]["prompt_tokens"] > 0

    run()
    assert {200, 400, 404} <= statuses, statuses  # the bodies reached every outcome


def test_raw_bytes_never_5xx(client):
    @_settings
    @given(raw=st.binary(max_size=200) | st.text(max_size=200).map(str.encode),
           ctype=st.sampled_from(["application/json", "text/plain", ""]))
    def run(raw, ctype):
        resp = client.post(ROUTE, content=raw, headers={"Content-Type": ctype} if ctype else {})
        _check(resp, raw)

    run()


def test_generation_routes_with_either_model_never_5xx(client):
    """Routing by ``model``: the generation routes refuse the embedding model with a 400,
    serve the generation model."""
    @_settings
    @given(model=st.sampled_from([EMB, GEN, "nope"]),
           route=st.sampled_from(["/v1/chat/completions", "/v1/completions",
                                  "/v1/responses"]))
    def run(model, route):
        body = {"model": model, "max_tokens": 2, "max_output_tokens": 2,
                "messages": [{"role": "user", "content": "hi"}], "prompt": "hi",
                "input": "hi"}
        body = {k: v for k, v in body.items() if k in {
            "/v1/chat/completions": {"model", "max_tokens", "messages"},
            "/v1/completions": {"model", "max_tokens", "prompt"},
            "/v1/responses": {"model", "max_output_tokens", "input"}}[route]}
        resp = client.post(route, json_body=body)
        _check(resp, body)
        if model != GEN:
            assert resp.status_code == (400 if model == EMB else 404), resp.text
            _assert_error_shape(resp)
        else:
            assert resp.status_code == 200, resp.text

    run()


SCORE_ROUTES = ("/v1/score", "/v1/rerank", "/v2/rerank", "/classify")
WORD = st.text(min_size=1, max_size=20)  # mostly servable, so that successes are frequent
TEXTS = TEXT | st.lists(TEXT, max_size=4) | WORD | st.lists(WORD, min_size=1, max_size=3)


def _score_bodies(doc: dict, route: str, names: tuple[str, ...] = (EMB, EMB, GEN, "nope")
                  ) -> st.SearchStrategy:
    components = copy.deepcopy(doc["components"]["schemas"])
    ref = doc["paths"][route]["post"]["requestBody"]["content"]["application/json"]["schema"]
    valid = from_schema(components[ref["$ref"].rsplit("/", 1)[1]], components)
    models = st.sampled_from(names)
    common = st.fixed_dictionaries(
        {"model": models, "text_1": TEXTS, "text_2": TEXTS, "query": TEXT | WORD,
         "documents": st.lists(TEXT, max_size=4) | st.lists(WORD, min_size=1, max_size=3),
         "input": TEXTS},
        optional={"top_n": st.integers(-1, 5), "return_documents": st.booleans(), "user": TEXT})
    fields = set(components[ref["$ref"].rsplit("/", 1)[1]]["properties"])
    narrowed = (st.tuples(valid, models).map(lambda t: {**t[0], "model": t[1]})
                | common.map(lambda b: {k: v for k, v in b.items() if k in fields}))

    def mutate(b):
        return st.tuples(st.sampled_from(sorted(b)), JSON_VALUES | HUGE_INTS).map(
            lambda kv: {**b, kv[0]: kv[1]})

    return st.one_of(narrowed, narrowed.flatmap(mutate), JSON_VALUES)


@pytest.mark.parametrize("route", SCORE_ROUTES)
def test_score_rerank_and_classify_bodies_never_5xx(client, route):
    """On an embedding model: score and rerank by cosine, /classify a 400 (no labels); a
    generation model a 400 naming its runner; whatever the body, no 5xx."""
    doc = client.get("/openapi.json").json()
    statuses: set[int] = set()

    @_settings
    @given(body=_score_bodies(doc, route))
    def run(body):
        resp = client.post(route, json_body=body)
        _check(resp, body)
        statuses.add(resp.status_code)
        if resp.status_code == 200:
            reply = resp.json()
            assert reply["model"] == EMB, reply
            if route == "/v1/score":
                assert all(-1.0001 <= d["score"] <= 1.0001 for d in reply["data"]), reply
            else:
                assert route != "/classify", reply
                scores = [r["relevance_score"] for r in reply["results"]]
                assert scores == sorted(scores, reverse=True), reply

    run()
    assert 400 in statuses, statuses
    good = {"model": EMB, "text_1": "a", "text_2": ["b", "c"], "query": "a",
            "documents": ["b", "c"], "input": "a"}
    resp = client.post(route, json_body={k: v for k, v in good.items()
                                         if k in _score_fields(doc, route)})
    assert resp.status_code == (400 if route == "/classify" else 200), resp.text


# A question the query may also be: the decoder reranker takes a query that starts with
# its prompt's first special token as written by the client
REWORDED = st.sampled_from(["<|im_start|>system\nq<|im_end|>\n", "<|im_end|>", "[SEP] [CLS]",
                            "yes", "no", "<think>\n\n</think>"])
CROSS_ENCODERS = {"bert-ce": "a BERT cross-encoder (one logit)",
                  "qwen3-reranker": "a Qwen3ForCausalLM yes/no reranker under --hf-overrides"}


@pytest.fixture(scope="module", params=sorted(CROSS_ENCODERS))
def cross_encoder(request, tmp_path_factory, tiny_model_dir):
    """(name, client) of a server of one cross-encoder: a BERT one (its tokenizer pairs
    the texts, token types) or a decoder yes/no reranker (each pair written into its
    prompt: tokenizer_worker/score_prompt.py)."""
    import json

    from tests.support import encoder_zoo, reranker_zoo
    from tests.support.server import CandorServer

    root = tmp_path_factory.mktemp("ce")
    if request.param == "bert-ce":
        path = encoder_zoo.build("bert", root / "bert-ce", classifier=True, num_labels=1)
        flags = ["--runner", "pooling"]
    else:
        path = reranker_zoo.build(root / "qwen3-reranker", tiny_model_dir)
        flags = ["--task", "score", "--max-model-len", "256",
                 "--hf-overrides", json.dumps(reranker_zoo.HF_OVERRIDES)]
    srv = CandorServer(path, "--served-model-name", request.param, *flags,
                       env={"CANDOR_HF_OVERRIDES_CACHE": str(root / "overrides")}).start()
    yield request.param, Client(srv.base_url)
    srv.wait_all_blocks_free(timeout=30)
    assert srv.stop() == 0


@pytest.mark.parametrize("route", SCORE_ROUTES)
def test_scoring_bodies_on_a_cross_encoder_never_5xx(cross_encoder, route):
    """On a cross-encoder (each server of ``CROSS_ENCODERS``): scores are probabilities
    (sigmoid of the one logit), rerank results sorted and cut to top_n, /classify's probs
    a distribution over its one label; whatever the body (texts with the models' special
    tokens and prompt markers among them), no 5xx, OpenAI's error shape on a refusal."""
    name, client = cross_encoder
    doc = client.get("/openapi.json").json()
    statuses: set[int] = set()
    words = WORD | REWORDED | st.tuples(REWORDED, WORD).map("".join)

    @_settings
    @given(body=_score_bodies(doc, route, (name, name, name, "nope")),
           query=st.none() | words)
    def run(body, query):
        if query is not None and isinstance(body, dict):
            body = {**body, **{k: query for k in ("query", "text_1") if k in body}}
        resp = client.post(route, json_body=body)
        _check(resp, body)
        statuses.add(resp.status_code)
        if resp.status_code == 200:
            reply = resp.json()
            assert reply["model"] == name, reply
            if route == "/v1/score":
                assert all(0.0 <= d["score"] <= 1.0 for d in reply["data"]), reply
            elif route == "/classify":  # one label: the sigmoid of its logit, a probability
                assert all(d["num_classes"] == len(d["probs"]) == 1 and 0.0 <= d["probs"][0] <= 1.0
                           for d in reply["data"]), reply
            else:
                scores = [r["relevance_score"] for r in reply["results"]]
                assert scores == sorted(scores, reverse=True), reply
                assert all(0.0 <= x <= 1.0 for x in scores), reply
                top_n = body.get("top_n")
                if isinstance(top_n, int) and top_n > 0:
                    assert len(scores) <= top_n, reply

    run()
    assert {200, 400} <= statuses, statuses
    good = {"model": name, "text_1": "a", "text_2": ["b", "c"], "query": "a",
            "documents": ["b", "c"], "input": "a"}
    resp = client.post(route, json_body={k: v for k, v in good.items()
                                         if k in _score_fields(doc, route)})
    assert resp.status_code == 200, resp.text
    assert client.get("/health").status_code == 200


def _score_fields(doc: dict, route: str) -> set[str]:
    ref = doc["paths"][route]["post"]["requestBody"]["content"]["application/json"]["schema"]
    return set(doc["components"]["schemas"][ref["$ref"].rsplit("/", 1)[1]]["properties"])


def test_both_engines_healthy_and_nothing_held_after_fuzzing(server, client):
    assert client.get("/health").status_code == 200
    server.wait_all_blocks_free(timeout=30)
    resp = client.post(ROUTE, json_body={"model": EMB, "input": "still here"})
    assert resp.status_code == 200, resp.text
    resp = client.post("/v1/completions", json_body={"model": GEN, "prompt": "hi",
                                                     "max_tokens": 2})
    assert resp.status_code == 200, resp.text
