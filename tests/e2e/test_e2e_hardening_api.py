"""The frontend's request validation under hostile and sloppy clients, through the real
processes: fan-out limits, integers past int64, deep JSON, wrong Content-Type, malformed
HTTP, unsupported vLLM/SGLang fields, nulls, prompt lists, X-Request-Id, and that every
path out of the frontend releases what the request held (the drain is never stuck)."""

from __future__ import annotations

import json
import socket
import struct
import time

import aiohttp
import openai
import pytest

from tests.support.metrics_text import scrape
from tests.support.polling import wait_until
from tests.support.server import CandorServer

MODEL = "tiny-llama"
CHAT = [{"role": "user", "content": "hi"}]
MAX_N, MAX_PROMPTS, MAX_LOGPROBS, MAX_WAITING = 4, 8, 8, 40  # share 0.25 -> 10 sequences


DRAIN_S = 120  # a request left counted in flight would hold SIGTERM this long


@pytest.fixture(scope="module")
def srv(tiny_model_dir, tmp_path_factory):
    log = tmp_path_factory.mktemp("hardening") / "server.log"
    server = CandorServer(tiny_model_dir, "--served-model-name", MODEL, "--max-model-len",
                          "1024", "--max-n", str(MAX_N), "--max-prompts", str(MAX_PROMPTS),
                          "--max-logprobs", str(MAX_LOGPROBS), "--max-waiting-requests",
                          str(MAX_WAITING), "--drain-timeout-s", str(DRAIN_S)).start(log_path=log)
    server.log_path = log
    yield server
    server.stop()


async def _post(srv, path: str, body, headers: dict | None = None, raw: bytes | None = None):
    async with aiohttp.ClientSession() as session:
        kwargs = {"data": raw} if raw is not None else {"json": body}
        async with session.post(srv.base_url + path, headers=headers, **kwargs) as resp:
            return resp.status, dict(resp.headers), await resp.read()


def _error(payload: bytes) -> dict:
    return json.loads(payload)["error"]


def _tables_settle(srv, timeout: float = 10.0) -> dict[str, float]:
    """Every per-request table of the frontend back at 0 (polled: gauges follow the
    scheduler's heartbeat)."""
    def state() -> dict[str, float]:
        scraped = scrape(srv)
        assert "candor_frontend_request_state_entries" in scraped.families, "no such gauge"
        out = {t: scraped.value("candor_frontend_request_state_entries", table=t)
               for t in ("queues", "unanswered", "timers", "finish_reasons")}
        out["inflight"] = scraped.value("candor_frontend_inflight_requests")
        return out

    return wait_until(state, "every per-request table of the frontend back at 0",
                      until=lambda s: not any(s.values()), timeout=timeout, interval=0.1)


LIMIT_CASES = [
    ("/v1/completions", {"n": MAX_N + 1}, "n"),
    ("/v1/completions", {"n": 2**70}, "n"),
    ("/v1/completions", {"prompt": ["x"] * (MAX_PROMPTS + 1)}, "prompt"),
    ("/v1/completions", {"logprobs": MAX_LOGPROBS + 1}, "logprobs"),
    ("/v1/chat/completions", {"logprobs": True, "top_logprobs": MAX_LOGPROBS + 1},
     "top_logprobs"),
    ("/v1/completions", {"stop": ["s"] * 65}, "stop"),
    ("/v1/completions", {"stop": ["s" * 1025]}, "stop"),
    ("/v1/completions", {"stop_token_ids": [1] * 1025}, "stop_token_ids"),
    ("/v1/completions", {"logit_bias": {str(i): 1 for i in range(1025)}}, "logit_bias"),
    ("/v1/chat/completions", {"messages": CHAT * 4097}, "messages"),
    ("/v1/chat/completions", {"tools": [{"type": "function"}] * 129}, "tools"),
    ("/v1/completions", {"n": MAX_N, "prompt": ["a", "b", "c"]}, "prompt"),  # 12 > share 10
]


@pytest.mark.parametrize("path, extra, param", LIMIT_CASES)
async def test_fan_out_limits_are_400_naming_field_and_limit(srv, path, extra, param):
    base = {"model": MODEL, "max_tokens": 1}
    base.update({"prompt": "x"} if path == "/v1/completions" else {"messages": CHAT})
    started = time.monotonic()
    status, _, payload = await _post(srv, path, {**base, **extra})
    err = _error(payload)
    assert status == 400 and err["param"] == param, err
    assert err["code"] in ("limit_exceeded", "invalid_value"), err
    assert time.monotonic() - started < 5
    if err["code"] == "limit_exceeded":
        assert "max_" in err["message"], err


async def test_fan_out_within_limits_is_served(srv):
    status, _, payload = await _post(srv, "/v1/completions", {
        "model": MODEL, "prompt": ["a", "b"], "n": MAX_N, "max_tokens": 1})
    assert status == 200 and len(json.loads(payload)["choices"]) == 2 * MAX_N


async def test_capabilities_publish_limits_and_foreign_field_tiers(srv):
    async with aiohttp.ClientSession() as session:
        async with session.get(srv.base_url + "/v1/capabilities") as resp:
            caps = await resp.json()
    assert caps["limits"]["max_n"] == MAX_N and caps["limits"]["max_logprobs"] == MAX_LOGPROBS
    assert caps["limits"]["max_request_share"] == 0.25
    for kind in ("/v1/chat/completions", "/v1/completions"):
        fields = caps["fields"][kind]
        assert fields["use_beam_search"] == fields["guided_whitespace_pattern"] == "rejected"
        assert fields["guided_json"] == fields["structured_outputs"] == "extension"
        assert fields["guided_decoding_backend"] == "ignored"
        assert "prompt_logprobs" not in fields or fields["prompt_logprobs"] != "rejected"


BIG = 2**70
OVERFLOW_CASES = [
    ("/v1/completions", {"max_tokens": BIG}, "max_tokens"),
    ("/v1/completions", {"seed": BIG}, "seed"),
    ("/v1/completions", {"seed": -BIG}, "seed"),
    ("/v1/completions", {"top_k": BIG}, "top_k"),
    ("/v1/completions", {"priority": BIG}, "priority"),
    ("/v1/completions", {"min_tokens": BIG}, "min_tokens"),
    ("/v1/completions", {"stop_token_ids": [BIG]}, "stop_token_ids"),
    ("/v1/completions", {"stop_token_ids": [-1]}, "stop_token_ids"),
    ("/v1/completions", {"logit_bias": {str(BIG): 1}}, "logit_bias"),
    ("/v1/completions", {"prompt": [1, BIG]}, "prompt"),
    ("/v1/completions", {"prompt": [[1], [-5]]}, "prompt"),
    ("/v1/chat/completions", {"chat_template_kwargs": {"x": BIG}}, None),
]


@pytest.mark.parametrize("path, extra, param", OVERFLOW_CASES)
async def test_integers_past_int64_are_400_and_release_the_request(srv, path, extra, param):
    base = {"model": MODEL, "max_tokens": 1}
    base.update({"prompt": "x"} if path == "/v1/completions" else {"messages": CHAT})
    status, _, payload = await _post(srv, path, {**base, **extra})
    err = _error(payload)
    assert status == 400, err
    if param is not None:
        assert err["param"].split("[")[0].split(".")[0] == param, err
    assert _tables_settle(srv) == dict.fromkeys(
        ("queues", "unanswered", "timers", "finish_reasons", "inflight"), 0)


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions", "/tokenize"])
async def test_deeply_nested_json_is_400(srv, path):
    deep = b"[" * 5000 + b"]" * 5000  # inside fields that any request may carry
    fields = (b'"prompt":"x","tool_choice":%s' if path == "/v1/completions" else
              b'"messages":[{"role":"user","content":"x"}],"chat_template_kwargs":{"x":%s}')
    body = b'{"model":"%s",%s}' % (MODEL.encode(), fields % deep)
    status, _, payload = await _post(srv, path, None, raw=body,
                                     headers={"Content-Type": "application/json"})
    err = _error(payload)
    assert status == 400 and err["code"] == "invalid_json", err


async def test_wrong_content_type_is_415_in_error_shape(srv):
    body = json.dumps({"model": MODEL, "prompt": "x", "max_tokens": 1}).encode()
    for path in ("/v1/completions", "/v1/chat/completions", "/tokenize"):
        status, _, payload = await _post(srv, path, None, raw=body,
                                         headers={"Content-Type": "text/plain"})
        assert status == 415 and _error(payload)["code"] == "unsupported_media_type"
    status, _, payload = await _post(srv, "/v1/completions", None, raw=body, headers={
        "Content-Type": "application/json; charset=utf-8"})
    assert status == 200, payload


def _raw_http(srv, request: bytes) -> tuple[int, dict, bytes]:
    with socket.create_connection(("127.0.0.1", srv.port), timeout=5) as sock:
        sock.sendall(request)
        data = b""
        while chunk := sock.recv(65536):
            data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    lines = head.decode().split("\r\n")
    headers = dict(line.split(": ", 1) for line in lines[1:])
    return int(lines[0].split()[1]), headers, body


def test_over_long_request_line_and_header_are_error_shaped(srv):
    for request in (b"GET /" + b"a" * 10000 + b" HTTP/1.1\r\nHost: x\r\n\r\n",
                    b"GET /health HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * 10000 + b"\r\n\r\n"):
        status, headers, body = _raw_http(srv, request)
        assert 400 <= status < 500
        assert headers["Content-Type"].startswith("application/json")
        assert set(json.loads(body)["error"]) == {"message", "type", "param", "code"}


@pytest.mark.parametrize("field, value", [
    ("guided_whitespace_pattern", " *"), ("use_beam_search", True), ("best_of", 2), ("regex", "a"), ("json_schema", {}),
    ("lora_request", {"lora_name": "x"}), ("truncate_prompt_tokens", 4),
    ("logits_processors", ["x"]), ("bad_words", ["a"]), ("allowed_token_ids", [1]),
    ("vllm_xargs", {"a": 1}), ("return_hidden_states", True),
    ("spaces_between_special_tokens", False), ("mm_processor_kwargs", {"do_pan_and_scan": True}),
])
async def test_fields_that_would_change_output_are_rejected(srv, field, value):
    for path, base in (("/v1/completions", {"prompt": "x"}),
                       ("/v1/chat/completions", {"messages": CHAT})):
        status, _, payload = await _post(srv, path, {"model": MODEL, "max_tokens": 1, **base,
                                                     field: value})
        err = _error(payload)
        assert status == 400 and err["param"] == field and err["code"] == "unsupported_field"


async def test_harmless_foreign_fields_are_reported_ignored(srv):
    status, _, payload = await _post(srv, "/v1/completions", {
        "model": MODEL, "prompt": "x", "max_tokens": 1, "use_beam_search": False,
        "best_of": 1, "guided_decoding_backend": "xgrammar", "length_penalty": 1.0})
    assert status == 200, payload
    ignored = [n["field"] for n in json.loads(payload)["candor"]["ignored"]]
    assert ignored == ["use_beam_search", "best_of", "guided_decoding_backend",
                       "length_penalty"]


NULLS = {"n": None, "stream": None, "temperature": None, "top_p": None, "stop": None,
         "seed": None, "user": None, "logit_bias": None, "stream_options": None,
         "frequency_penalty": None, "presence_penalty": None, "echo": None,
         "logprobs": None, "max_tokens": None, "guided_json": None, "frobnicate": None}


async def test_null_means_absent_on_both_endpoints(srv):
    for path, body in (("/v1/completions", {"prompt": "x"}),
                       ("/v1/chat/completions", {"messages": CHAT, "top_logprobs": None,
                                                 "max_completion_tokens": 2})):
        status, _, payload = await _post(srv, path, {"model": MODEL, **body, **NULLS})
        assert status == 200, payload
        out = json.loads(payload)
        assert len(out["choices"]) == 1 and out["candor"].get("ignored", []) == []


async def test_message_without_content_names_the_path(srv):
    for bad in ({"role": "user"}, {"role": "system", "content": None}):
        messages = [{"role": "system", "content": "s"}, *CHAT, bad]
        status, _, payload = await _post(srv, "/v1/chat/completions", {
            "model": MODEL, "messages": messages, "max_tokens": 1})
        assert status == 400 and _error(payload)["param"] == "messages[2].content"


def test_prompt_list_with_the_openai_sdk(srv):
    client = openai.OpenAI(base_url=srv.base_url + "/v1", api_key="x", max_retries=0)
    prompts = ["The cat", "Once upon", "1 2 3"]
    singles = [client.completions.create(model=MODEL, prompt=p, max_tokens=4, temperature=0)
               for p in prompts]
    batch = client.completions.create(model=MODEL, prompt=prompts, max_tokens=4,
                                      temperature=0, n=2)
    assert [c.index for c in batch.choices] == list(range(6))
    for p, single in enumerate(singles):
        for i in range(2):
            assert batch.choices[p * 2 + i].text == single.choices[0].text
    assert batch.usage.prompt_tokens == sum(s.usage.prompt_tokens for s in singles)
    assert batch.usage.completion_tokens == 2 * sum(s.usage.completion_tokens for s in singles)
    ids = [[1, 450, 635], [1, 903]]
    by_ids = client.completions.create(model=MODEL, prompt=ids, max_tokens=3, temperature=0.7,
                                       seed=3, n=2)
    assert len(by_ids.choices) == 4
    stream = client.completions.create(model=MODEL, prompt=prompts, max_tokens=4, temperature=0,
                                       n=2, stream=True, stream_options={"include_usage": True})
    texts: dict[int, str] = {}
    usage = None
    for chunk in stream:
        for c in chunk.choices:
            texts[c.index] = texts.get(c.index, "") + c.text
        usage = chunk.usage or usage
    assert texts == {i: batch.choices[i].text for i in range(6)}
    assert usage.prompt_tokens == batch.usage.prompt_tokens


async def test_sampled_choices_leave_no_state_behind(srv):
    for stream in (False, True):
        status, _, _ = await _post(srv, "/v1/completions", {
            "model": MODEL, "prompt": ["a", "b"], "n": 3, "max_tokens": 3, "stream": stream,
            "temperature": 1.0})
        assert status == 200
        status, _, _ = await _post(srv, "/v1/chat/completions", {
            "model": MODEL, "messages": CHAT, "n": 3, "max_tokens": 3, "stream": stream})
        assert status == 200
    assert not any(_tables_settle(srv).values())


async def test_inflight_gauge_counts_a_running_request(srv):
    async with aiohttp.ClientSession() as session:
        async with session.post(srv.base_url + "/v1/completions", json={
                "model": MODEL, "prompt": "x", "max_tokens": 400, "ignore_eos": True,
                "stream": True, "n": 2, "temperature": 1.0}) as resp:
            await resp.content.readline()
            assert scrape(srv).value("candor_frontend_inflight_requests") == 2
            await resp.read()
    assert not any(_tables_settle(srv).values())


def test_request_id_is_echoed_and_disconnects_log_one_line(srv):
    status, headers, _ = _raw_http(srv, b"GET /v1/models HTTP/1.1\r\nHost: x\r\n"
                                   b"X-Request-Id: trace-42\r\nConnection: close\r\n\r\n")
    assert status == 200 and headers["X-Request-Id"] == "trace-42"
    client = openai.OpenAI(base_url=srv.base_url + "/v1", api_key="x", max_retries=0)
    raw = client.completions.with_raw_response.create(
        model=MODEL, prompt="x", max_tokens=1, extra_headers={"X-Request-Id": "trace-43"})
    assert raw.headers["x-request-id"] == "trace-43"
    before = srv.log_path.read_text()
    body = json.dumps({"model": MODEL, "prompt": "x", "max_tokens": 500, "stream": True,
                       "ignore_eos": True}).encode()
    for linger in (False, True, True):
        sock = socket.create_connection(("127.0.0.1", srv.port))
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nX-Request-Id: gone-7\r\n"
                     b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n%s"
                     % (len(body), body))
        sock.recv(4096)
        if linger:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        sock.close()
    assert not any(_tables_settle(srv).values())
    new = srv.log_path.read_text()[len(before):]
    assert "Traceback" not in new, new
    assert new.count("gone-7") >= 1, new


async def test_sigterm_after_bad_requests_exits_fast(srv):
    for path, extra in [("/v1/completions", {"seed": BIG}),
                        ("/v1/chat/completions", {"chat_template_kwargs": {"x": BIG}})]:
        base = {"prompt": "x"} if path == "/v1/completions" else {"messages": CHAT}
        status, _, _ = await _post(srv, path, {"model": MODEL, **base, **extra})
        assert status == 400
    started = time.monotonic()
    assert srv.stop(timeout=DRAIN_S + 30) == 0
    took = time.monotonic() - started  # ~4 s on a quiet 2-core box, more under load
    assert took < DRAIN_S / 2, f"SIGTERM waited {took:.0f}s: a request stayed in flight"
    assert "drain timeout" not in srv.log_path.read_text()
