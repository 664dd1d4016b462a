"""Server flags that change the contract, on a dedicated server: --max-tokens-policy clamp,
--chat-template (a string-content template), --allow-request-chat-template,
--scheduling-policy priority,
--max-body-mb, and a failure after the stream started (a fault the test injects into the
gpu_worker, tests/support/faults.py)."""

from __future__ import annotations

import json
from pathlib import Path

import aiohttp
import openai
import pytest

from tests.support.faults import fault_env
from tests.support.server import CandorServer

MODEL = "tiny-llama"
FAULT_TOKEN = 300
TEMPLATE = Path(__file__).parents[1] / "support/data/chat_templates/llama-3.2-3b-instruct.jinja"


@pytest.fixture(scope="module")
def policy_server(tiny_model_dir):
    srv = CandorServer(tiny_model_dir, "--served-model-name", MODEL, "--max-model-len", "1024",
                       "--max-tokens-policy", "clamp", "--chat-template", str(TEMPLATE),
                       "--allow-request-chat-template", "--max-body-mb", "1",
                       "--scheduling-policy", "priority", env=fault_env(FAULT_TOKEN)).start()
    yield srv
    assert srv.stop() == 0


async def _post(server, path: str, body):
    async with aiohttp.ClientSession() as session:
        kwargs = {"data": body} if isinstance(body, bytes) else {"json": body}
        async with session.post(server.base_url + path, **kwargs) as resp:
            return resp.status, dict(resp.headers), await resp.read()


async def test_clamp_policy_reports_the_clamp(policy_server):
    prompt = [7] * 1010
    status, headers, payload = await _post(policy_server, "/v1/completions", {
        "model": MODEL, "prompt": prompt, "max_tokens": 5000, "temperature": 0,
        "ignore_eos": True})
    body = json.loads(payload)
    assert status == 200, body
    assert body["usage"]["completion_tokens"] == 14
    assert body["choices"][0]["finish_reason"] == "length"
    assert body["candor"]["clamped"] == [{"field": "max_tokens", "from": 5000, "to": 14,
                                          "reason": body["candor"]["clamped"][0]["reason"]}]
    assert json.loads(headers["x-candor-adjustments"])["clamped"][0]["to"] == 14
    status, _, payload = await _post(policy_server, "/v1/completions", {
        "model": MODEL, "prompt": prompt, "max_tokens": 5000, "strict": True})
    err = json.loads(payload)["error"]
    assert status == 400 and err["code"] == "context_length_exceeded"
    status, caps = 0, None
    async with aiohttp.ClientSession() as session:
        async with session.get(policy_server.base_url + "/v1/capabilities") as resp:
            caps = await resp.json()
    assert caps["fields"]["/v1/completions"]["max_tokens"] == "clamped"
    assert caps["fields"]["/v1/chat/completions"]["chat_template"] == "extension"


async def test_template_sources_and_string_content_format(policy_server):
    parts = [{"role": "user", "content": [{"type": "text", "text": "first"},
                                          {"type": "text", "text": "second"}]}]
    joined = [{"role": "user", "content": "first\nsecond"}]
    _, _, a = await _post(policy_server, "/v1/chat/completions/render",
                          {"model": MODEL, "messages": parts})
    _, _, b = await _post(policy_server, "/v1/chat/completions/render",
                          {"model": MODEL, "messages": joined})
    a, b = json.loads(a), json.loads(b)
    assert a["chat_template"]["source"] == "server-flag"
    assert "first\nsecond" in a["prompt"] and a["prompt_token_ids"] == b["prompt_token_ids"]
    status, _, payload = await _post(policy_server, "/v1/chat/completions", {
        "model": MODEL, "messages": joined, "max_tokens": 2,
        "chat_template": "{{ bos_token }}{% for m in messages %}{{ m.content }}{% endfor %}"})
    report = json.loads(payload)["candor"]
    assert status == 200 and report["chat_template"]["source"] == "request"
    assert report["chat_template"]["origin"] == "request"


async def test_body_too_large_is_413(policy_server):
    big = json.dumps({"model": MODEL, "prompt": "x" * (2 * 2**20)}).encode()
    status, _, payload = await _post(policy_server, "/v1/completions", big)
    err = json.loads(payload)["error"]
    assert status == 413 and set(err) == {"message", "type", "param", "code"}
    client = openai.OpenAI(base_url=policy_server.base_url + "/v1", api_key="x", max_retries=0)
    with pytest.raises(openai.APIStatusError) as exc:
        client.completions.create(model=MODEL, prompt="x" * (2 * 2**20))
    assert exc.value.status_code == 413


async def test_failure_after_stream_started_is_an_error_frame_then_done(policy_server):
    # the first sampled token is forced to FAULT_TOKEN; feeding it back makes the step fail
    status, headers, payload = await _post(policy_server, "/v1/completions", {
        "model": MODEL, "prompt": [10, 20, 30], "max_tokens": 5, "stream": True,
        "logit_bias": {str(FAULT_TOKEN): 100}, "return_token_ids": True})
    assert status == 200
    frames = [f[len("data: "):] for f in payload.decode().split("\n\n") if f]
    assert frames[-1] == "[DONE]"
    error = json.loads(frames[-2])
    assert set(error) == {"error"} and error["error"]["type"] == "internal_error"
    firsts = [json.loads(f) for f in frames[:-2]]
    assert firsts and firsts[0]["choices"][0]["token_ids"] == [FAULT_TOKEN]
    policy_server.wait_all_blocks_free()
    status, _, payload = await _post(policy_server, "/v1/completions", {
        "model": MODEL, "prompt": [10, 20, 30], "max_tokens": 3})
    assert status == 200  # the worker survived


_TEMPLATES = Path(__file__).parents[1] / "support/data/chat_templates"
_CASES = {c["id"]: c for c in json.loads((_TEMPLATES / "cases.json").read_text())["cases"]}
# templates that concatenate tool-call arguments as text (an object would fail them)
_TEXT_ARGUMENTS = {"deepseek-v3.1", "deepseek-r1-distill-llama-8b"}


@pytest.mark.parametrize("stem", sorted(p.stem for p in _TEMPLATES.glob("*.jinja")))
async def test_tool_call_arguments_reach_the_template_as_it_reads_them(policy_server, hf_model,
                                                                       stem):
    """An earlier turn's arguments come back as the JSON text the API returned (the SDK's
    wire format); the template gets what transformers' convention gives it, an object
    (Qwen2.5 / Llama 3.x would otherwise write them JSON-encoded twice), except where it
    only concatenates them as text (DeepSeek). Rendered through the real render route with
    the template sent in the request, compared with transformers on the same tokenizer."""
    source = (_TEMPLATES / f"{stem}.jinja").read_text(encoding="utf-8")
    wire, objects = _CASES["tool_call_string_args"], _CASES["tool_call_dict_args"]
    reference = wire if stem in _TEXT_ARGUMENTS else objects
    tok = hf_model[1]
    try:
        expected = tok.apply_chat_template(reference["messages"], tools=reference["tools"],
                                           chat_template=source, tokenize=False,
                                           add_generation_prompt=True)
    except Exception:  # noqa: BLE001 - a template without tool support: nothing to compare
        pytest.skip(f"transformers cannot render {stem} with tool calls")
    status, _, payload = await _post(policy_server, "/v1/chat/completions/render", {
        "model": MODEL, "messages": wire["messages"], "tools": wire["tools"],
        "chat_template": source})
    assert status == 200, payload
    assert json.loads(payload)["prompt"] == expected
    if stem in ("qwen2.5-7b-instruct", "llama-3.2-3b-instruct", "llama-3.3-70b-instruct"):
        double = tok.apply_chat_template(wire["messages"], tools=wire["tools"],
                                         chat_template=source, tokenize=False,
                                         add_generation_prompt=True)
        assert double != expected and '\\"location\\"' in double  # not a vacuous check


async def test_tool_call_arguments_that_are_no_json_object_are_a_400(policy_server):
    messages = [dict(m) for m in _CASES["tool_call_string_args"]["messages"]]
    call = messages[1]["tool_calls"][0]
    source = (_TEMPLATES / "qwen2.5-7b-instruct.jinja").read_text(encoding="utf-8")
    for bad in ("{not json", "[1, 2]"):
        messages[1] = {**messages[1], "tool_calls": [
            {**call, "function": {**call["function"], "arguments": bad}}]}
        status, _, payload = await _post(policy_server, "/v1/chat/completions", {
            "model": MODEL, "messages": messages, "max_tokens": 2, "chat_template": source})
        err = json.loads(payload)["error"]
        assert status == 400 and err["param"] == "messages[1].tool_calls[0].function.arguments"


async def _capabilities(server) -> dict:
    async with aiohttp.ClientSession() as session:
        async with session.get(server.base_url + "/v1/capabilities") as resp:
            return await resp.json()


@pytest.mark.parametrize("path,body", [
    ("/v1/completions", {"prompt": "Hi"}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}]})])
async def test_priority_needs_the_priority_scheduling_policy(server, policy_server, path, body):
    """As vLLM: a non-zero `priority` is a 400 naming it unless the deployment runs
    `--scheduling-policy priority` (fcfs, the default, serves in arrival order, so no
    client can jump the queue); where it is on, it is bounded to 32 bits."""
    body = {"model": MODEL, "max_tokens": 1, **body}
    status, _, payload = await _post(server, path, {**body, "priority": -5})
    err = json.loads(payload)["error"]
    assert status == 400 and err["param"] == "priority", err
    assert "--scheduling-policy priority" in err["message"]
    for srv in (server, policy_server):  # the value: past the bound everywhere
        status, _, payload = await _post(srv, path, {**body, "priority": -(2**63)})
        assert status == 400 and json.loads(payload)["error"]["param"] == "priority"
    for priority in (0, -(2**31), 2**31 - 1):
        expected = (200 if priority == 0 else 400, 200)
        for srv, want in zip((server, policy_server), expected):
            status, _, payload = await _post(srv, path, {**body, "priority": priority})
            assert status == want, (srv is server, priority, payload)
    for priority in (-(2**31) - 1, 2**31):
        status, _, payload = await _post(policy_server, path, {**body, "priority": priority})
        assert status == 400 and json.loads(payload)["error"]["param"] == "priority"
    status, _, payload = await _post(policy_server, path, {**body, "priority": 3})
    assert "priority" in json.loads(payload)["candor"]["extensions"]
    fcfs, priority = await _capabilities(server), await _capabilities(policy_server)
    assert fcfs["policy"]["scheduling_policy"] == "fcfs"
    assert priority["policy"]["scheduling_policy"] == "priority"
    assert fcfs["fields"][path]["priority"] == "rejected"
    assert priority["fields"][path]["priority"] == "extension"
