"""HTTP-level contract through real sockets: SSE framing, finish reasons, usage,
errors in OpenAI's shape, disconnects, and KV blocks returning to the free pool."""

from __future__ import annotations

import asyncio
import json

import aiohttp
import pytest

MODEL = "tiny-llama"


async def _post(server, path: str, body, raw: bool = False):
    async with aiohttp.ClientSession() as session:
        kwargs = ({"data": body, "headers": {"Content-Type": "application/json"}} if raw
                  else {"json": body})
        async with session.post(server.base_url + path, **kwargs) as resp:
            return resp.status, dict(resp.headers), await resp.read()


def _error(status: int, payload: bytes, expected_status: int) -> dict:
    assert status == expected_status, payload
    body = json.loads(payload)
    assert set(body) == {"error"}
    assert set(body["error"]) == {"message", "type", "param", "code"}
    return body["error"]


def _sse_events(payload: bytes) -> list[str]:
    text = payload.decode()
    assert text.endswith("data: [DONE]\n\n")
    frames = text.split("\n\n")
    assert frames[-1] == ""
    assert all(f.startswith("data: ") for f in frames[:-1]), frames
    return [f[len("data: "):] for f in frames[:-1]]


async def test_sse_framing_finish_length_and_usage(server):
    status, headers, payload = await _post(server, "/v1/completions", {
        "model": MODEL, "prompt": "Stream me", "max_tokens": 7, "temperature": 0,
        "stream": True, "ignore_eos": True, "return_token_ids": True,
        "stream_options": {"include_usage": True, "continuous_usage_stats": True}})
    assert status == 200 and headers["Content-Type"].startswith("text/event-stream")
    events = _sse_events(payload)
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert all(c["object"] == "text_completion" for c in chunks)
    finals = [c for c in chunks if c["choices"] and c["choices"][0]["finish_reason"]]
    assert len(finals) == 1 and finals[0]["choices"][0]["finish_reason"] == "length"
    ids = [i for c in chunks if c["choices"] for i in c["choices"][0]["token_ids"]]
    assert len(ids) == 7
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 7
    # continuous usage: every chunk carries running totals
    assert all(c["usage"] is not None for c in chunks)


async def test_finish_reason_stop_on_stop_string_is_trimmed(server):
    # find what the model says greedily, then stop on a piece of it
    status, _, payload = await _post(server, "/v1/completions", {
        "model": MODEL, "prompt": "Tell me", "max_tokens": 16, "temperature": 0,
        "ignore_eos": True, "return_token_ids": True})
    full = json.loads(payload)["choices"][0]["text"]
    assert len(full) > 6
    stop = full[3:6]
    status, _, payload = await _post(server, "/v1/completions", {
        "model": MODEL, "prompt": "Tell me", "max_tokens": 16, "temperature": 0,
        "ignore_eos": True, "stop": [stop]})
    choice = json.loads(payload)["choices"][0]
    assert choice["finish_reason"] == "stop"
    assert choice["text"] == full[:full.index(stop)]
    # streamed: the same trimmed text, never the stop string
    status, _, payload = await _post(server, "/v1/completions", {
        "model": MODEL, "prompt": "Tell me", "max_tokens": 16, "temperature": 0,
        "ignore_eos": True, "stop": stop, "stream": True})
    chunks = [json.loads(e) for e in _sse_events(payload)[:-1]]
    assert "".join(c["choices"][0]["text"] for c in chunks) == full[:full.index(stop)]
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"
    server.wait_all_blocks_free()


async def test_usage_counts_equal_tokens_produced(server):
    status, _, payload = await _post(server, "/v1/chat/completions", {
        "model": MODEL, "messages": [{"role": "user", "content": "hello"}], "max_tokens": 9,
        "temperature": 0, "return_token_ids": True})
    body = json.loads(payload)
    assert body["usage"]["completion_tokens"] == len(body["choices"][0]["token_ids"])
    assert body["usage"]["prompt_tokens"] == len(body["prompt_token_ids"])


@pytest.mark.parametrize("body, param", [
    (b"{not json", None),
    (b"[1, 2]", None),
    (json.dumps({"prompt": "x"}).encode(), "model"),
    (json.dumps({"model": MODEL, "prompt": "x", "max_tokens": "ten"}).encode(), "max_tokens"),
    (json.dumps({"model": MODEL, "prompt": "x", "temperature": 2.5}).encode(), "temperature"),
    (json.dumps({"model": MODEL, "prompt": "x", "top_p": 0}).encode(), "top_p"),
    (json.dumps({"model": MODEL, "prompt": "x", "max_tokens": 0}).encode(), "max_tokens"),
    (json.dumps({"model": MODEL, "prompt": "x", "stream_options": {"include_usage": True}}).encode(),
     "stream_options"),
    (json.dumps({"model": MODEL, "prompt": [999999]}).encode(), "prompt"),
])
async def test_invalid_completion_bodies_are_400_naming_the_field(server, body, param):
    status, _, payload = await _post(server, "/v1/completions", body, raw=True)
    err = _error(status, payload, 400)
    assert err["param"] == param, err
    assert err["type"] == "invalid_request_error"


async def test_chat_validation_errors(server):
    status, _, payload = await _post(server, "/v1/chat/completions", {
        "model": MODEL, "messages": [{"role": "wizard", "content": "x"}]})
    assert _error(status, payload, 400)["param"] == "messages[0].role"
    status, _, payload = await _post(server, "/v1/chat/completions", {
        "model": MODEL, "messages": [{"role": "user", "content": "x"}],
        "add_generation_prompt": True, "continue_final_message": True})
    assert _error(status, payload, 400)["param"] == "continue_final_message"
    status, _, payload = await _post(server, "/v1/chat/completions", {
        "model": MODEL, "messages": [{"role": "user", "content": "x"}], "n": 0})
    assert _error(status, payload, 400)["param"] == "n"


async def test_context_overflow_names_the_field_and_both_counts(server):
    for field in ("max_tokens", "max_completion_tokens"):
        status, _, payload = await _post(server, "/v1/chat/completions", {
            "model": MODEL, "messages": [{"role": "user", "content": "hi"}], field: 5000})
        err = _error(status, payload, 400)
        assert err["param"] == field and err["code"] == "context_length_exceeded"
        assert "1024" in err["message"] and "5000" in err["message"]
    status, _, payload = await _post(server, "/v1/completions", {
        "model": MODEL, "prompt": "word " * 1500, "max_tokens": 1})
    err = _error(status, payload, 400)
    assert err["code"] == "context_length_exceeded" and err["param"] == "prompt"


async def test_unknown_model_route_and_method(server):
    status, _, payload = await _post(server, "/v1/completions", {"model": "gpt-9", "prompt": "x"})
    err = _error(status, payload, 404)
    assert err["code"] == "model_not_found" and MODEL in err["message"]
    status, _, payload = await _post(server, "/v1/nothing-here", {})
    _error(status, payload, 404)
    async with aiohttp.ClientSession() as session:
        async with session.get(server.base_url + "/v1/completions") as resp:
            _error(resp.status, await resp.read(), 405)


async def test_ignored_fields_are_reported_not_dropped_silently(server):
    status, headers, _ = await _post(server, "/v1/completions", {
        "model": MODEL, "prompt": "x", "max_tokens": 1, "user": "alice", "frobnicate": 1})
    assert status == 200
    ignored = json.loads(headers["x-candor-adjustments"])["ignored"]
    assert [n["field"] for n in ignored] == ["user", "frobnicate"]


async def test_client_dropping_streams_midway_frees_blocks_and_server_keeps_serving(server):
    async def drop_after_first_chunks():
        async with aiohttp.ClientSession() as session:
            async with session.post(server.base_url + "/v1/completions", json={
                    "model": MODEL, "prompt": "Never ending", "max_tokens": 600,
                    "ignore_eos": True, "stream": True}) as resp:
                assert resp.status == 200
                got = 0
                async for _ in resp.content:
                    got += 1
                    if got >= 5:
                        break   # leaving the context manager closes the connection

    await asyncio.gather(*[drop_after_first_chunks() for _ in range(4)])
    stats = server.wait_all_blocks_free(timeout=15)
    assert stats["total_blocks"] > 0
    status, _, payload = await _post(server, "/v1/completions", {
        "model": MODEL, "prompt": "Still there?", "max_tokens": 4, "temperature": 0})
    assert status == 200 and json.loads(payload)["usage"]["completion_tokens"] >= 1


async def test_non_streaming_disconnect_aborts(server):
    async with aiohttp.ClientSession() as session:
        with pytest.raises(asyncio.TimeoutError):
            async with session.post(server.base_url + "/v1/completions", json={
                    "model": MODEL, "prompt": "long", "max_tokens": 900, "ignore_eos": True},
                    timeout=aiohttp.ClientTimeout(total=0.5)) as resp:
                await resp.read()
    server.wait_all_blocks_free(timeout=15)


async def test_health_reports_engine_state(server):
    status, body = server.health()
    assert status == 200 and body["status"] == "ok"
    assert body["engine"]["worker_ready"] is True
