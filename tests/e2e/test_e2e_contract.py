"""Knowing what happened: the candor report, render/tokenize/capabilities, error ranges and
the openai SDK's exception classes, against the shared server (default policy)."""

from __future__ import annotations

import json

import aiohttp
import openai
import pytest

MODEL = "tiny-llama"
CHAT = [{"role": "user", "content": "hi"}]


async def _post(server, path: str, body: dict):
    async with aiohttp.ClientSession() as session:
        async with session.post(server.base_url + path, json=body) as resp:
            return resp.status, dict(resp.headers), await resp.read()


async def _get(server, path: str):
    async with aiohttp.ClientSession() as session:
        async with session.get(server.base_url + path) as resp:
            return resp.status, await resp.json()


async def test_report_lists_ignored_extensions_and_template(server):
    status, headers, payload = await _post(server, "/v1/chat/completions", {
        "model": MODEL, "messages": CHAT, "max_tokens": 2, "user": "alice", "frobnicate": 1,
        "top_k": 5, "chat_template_kwargs": {"enable_thinking": False}})
    assert status == 200
    report = json.loads(payload)["candor"]
    assert json.loads(headers["x-candor-adjustments"]) == report
    assert [n["field"] for n in report["ignored"]] == [
        "user", "frobnicate", "chat_template_kwargs.enable_thinking"]
    kwarg_note = report["ignored"][2]["reason"]
    assert "enable_thinking" in kwarg_note and "bos_token" in kwarg_note  # declared variables
    assert report["extensions"] == ["top_k", "chat_template_kwargs"]
    template = report["chat_template"]
    assert template["source"] == "checkpoint" and len(template["sha256"]) == 64
    assert "x-candor-ignored-fields" not in headers


async def test_report_on_first_stream_frame_only(server):
    status, _, payload = await _post(server, "/v1/completions", {
        "model": MODEL, "prompt": "x", "max_tokens": 3, "stream": True, "suffix": "y"})
    frames = [json.loads(f[6:]) for f in payload.decode().split("\n\n") if f.startswith("data: {")]
    assert frames[0]["candor"]["ignored"][0]["field"] == "suffix"
    assert all("candor" not in f for f in frames[1:])


async def test_per_request_strict_turns_ignored_into_400(server):
    status, _, payload = await _post(server, "/v1/completions", {
        "model": MODEL, "prompt": "x", "user": "alice", "strict": True})
    err = json.loads(payload)["error"]
    assert status == 400 and err["param"] == "user" and err["code"] == "ignored_field"
    status, _, payload = await _post(server, "/v1/chat/completions", {
        "model": MODEL, "messages": CHAT, "strict": True, "chat_template_kwargs": {"nope": 1}})
    err = json.loads(payload)["error"]
    assert status == 400 and err["param"] == "chat_template_kwargs" and "nope" in err["message"]
    status, _, _ = await _post(server, "/v1/completions", {
        "model": MODEL, "prompt": "x", "max_tokens": 1, "strict": True})
    assert status == 200


async def test_request_chat_template_needs_the_server_flag(server):
    status, _, payload = await _post(server, "/v1/chat/completions", {
        "model": MODEL, "messages": CHAT, "chat_template": "{{ messages[0].content }}"})
    assert status == 400 and json.loads(payload)["error"]["param"] == "chat_template"


async def test_render_tokenize_detokenize_agree_with_generation(server):
    body = {"model": MODEL, "messages": CHAT, "max_tokens": 2, "return_token_ids": True}
    _, _, gen = await _post(server, "/v1/chat/completions", body)
    status, _, rendered = await _post(server, "/v1/chat/completions/render", body)
    rendered = json.loads(rendered)
    assert status == 200 and rendered["prompt_token_ids"] == json.loads(gen)["prompt_token_ids"]
    assert rendered["prompt"].endswith("assistant<|end_header_id|>\n\n")
    assert rendered["chat_template"]["source"] == "checkpoint"
    no_gen_prompt = json.loads((await _post(server, "/v1/chat/completions/render",
                                            {**body, "add_generation_prompt": False}))[2])
    assert not no_gen_prompt["prompt"].endswith("assistant<|end_header_id|>\n\n")
    status, _, tok = await _post(server, "/tokenize", {"messages": CHAT})
    tok = json.loads(tok)
    assert tok["tokens"] == rendered["prompt_token_ids"] and tok["max_model_len"] == 1024
    status, _, comp = await _post(server, "/v1/completions/render", {"model": MODEL,
                                                                     "prompt": "hello world"})
    ids = json.loads(comp)["prompt_token_ids"]
    status, _, detok = await _post(server, "/detokenize", {"tokens": ids})
    assert json.loads(detok)["prompt"].endswith("hello world")
    status, _, bad = await _post(server, "/detokenize", {"tokens": [10**7]})
    assert status == 400


async def test_capabilities_publish_every_tier(server):
    status, caps = await _get(server, "/v1/capabilities")
    assert status == 200 and caps["policy"]["strict"] is False
    chat = caps["fields"]["/v1/chat/completions"]
    assert chat["temperature"] == "honoured" and chat["top_k"] == "extension"
    assert chat["user"] == "ignored" and chat["tools"] == "honoured"
    assert chat["guided_json"] == "extension" and chat["response_format"] == "honoured"
    assert chat["chat_template"] == "rejected"
    assert caps["fields"]["/v1/completions"]["suffix"] == "ignored"
    for endpoint in ("/v1/chat/completions", "/v1/completions"):
        assert caps["fields"][endpoint]["cache_salt"] == "extension"


async def test_embeddings_404_says_what_is_served(server):
    status, _, payload = await _post(server, "/v1/embeddings", {"model": MODEL, "input": "x"})
    err = json.loads(payload)["error"]
    assert status == 404 and "text generation" in err["message"] and MODEL in err["message"]


@pytest.mark.parametrize("field, value", [
    ("temperature", -0.1), ("temperature", 2.01), ("top_p", 0), ("top_p", 1.1), ("n", 0),
    ("max_tokens", 0), ("presence_penalty", 2.5), ("frequency_penalty", -2.1),
    ("repetition_penalty", 0), ("top_k", -2), ("min_p", 1.5), ("min_tokens", -1),
    ("logprobs", 21), ("logit_bias", {"1": 200}), ("seed", "x"), ("stop", 3),
    ("seed", 2**64), ("max_tokens", 2**63),
])
async def test_out_of_range_values_are_400_naming_the_field(server, field, value):
    status, _, payload = await _post(server, "/v1/completions",
                                     {"model": MODEL, "prompt": "x", field: value})
    err = json.loads(payload)["error"]
    assert status == 400 and err["param"].split(".")[0] == field, err


def test_sdk_exception_classes(server):
    client = openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0)
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="nope", messages=CHAT)
    with pytest.raises(openai.NotFoundError):
        client.embeddings.create(model=MODEL, input="x")
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model=MODEL, messages=CHAT, top_p=0)
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model=MODEL, messages=CHAT, n=0)
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model=MODEL, messages=CHAT, stream_options={
            "include_usage": True})
    raw = openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0)
    with pytest.raises(openai.NotFoundError):
        raw.get("/no/such/route", cast_to=object)
    with pytest.raises(openai.APIStatusError) as err:
        raw.get("/v1/completions", cast_to=object)
    assert err.value.status_code == 405


async def test_chat_echo_prepends_the_final_assistant_message(server):
    messages = [{"role": "user", "content": "Finish my sentence."},
                {"role": "assistant", "content": "The sky is"}]
    base = {"model": "tiny-llama", "messages": messages, "max_tokens": 6, "temperature": 0,
            "add_generation_prompt": False, "continue_final_message": True}
    status, _, plain = await _post(server, "/v1/chat/completions", base)
    assert status == 200
    status, _, echoed = await _post(server, "/v1/chat/completions", {**base, "echo": True})
    assert status == 200
    plain, echoed = json.loads(plain), json.loads(echoed)
    generated = plain["choices"][0]["message"]["content"]
    assert echoed["choices"][0]["message"]["content"] == "The sky is" + generated
    # the echo is not billed as generated tokens (cached_tokens differs: a prefix-cache hit)
    for key in ("prompt_tokens", "completion_tokens", "total_tokens"):
        assert echoed["usage"][key] == plain["usage"][key]
    # streamed: the echo arrives in the first content frame, then the same generation
    async with aiohttp.ClientSession() as session:
        async with session.post(server.base_url + "/v1/chat/completions",
                                json={**base, "echo": True, "stream": True}) as resp:
            payload = (await resp.read()).decode()
    frames = [json.loads(f[6:]) for f in payload.split("\n\n") if f.startswith("data: {")]
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in frames if c["choices"])
    assert text == "The sky is" + generated
    # no echo when the last message is not the assistant's
    status, _, user_last = await _post(server, "/v1/chat/completions", {
        "model": "tiny-llama", "messages": messages[:1], "max_tokens": 3, "temperature": 0,
        "echo": True})
    user_last = json.loads(user_last)
    assert status == 200 and not user_last["choices"][0]["message"]["content"].startswith(
        "Finish my sentence.")
