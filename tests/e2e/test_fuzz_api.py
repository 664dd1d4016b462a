"""Property-based fuzzing of every route through the real five-process server.

Bodies come from the server's own OpenAPI document (/openapi.json, generated from the
msgspec structs that decode requests): schema-valid bodies, the same bodies with one
field replaced by arbitrary JSON, arbitrary JSON documents, and raw bytes under random
content types. Whatever arrives, the server must answer within the client's timeout
(no hang, no dropped connection: either raises out of the client), never with a 5xx,
always in the route's API's error shape when it refuses (OpenAI's; Anthropic's on
/v1/messages*, with the type Anthropic gives that status), end every stream as its API
does (``data: [DONE]``; Responses' terminal event; Anthropic's event order ending in
``message_stop`` or ``error``), and afterwards still be healthy with every KV block free.

The run is derandomized (the same examples every CI run); set CANDOR_FUZZ_SEED to explore
other examples, CANDOR_FUZZ_EXAMPLES to run more of them.
"""

from __future__ import annotations

import copy
import json
import os

import urllib.error
import urllib.request
from dataclasses import dataclass

import pytest
from hypothesis import HealthCheck, given, seed, settings
from hypothesis import strategies as st

from tests.support import lora_zoo
from tests.support.server import CandorServer

MODEL = "tiny-llama"
ADAPTER = "fz"
EXAMPLES = int(os.environ.get("CANDOR_FUZZ_EXAMPLES", "40"))
FUZZ_SEED = os.environ.get("CANDOR_FUZZ_SEED")
CLIENT_TIMEOUT_S = 60.0
# Keep each generated request cheap on a 2-core CI box: few tokens, few choices. The
# server's own bounds are exercised by the mutated and arbitrary bodies.
_CHEAP = {"max_tokens": 4, "max_completion_tokens": 4, "max_output_tokens": 4, "n": 3}

JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False)
    | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner,
                                                                  max_size=4),
    max_leaves=12)
HUGE_INTS = st.sampled_from([2 ** 63, -(2 ** 63) - 1, 2 ** 64, 2 ** 70, 10 ** 30])


def _settings(fn):
    fn = settings(max_examples=EXAMPLES, deadline=None, database=None,
                  derandomize=FUZZ_SEED is None,
                  suppress_health_check=list(HealthCheck))(fn)
    return seed(int(FUZZ_SEED))(fn) if FUZZ_SEED is not None else fn


@pytest.fixture(scope="module")
def fuzz_server(tiny_model_dir, tmp_path_factory):
    """With a LoRA adapter and runtime adapter loading on, so the adapter routes are
    fuzzed past their 404."""
    adapter = lora_zoo.build_adapter(tiny_model_dir, tmp_path_factory.mktemp("fuzz-lora") / ADAPTER,
                                     rank=4, alpha=8)
    srv = CandorServer(tiny_model_dir, "--served-model-name", MODEL, "--max-model-len", "256",
                       "--allow-request-chat-template", "--enable-lora", "--lora-modules",
                       f"{ADAPTER}={adapter}", "--allow-runtime-lora-updating").start()
    yield srv
    assert srv.stop() == 0


@dataclass
class Reply:
    status_code: int
    content_type: str
    text: str

    def json(self):
        return json.loads(self.text)


class Client:
    """Just enough HTTP for the fuzzer; every call is bounded by CLIENT_TIMEOUT_S."""

    def __init__(self, base_url: str) -> None:
        self.base_url = base_url

    def request(self, method: str, path: str, data: bytes | None = None,
                headers: dict[str, str] | None = None) -> Reply:
        req = urllib.request.Request(self.base_url + path, data=data, method=method,
                                     headers=headers or {})
        try:
            with urllib.request.urlopen(req, timeout=CLIENT_TIMEOUT_S) as resp:
                return Reply(resp.status, resp.headers.get("Content-Type", ""),
                             resp.read().decode("utf-8", "replace"))
        except urllib.error.HTTPError as err:
            return Reply(err.code, err.headers.get("Content-Type", ""),
                         err.read().decode("utf-8", "replace"))

    def get(self, path: str) -> Reply:
        return self.request("GET", path)

    def post(self, path: str, json_body=None, content: bytes | None = None,
             headers: dict[str, str] | None = None) -> Reply:
        if content is None:
            content = json.dumps(json_body).encode()
            headers = {"Content-Type": "application/json", **(headers or {})}
        return self.request("POST", path, content, headers)


@pytest.fixture(scope="module")
def client(fuzz_server):
    return Client(fuzz_server.base_url)


@pytest.fixture(scope="module")
def openapi(client):
    resp = client.get("/openapi.json")
    assert resp.status_code == 200
    return resp.json()


def from_schema(schema: dict, components: dict) -> st.SearchStrategy:
    """Values valid under the JSON-schema subset msgspec emits (type, properties, required,
    anyOf, enum, const, items, additionalProperties, $ref, numeric bounds). Optional
    properties are included about half the time, so every field gets exercised."""
    if "$ref" in schema:
        name = schema["$ref"].rsplit("/", 1)[1]
        return st.deferred(lambda: from_schema(components[name], components))
    if "const" in schema:
        return st.just(schema["const"])
    if "enum" in schema:
        return st.sampled_from(schema["enum"])
    if "anyOf" in schema:
        return st.one_of([from_schema(s, components) for s in schema["anyOf"]])
    kind = schema.get("type")
    if kind is None:
        return JSON_VALUES
    if kind == "null":
        return st.none()
    if kind == "boolean":
        return st.booleans()
    if kind == "integer":
        lo = schema.get("minimum", schema.get("exclusiveMinimum", -(2 ** 63)) + (
            1 if "exclusiveMinimum" in schema else 0))
        return st.integers(min_value=lo, max_value=schema.get("maximum", 2 ** 63 - 1))
    if kind == "number":
        return st.floats(min_value=schema.get("minimum", schema.get("exclusiveMinimum")),
                         max_value=schema.get("maximum"),
                         exclude_min="exclusiveMinimum" in schema,
                         allow_nan=False, allow_infinity=False)
    if kind == "string":
        return st.text(max_size=40)
    if kind == "array":
        return st.lists(from_schema(schema.get("items", {}), components),
                        min_size=schema.get("minItems", 0),
                        max_size=schema.get("maxItems", 4))
    if kind == "object":
        props = schema.get("properties")
        if props is None:
            extra = schema.get("additionalProperties", {})
            return st.dictionaries(st.text(max_size=8), from_schema(extra, components),
                                   max_size=4)
        required = set(schema.get("required", []))
        fields = {k: from_schema(v, components) for k, v in props.items()}

        @st.composite
        def build(draw):
            out = {}
            for key, strategy in fields.items():
                if key in required or draw(st.booleans()):
                    out[key] = draw(strategy)
            return out
        return build()
    raise AssertionError(f"schema construct the fuzzer does not know: {schema}")


def _route_schema(doc: dict, route: str) -> tuple[dict, dict]:
    """The body schema of ``route``, self-contained, narrowed to cheap requests."""
    components = copy.deepcopy(doc["components"]["schemas"])
    ref = doc["paths"][route]["post"]["requestBody"]["content"]["application/json"]["schema"]
    body = components[ref["$ref"].rsplit("/", 1)[1]]
    props = body.get("properties", {})
    for field, cap in _CHEAP.items():
        if field in props:
            props[field] = {"anyOf": [{"type": "integer", "minimum": 1, "maximum": cap},
                                      {"type": "null"}]}
    if "model" in props:
        props["model"] = {"enum": [MODEL, ADAPTER]}  # the base, or the LoRA adapter
    if route in ANTHROPIC_ROUTES:  # turns of the kinds each role takes, so some succeed
        props["messages"] = {"type": "array", "minItems": 1, "maxItems": 3,
                             "items": {"anyOf": _TURNS}}
        if "max_tokens" in props:  # required here: null would be a missing field
            props["max_tokens"] = {"type": "integer", "minimum": 1, "maximum": 4}
        if "stream" in props:  # always sent, mostly true: the event order gets checked
            props["stream"] = {"enum": [False, True, True]}
            body["required"] = [*body.get("required", []), "stream"]
        props["strict"] = {"enum": [False, False, False, True]}  # else most are strict 400s
        if "tools" in props:
            props["tools"] = {"type": "array", "maxItems": 2, "items": _TOOL}
    elif "messages" in props:
        props["messages"] = {**props["messages"], "maxItems": 4}
    if "input" in props:  # /v1/responses: a string, or a few items of the kinds it takes
        props["input"] = {"anyOf": [{"type": "string"}, {"type": "array", "maxItems": 3,
                                                         "items": {"anyOf": _ITEMS}}]}
    return body, components


_ITEMS = [
    {"type": "object", "required": ["role", "content"], "properties": {
        "role": {"enum": ["user", "assistant", "system", "developer", "tool"]},
        "content": {"type": "string"}}},
    {"type": "object", "required": ["type", "call_id", "name", "arguments"], "properties": {
        "type": {"const": "function_call"}, "call_id": {"type": "string"},
        "name": {"type": "string"}, "arguments": {"type": "string"}}},
    {"type": "object", "required": ["type", "call_id", "output"], "properties": {
        "type": {"const": "function_call_output"}, "call_id": {"type": "string"},
        "output": {"type": "string"}}},
    {"type": "object", "required": ["type"], "properties": {
        "type": {"enum": ["reasoning", "item_reference", "message", "web_search_call"]},
        "content": {}, "summary": {}}},
]
_TEXT = {"type": "object", "required": ["type", "text"], "properties": {
    "type": {"const": "text"}, "text": {"type": "string"}}}
_TURNS = [  # /v1/messages turns: strings, or the blocks each role may hold
    {"type": "object", "required": ["role", "content"], "properties": {
        "role": {"enum": ["user", "assistant"]}, "content": {"type": "string"}}},
    {"type": "object", "required": ["role", "content"], "properties": {
        "role": {"const": "user"}, "content": {"type": "array", "maxItems": 3, "items": {
            "anyOf": [_TEXT, {"type": "object", "required": ["type", "tool_use_id", "content"],
                              "properties": {"type": {"const": "tool_result"},
                                             "tool_use_id": {"type": "string"},
                                             "content": {"type": "string"}}}]}}}},
    {"type": "object", "required": ["role", "content"], "properties": {
        "role": {"const": "assistant"}, "content": {"type": "array", "maxItems": 3, "items": {
            "anyOf": [_TEXT, {"type": "object", "required": ["type", "id", "name", "input"],
                              "properties": {"type": {"const": "tool_use"},
                                             "id": {"type": "string"},
                                             "name": {"type": "string"}, "input": {
                                                 "type": "object", "properties": {}}}},
                      {"type": "object", "required": ["type", "thinking"], "properties": {
                          "type": {"const": "thinking"}, "thinking": {"type": "string"}}}]}}}},
]
_TOOL = {"type": "object", "required": ["name", "input_schema"], "properties": {
    "name": {"enum": ["get_weather", "lookup"]}, "description": {"type": "string"},
    "input_schema": {"const": {"type": "object", "properties": {"q": {"type": "string"}}}}}}
TERMINAL_EVENTS = ("response.completed", "response.incomplete", "response.failed")


def _assert_error_shape(resp: Reply) -> None:
    body = resp.json()
    assert set(body) == {"error"}, body
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"}, err
    assert isinstance(err["message"], str) and err["message"]


# Anthropic's error type for each status (https://docs.anthropic.com/en/api/errors);
# a status it does not list is an invalid_request_error below 500
ANTHROPIC_ROUTES = ("/v1/messages", "/v1/messages/count_tokens")
ANTHROPIC_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error",
                         403: "permission_error", 404: "not_found_error",
                         413: "request_too_large", 429: "rate_limit_error"}


def _assert_anthropic_error(error: dict, status: int | None) -> None:
    assert set(error) == {"type", "message"}, error
    assert isinstance(error["message"], str) and error["message"], error
    if status is not None:
        assert error["type"] == ANTHROPIC_ERROR_TYPES.get(status, "invalid_request_error"), (
            status, error)


def _assert_anthropic_error_shape(resp: Reply) -> None:
    assert resp.content_type.startswith("application/json"), resp.content_type
    body = resp.json()
    assert set(body) == {"type", "error"} and body["type"] == "error", body
    _assert_anthropic_error(body["error"], resp.status_code)


def _check_anthropic_stream(text: str, sent) -> None:
    """Anthropic's event order: message_start, ping, each block's start / deltas / stop
    (indices 0, 1, ...), message_delta, message_stop; or an ``error`` event last, after
    the open block closed. Each frame's ``event:`` names its data's type."""
    frames = [f for f in text.split("\n\n") if f.strip()]
    events = []
    for frame in frames:
        lines = frame.split("\n")
        assert len(lines) == 2 and lines[0].startswith("event: ") and lines[1].startswith(
            "data: "), (frame, sent)
        event = json.loads(lines[1][len("data: "):])
        assert event["type"] == lines[0][len("event: "):], (frame, sent)
        events.append(event)
    kinds = [e["type"] for e in events]
    assert kinds[:2] == ["message_start", "ping"], (kinds, sent)
    assert kinds[-1] in ("message_stop", "error"), (kinds, sent)
    assert kinds.count("message_start") == 1, (kinds, sent)
    if kinds[-1] == "error":
        _assert_anthropic_error(events[-1]["error"], None)
        body = kinds[2:-1]
    else:
        assert kinds[-2] == "message_delta", (kinds, sent)
        assert events[-2]["delta"]["stop_reason"] in (
            "end_turn", "max_tokens", "stop_sequence", "tool_use"), (events[-2], sent)
        body = kinds[2:-2]
    open_index, next_index = None, 0
    for event in events[2:2 + len(body)]:
        kind = event["type"]
        if kind == "content_block_start":
            assert open_index is None and event["index"] == next_index, (kinds, sent)
            open_index, next_index = next_index, next_index + 1
        elif kind in ("content_block_delta", "content_block_stop"):
            assert event["index"] == open_index, (kinds, sent)
            if kind == "content_block_stop":
                open_index = None
        else:
            raise AssertionError((f"{kind} inside the message's blocks", kinds, sent))
    assert open_index is None, (kinds, sent)


def _check_anthropic(resp: Reply, sent) -> None:
    if resp.status_code >= 400:
        _assert_anthropic_error_shape(resp)
    elif resp.content_type.startswith("text/event-stream"):
        _check_anthropic_stream(resp.text, sent)
    else:
        body = resp.json()
        assert body.get("type") == "message" or set(body) == {"input_tokens"}, (body, sent)


def _check(resp: Reply, sent, route: str | None = None) -> None:
    assert resp.status_code < 500, (resp.status_code, resp.text[:500], sent)
    if route in ANTHROPIC_ROUTES:
        _check_anthropic(resp, sent)
        return
    if resp.status_code >= 400:
        _assert_error_shape(resp)
        return
    if resp.content_type.startswith("text/event-stream") and "\nevent: " in "\n" + resp.text:
        # /v1/responses: named events, the last one terminal; an error event's fields
        events = [json.loads(line[len("data: "):]) for line in resp.text.split("\n")
                  if line.startswith("data: ")]
        assert events and events[-1]["type"] in TERMINAL_EVENTS, (resp.text[-500:], sent)
        for event in events:
            if event["type"] == "error":
                assert {"message", "code", "param"} <= set(event)
        return
    if resp.content_type.startswith("text/event-stream"):
        frames = [line for line in resp.text.split("\n") if line.startswith("data: ")]
        assert frames and frames[-1] == "data: [DONE]", (resp.text[-500:], sent)
        for frame in frames[:-1]:
            payload = json.loads(frame[len("data: "):])
            if "error" in payload:
                assert set(payload["error"]) == {"message", "type", "param", "code"}


def _post(client: Client, route: str, body) -> None:
    resp = client.post(route, json_body=body)
    _check(resp, body, route)


POST_ROUTES = ["/v1/chat/completions", "/v1/completions", "/v1/chat/completions/render",
               "/v1/completions/render", "/tokenize", "/detokenize", "/v1/responses",
               "/v1/load_lora_adapter", "/v1/unload_lora_adapter", *ANTHROPIC_ROUTES]


@pytest.mark.parametrize("route", POST_ROUTES)
def test_schema_valid_and_mutated_bodies_never_5xx(client, openapi, route):
    valid = from_schema(*_route_schema(openapi, route))

    def mutate(body):
        if not isinstance(body, dict) or not body:
            return st.just(body)
        return st.tuples(st.sampled_from(sorted(body)), JSON_VALUES | HUGE_INTS).map(
            lambda kv: {**body, kv[0]: kv[1]})

    @_settings
    @given(body=st.one_of(valid, valid.flatmap(mutate), JSON_VALUES))
    def run(body):
        _post(client, route, body)

    run()


@pytest.mark.parametrize("route", POST_ROUTES)
def test_raw_bytes_and_content_types_never_5xx(client, route):
    @_settings
    @given(raw=st.binary(max_size=200) | st.text(max_size=200).map(str.encode),
           ctype=st.sampled_from(["application/json", "text/plain", "",
                                  "application/x-www-form-urlencoded", "multipart/form-data"]))
    def run(raw, ctype):
        headers = {"Content-Type": ctype} if ctype else {}
        resp = client.post(route, content=raw, headers=headers)
        _check(resp, raw, route)

    run()


@pytest.mark.parametrize("route, template", [
    ("/v1/chat/completions", '{"model": "%s", "messages": [{"role": "user", "content": "hi"}], '
     '"chat_template_kwargs": {"x": %s}}'),
    ("/v1/messages", '{"model": "%s", "max_tokens": 2, "messages": [{"role": "user", '
     '"content": "hi"}], "tools": [{"name": "t", "input_schema": {"x": %s}}]}'),
])
def test_deep_and_huge_json_never_5xx(client, route, template):
    for depth in (100, 1000, 5000):
        nested = "[" * depth + "]" * depth
        body = template % (MODEL, nested)
        resp = client.post(route, content=body.encode(),
                           headers={"Content-Type": "application/json"})
        _check(resp, f"nested {depth}", route)


def test_get_routes_with_random_paths_never_5xx(client):
    @_settings
    @given(path=st.sampled_from(["/v1/models/", "/v1/", "/", "/health/", "/tokenize/",
                                 "/v1/responses/"]),
           tail=st.text(alphabet=st.characters(min_codepoint=33, max_codepoint=126,
                                               exclude_characters="#?%"), max_size=30))
    def run(path, tail):
        resp = client.get(path + tail)
        assert resp.status_code < 500 or resp.status_code == 503, (path + tail, resp.text)
        if resp.status_code >= 400:
            _assert_error_shape(resp)

    run()


def test_response_ids_on_get_and_delete_never_5xx(client):
    """Stored-response routes take any id: a 4xx in the error shape, never a 5xx."""
    made = client.post("/v1/responses", json_body={"model": MODEL, "input": "hi",
                                                   "max_output_tokens": 2}).json()["id"]

    @_settings
    @given(rid=st.sampled_from([made, made[:-1] + "n", made[:-3] + "f9s", "resp_x", ""])
           | st.text(alphabet=st.characters(min_codepoint=33, max_codepoint=126,
                                            exclude_characters="#?%/"), max_size=60),
           tail=st.sampled_from(["", "/input_items", "/input_items?limit=0",
                                 "/input_items?order=x", "/input_items?after=nope"]),
           method=st.sampled_from(["GET", "DELETE"]))
    def run(rid, tail, method):
        resp = client.request(method if not tail else "GET", f"/v1/responses/{rid}{tail}")
        assert resp.status_code < 500, (rid, tail, resp.text)
        if resp.status_code >= 400:
            _assert_error_shape(resp)

    run()


def test_server_healthy_and_nothing_held_after_fuzzing(fuzz_server, client):
    """Runs last in this module: the fuzzing above left no request or KV block behind."""
    assert client.get("/health").status_code == 200
    fuzz_server.wait_all_blocks_free(timeout=30)
    resp = client.post("/v1/completions", json_body={"model": MODEL, "prompt": "hello",
                                                "max_tokens": 2})
    assert resp.status_code == 200, resp.text
    body = {"model": MODEL, "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]}
    for stream in (False, True):
        resp = client.post("/v1/messages", json_body={**body, "stream": stream})
        assert resp.status_code == 200, resp.text
        _check(resp, body, "/v1/messages")


def _integer_fields(schema: dict) -> list[str]:
    """Top-level fields that take an integer, alone or as list items."""
    return [name for name, prop in schema.get("properties", {}).items()
            if '"integer"' in json.dumps(prop)]


@pytest.mark.parametrize("route", ["/v1/chat/completions", "/v1/completions", "/detokenize",
                                   "/v1/messages"])
def test_integers_beyond_int64_in_every_integer_field_are_400(client, openapi, route):
    body_schema, _ = _route_schema(openapi, route)
    base = {"/v1/chat/completions": {"model": MODEL, "max_tokens": 2,
                                     "messages": [{"role": "user", "content": "hi"}]},
            "/v1/completions": {"model": MODEL, "prompt": "hi", "max_tokens": 2},
            "/detokenize": {"model": MODEL, "tokens": [1, 2]},
            "/v1/messages": {"model": MODEL, "max_tokens": 2,
                             "messages": [{"role": "user", "content": "hi"}]}}[route]
    fields = _integer_fields(body_schema)
    assert fields, "the schema names no integer field"
    for field in fields:
        for huge in (2 ** 63, 2 ** 64, 2 ** 70, -(2 ** 63) - 1):
            for value in (huge, [huge]):  # the field itself, or as a list's item
                body = {**base, field: value}
                resp = client.post(route, json_body=body)
                _check(resp, body, route)
                assert resp.status_code == 400, (resp.text, body)
    bias = {**base, "logit_bias": {str(2 ** 70): 1.0}}
    if route in ("/v1/chat/completions", "/v1/completions"):
        resp = client.post(route, json_body=bias)
        _check(resp, bias)
        assert resp.status_code == 400
    assert client.get("/health").status_code == 200


@pytest.mark.parametrize("status, body, stream", [
    (500, {"type": "error", "error": {"type": "api_error", "message": "boom"}}, None),
    (400, {"error": {"message": "bad", "type": "invalid_request_error", "param": None,
                     "code": None}}, None),
    (404, {"type": "error", "error": {"type": "invalid_request_error", "message": "no"}}, None),
    (200, None, "event: message_start\ndata: {\"type\": \"message_start\"}\n\n"),
    (200, None, "data: {\"choices\": []}\n\ndata: [DONE]\n\n"),
])
def test_the_messages_check_refuses_what_anthropics_clients_could_not_read(status, body,
                                                                           stream):
    """The checks above fail on a 5xx, on OpenAI's error shape, on a wrong error type for
    the status, and on a stream that is not Anthropic's: without this, a fuzz run that
    passes could mean a check that cannot fail."""
    reply = (Reply(status, "application/json", json.dumps(body)) if stream is None
             else Reply(status, "text/event-stream", stream))
    with pytest.raises(AssertionError):
        _check(reply, "self-test", "/v1/messages")
