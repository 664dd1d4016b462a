"""``/v1/messages`` (Anthropic's Messages API) through real servers: the ``anthropic`` SDK
(create, stream, a tool round trip, count_tokens, the beta client), LangChain's
ChatAnthropic (invoke, stream, bind_tools) and raw HTTP for the event order, the error shape
and the API key headers.

Two servers: ``tools_server`` renders with Qwen2.5's template (Hermes-style
``<tool_call>`` tools, read by the hermes tool parser) and takes an API key; ``thinking_server`` renders with the DeepSeek-R1 template
and the deepseek_r1 reasoning parser (the template opens ``<think>`` and random weights
never close it, so every reply there is reasoning unless thinking is switched off).
"""

from __future__ import annotations

import functools
import json
import operator
import urllib.error
import urllib.request
from pathlib import Path

import anthropic
import jsonschema
import pytest

from tests.support.server import CandorServer

MODEL = "tiny-llama"
KEY = "sk-messages-test"
TEMPLATES = Path("/work/shared/templates")
if not TEMPLATES.is_dir():
    TEMPLATES = Path(__file__).parents[1] / "support/data/chat_templates"
WEATHER = {"type": "object", "properties": {
    "city": {"type": "string", "enum": ["Paris", "Rome"]},
    "days": {"type": "integer", "minimum": 1, "maximum": 7}},
    "required": ["city", "days"], "additionalProperties": False}
TOOLS = [{"name": "get_weather", "description": "weather in a city", "input_schema": WEATHER}]
# the SDK (2.x) has no sampling parameters; older clients send them, and Candor takes them
GREEDY = {"extra_body": {"temperature": 0}}
SYSTEM = ("You are a weather assistant. Answer in one short sentence, name the city, and "
          "never invent a forecast you were not given by a tool.")


@pytest.fixture(scope="module")
def tools_server(tiny_model_dir):
    srv = CandorServer(tiny_model_dir, "--served-model-name", MODEL, "--max-model-len", "1024",
                       "--chat-template", str(TEMPLATES / "qwen2.5-7b-instruct.jinja"),
                       "--api-key", KEY).start()
    yield srv
    assert srv.stop() == 0


@pytest.fixture(scope="module")
def thinking_server(tiny_model_dir):
    srv = CandorServer(tiny_model_dir, "--served-model-name", MODEL, "--max-model-len", "1024",
                       "--chat-template", str(TEMPLATES / "deepseek-r1-distill-llama-8b.jinja"),
                       "--reasoning-parser", "deepseek_r1").start()
    yield srv
    assert srv.stop() == 0


@pytest.fixture(scope="module")
def client(tools_server):
    return anthropic.Anthropic(base_url=tools_server.base_url, api_key=KEY, max_retries=0)


def _post(base_url: str, path: str, body: dict | bytes, headers: dict | None = None,
          method: str = "POST") -> tuple[int, dict, str]:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    req = urllib.request.Request(base_url + path, data if method == "POST" else None,
                                 {"Content-Type": "application/json", **(headers or {})},
                                 method=method)
    try:
        with urllib.request.urlopen(req, timeout=120) as resp:
            return resp.status, dict(resp.headers), resp.read().decode()
    except urllib.error.HTTPError as err:
        return err.code, dict(err.headers), err.read().decode()


def sse_events(text: str) -> list[dict]:
    """Every event of a Messages stream; each ``event:`` line names its data's type."""
    out = []
    for block in text.split("\n\n"):
        if not block.strip():
            continue
        lines = dict(line.split(": ", 1) for line in block.split("\n"))
        data = json.loads(lines["data"])
        assert lines["event"] == data["type"], block
        out.append(data)
    return out


def check_event_order(events: list[dict]) -> None:
    """Anthropic's order: message_start, then blocks each started, grown and stopped
    before the next (pings anywhere), then message_delta and message_stop."""
    types = [e["type"] for e in events if e["type"] != "ping"]
    assert types[0] == "message_start" and types[-2:] == ["message_delta", "message_stop"]
    open_index, next_index = None, 0
    for e in events[1:-2]:
        t = e["type"]
        if t == "content_block_start":
            assert open_index is None and e["index"] == next_index
            open_index, next_index = e["index"], next_index + 1
        elif t == "content_block_delta":
            assert e["index"] == open_index
        elif t == "content_block_stop":
            assert e["index"] == open_index
            open_index = None
        else:
            assert t == "ping", t
    assert open_index is None


def _auth() -> dict:
    return {"x-api-key": KEY}


def test_create_and_stream_agree_in_anthropics_event_order(tools_server, client):
    """The SDK's create and its stream helper build the same message; the raw events come
    in Anthropic's order and their text deltas add up to the text; the limit reached is
    stop_reason max_tokens."""
    kwargs = dict(model=MODEL, max_tokens=12, **GREEDY, system=SYSTEM,
                  messages=[{"role": "user", "content": "Tell me about Paris."}])
    whole = client.messages.create(**kwargs)
    assert whole.type == "message" and whole.role == "assistant" and whole.model == MODEL
    assert whole.stop_reason == "max_tokens" and whole.usage.output_tokens == 12
    assert [b.type for b in whole.content] == ["text"] and whole.content[0].text
    assert whole.usage.input_tokens + whole.usage.cache_read_input_tokens > 0
    with client.messages.stream(**kwargs) as stream:
        final = stream.get_final_message()
    assert final.content[0].text == whole.content[0].text
    assert final.stop_reason == "max_tokens" and final.usage.output_tokens == 12
    raw = {k: v for k, v in kwargs.items() if k != "extra_body"}
    status, headers, text = _post(tools_server.base_url, "/v1/messages",
                                  {**raw, "temperature": 0, "stream": True}, _auth())
    assert status == 200 and headers["Content-Type"].startswith("text/event-stream")
    events = sse_events(text)
    check_event_order(events)
    assert events[1]["type"] == "ping"
    start = events[0]["message"]
    assert start["content"] == [] and start["stop_reason"] is None
    assert start["usage"]["output_tokens"] <= 12 and "candor" in start
    assert "".join(e["delta"]["text"] for e in events if e["type"] == "content_block_delta"
                   ) == whole.content[0].text
    assert events[-2]["delta"]["stop_reason"] == "max_tokens"
    assert events[-2]["usage"]["output_tokens"] == 12


def test_count_tokens_equals_the_prompt_a_create_runs(client):
    """count_tokens counts the prompt a create runs (input + cache_read, however much the
    prefix cache served); the second identical create is served partly from the prefix
    cache, which cache_read_input_tokens reports; cache_control breakpoints are taken."""
    system = [{"type": "text", "text": SYSTEM * 3, "cache_control": {"type": "ephemeral"}}]
    messages = [{"role": "user", "content": [{"type": "text", "text": "Weather in Rome?",
                                              "cache_control": {"type": "ephemeral"}}]}]
    counted = client.messages.count_tokens(model=MODEL, system=system, messages=messages,
                                           tools=TOOLS)
    assert counted.input_tokens > 50
    runs = [client.messages.create(model=MODEL, max_tokens=2, **GREEDY, system=system,
                                   messages=messages, tools=TOOLS) for _ in range(2)]
    for run in runs:
        assert run.usage.input_tokens + run.usage.cache_read_input_tokens == counted.input_tokens
        assert run.usage.cache_creation_input_tokens == 0
    assert runs[1].usage.cache_read_input_tokens > 0
    no_tools = client.messages.count_tokens(model=MODEL, system=system, messages=messages)
    assert no_tools.input_tokens < counted.input_tokens  # the template renders the tools


def test_tool_round_trip_with_the_anthropic_sdk(tools_server, client):
    """tool_choice tool (and any) is a constrained call: a tool_use block whose input is
    the schema's object, stop_reason tool_use, the streamed input_json_delta fragments
    parsing to the same input; then tool_result in the next user turn renders as chat's
    tool message (count_tokens equals the chat render of the same conversation)."""
    ask = [{"role": "user", "content": "What is the weather in a city?"}]
    kwargs = dict(model=MODEL, max_tokens=200, **GREEDY, tools=TOOLS, messages=ask)
    first = client.messages.create(**kwargs, tool_choice={"type": "tool", "name": "get_weather"})
    assert first.stop_reason == "tool_use", first
    call = first.content[-1]
    assert call.type == "tool_use" and call.name == "get_weather"
    assert call.input["city"] in ("Paris", "Rome") and 1 <= call.input["days"] <= 7
    assert first.model_extra["candor"]["constraint"] == "tool_choice"
    anyone = client.messages.create(**kwargs, tool_choice={"type": "any"})
    assert anyone.stop_reason == "tool_use" and anyone.content[-1].type == "tool_use"
    raw = {k: v for k, v in kwargs.items() if k != "extra_body"}
    status, _, text = _post(tools_server.base_url, "/v1/messages",
                            {**raw, "temperature": 0, "stream": True,
                             "tool_choice": {"type": "tool", "name": "get_weather"}}, _auth())
    events = sse_events(text)
    check_event_order(events)
    starts = [e for e in events if e["type"] == "content_block_start"]
    assert starts[-1]["content_block"]["type"] == "tool_use"
    assert starts[-1]["content_block"]["input"] == {}
    partial = "".join(e["delta"]["partial_json"] for e in events
                      if e["type"] == "content_block_delta"
                      and e["delta"]["type"] == "input_json_delta")
    assert json.loads(partial) == call.input
    assert events[-2]["delta"]["stop_reason"] == "tool_use"

    result = {"type": "tool_result", "tool_use_id": call.id,
              "content": [{"type": "text", "text": "Sunny, 24 C"}]}
    turns = [*ask, {"role": "assistant", "content": [b.model_dump() for b in first.content]},
             {"role": "user", "content": [result, {"type": "text", "text": "Thanks. Summary?"}]}]
    second = client.messages.create(model=MODEL, max_tokens=8, **GREEDY, tools=TOOLS,
                                    messages=turns)
    assert second.stop_reason in ("max_tokens", "end_turn") and second.content
    counted = client.messages.count_tokens(model=MODEL, tools=TOOLS, messages=turns)
    assert second.usage.input_tokens + second.usage.cache_read_input_tokens == counted.input_tokens
    chat_call = {"id": call.id, "type": "function",
                 "function": {"name": call.name, "arguments": json.dumps(call.input)}}
    chat_body = {"model": MODEL, "tools": [{"type": "function", "function": {
        "name": "get_weather", "description": "weather in a city", "parameters": WEATHER}}],
        "messages": [*ask, {"role": "assistant", "content": "".join(
            b.text for b in first.content if b.type == "text") or None,
            "tool_calls": [chat_call]},
            {"role": "tool", "tool_call_id": call.id, "content": "Sunny, 24 C"},
            {"role": "user", "content": [{"type": "text", "text": "Thanks. Summary?"}]}]}
    status, _, text = _post(tools_server.base_url, "/v1/chat/completions/render", chat_body,
                            _auth())
    assert status == 200, text
    rendered = json.loads(text)
    assert "Sunny, 24 C" in rendered["prompt"]
    assert len(rendered["prompt_token_ids"]) == counted.input_tokens


def test_stop_sequence_is_named(client):
    """A stop sequence the greedy reply reaches ends it: stop_reason stop_sequence, the
    sequence named, the text up to it (as Anthropic, without it); whole and streamed."""
    kwargs = dict(model=MODEL, **GREEDY, messages=[{"role": "user", "content": "Go on."}])
    free = client.messages.create(max_tokens=16, **kwargs).content[0].text
    stop = next(free[i:i + 3] for i in range(2, len(free) - 3) if free[i:i + 3].strip())
    stopped = client.messages.create(max_tokens=16, stop_sequences=["never-there", stop],
                                     **kwargs)
    assert stopped.stop_reason == "stop_sequence" and stopped.stop_sequence == stop
    assert stopped.content[0].text == free[:free.index(stop)]
    with client.messages.stream(max_tokens=16, stop_sequences=[stop], **kwargs) as stream:
        final = stream.get_final_message()
    assert (final.stop_reason, final.stop_sequence) == ("stop_sequence", stop)
    ended = client.messages.create(max_tokens=16, stop_sequences=["never-there"], **kwargs)
    assert ended.stop_reason == "max_tokens" and ended.stop_sequence is None


def test_tool_choice_none_and_explicit_auto(tools_server, client):
    """tool_choice none keeps the tools in the prompt (count_tokens counts them, as
    Anthropic prices none like auto) and gives no tool_use block, whole or streamed:
    stop_reason end_turn or max_tokens; with the same greedy prompt its text is auto's
    (but for the leading whitespace a tool parser drops).
    An explicit {"type": "auto"} is the default's request (same text, same usage), with
    disable_parallel_tool_use taken too."""
    ask = [{"role": "user", "content": "What is the weather in Rome for two days?"}]
    kwargs = dict(model=MODEL, max_tokens=16, **GREEDY, tools=TOOLS, messages=ask)
    default = client.messages.create(**kwargs)
    auto = client.messages.create(**kwargs, tool_choice={"type": "auto"})
    parallel_off = client.messages.create(**kwargs, tool_choice={
        "type": "auto", "disable_parallel_tool_use": True})
    assert [b.type for b in default.content] == ["text"], default  # no call to compare with
    for reply in (auto, parallel_off):
        assert reply.content == default.content and reply.stop_reason == default.stop_reason
        assert reply.usage.output_tokens == default.usage.output_tokens
    none = client.messages.create(**kwargs, tool_choice={"type": "none"})
    assert none.stop_reason in ("end_turn", "max_tokens"), none
    assert [b.type for b in none.content] == ["text"]
    # (a tool parser drops content's leading whitespace, as on chat; none runs no parser)
    assert none.content[0].text.lstrip() == default.content[0].text
    counted = client.messages.count_tokens(model=MODEL, tools=TOOLS, messages=ask,
                                           tool_choice={"type": "none"})
    assert none.usage.input_tokens + none.usage.cache_read_input_tokens == counted.input_tokens
    assert counted.input_tokens > client.messages.count_tokens(model=MODEL, messages=ask).input_tokens
    raw = {k: v for k, v in kwargs.items() if k != "extra_body"}
    status, _, text = _post(tools_server.base_url, "/v1/messages",
                            {**raw, "temperature": 0, "stream": True,
                             "tool_choice": {"type": "none"}}, _auth())
    assert status == 200, text
    events = sse_events(text)
    check_event_order(events)
    assert {e["content_block"]["type"] for e in events if e["type"] == "content_block_start"} == {"text"}
    assert events[-2]["delta"]["stop_reason"] in ("end_turn", "max_tokens")


def test_top_k_and_top_p_are_honoured(tools_server, client):
    """top_k 1 at temperature 1 is greedy, and so is a nucleus (top_p) too small to hold
    a second token, whole and streamed; unrestricted, temperature 1 samples (a run that
    differs from greedy). Anthropic has no seed, so a sampled reply is not reproducible;
    these are the cut-offs' own checks."""
    kwargs = dict(model=MODEL, max_tokens=12, messages=[{"role": "user", "content": "Go on."}])
    greedy = client.messages.create(**kwargs, **GREEDY).content[0].text
    for cut in ({"top_k": 1}, {"top_p": 1e-6}, {"top_k": 5, "top_p": 1e-6}):
        body = {"extra_body": {"temperature": 1.0, **cut}}
        assert client.messages.create(**kwargs, **body).content[0].text == greedy, cut
        with client.messages.stream(**kwargs, **body) as stream:
            assert stream.get_final_message().content[0].text == greedy, cut
    sampled = [client.messages.create(**kwargs, extra_body={"temperature": 1.0, "top_p": 1.0})
               .content[0].text for _ in range(3)]
    assert any(text != greedy for text in sampled), sampled
    status, _, text = _post(tools_server.base_url, "/v1/messages",
                            {**kwargs, "temperature": 1.0, "top_p": 1.5}, _auth())
    assert "top_p" in _anthropic_error(status, text, "invalid_request_error")["message"]


def test_output_config_format_constrains_the_text(tools_server, client):
    """output_config.format (structured outputs) is chat's json_schema response_format:
    constrained decoding, reported as the constraint under this API's name; a text that
    ends is an object of the schema."""
    reply = client.messages.create(model=MODEL, max_tokens=60, **GREEDY,
                                   messages=[{"role": "user", "content": "Weather as JSON."}],
                                   output_config={"format": {"type": "json_schema",
                                                             "schema": WEATHER}})
    text = reply.content[0].text
    assert text.startswith("{"), text
    assert reply.model_extra["candor"]["constraint"] == "output_config.format.schema"
    if reply.stop_reason == "end_turn":
        jsonschema.validate(json.loads(text), WEATHER)
    got, _, text = _post(tools_server.base_url, "/v1/messages", {
        "model": MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": "x"}],
        "output_config": {"format": {"type": "json_schema", "schema": {"type": 7}}}}, _auth())
    assert got == 400
    assert "output_config.format" in _anthropic_error(got, text, "invalid_request_error")[
        "message"]


def test_thinking_blocks_from_the_reasoning_parser(thinking_server):
    """thinking enabled: the reasoning parser's text is a thinking block (thinking_delta
    events when streamed); disabled: the template's switch is off and the reply is text;
    budget_tokens is reported as ignored."""
    client = anthropic.Anthropic(base_url=thinking_server.base_url, api_key="unused",
                                 max_retries=0)
    kwargs = dict(model=MODEL, max_tokens=10, **GREEDY,
                  messages=[{"role": "user", "content": "Think first."}])
    thought = client.messages.create(**kwargs, thinking={"type": "enabled",
                                                         "budget_tokens": 1024})
    assert [b.type for b in thought.content] == ["thinking"]
    assert thought.content[0].thinking and thought.content[0].signature == ""
    assert thought.usage.output_tokens_details.thinking_tokens == 10  # all of it reasoning
    report = thought.model_extra["candor"]
    assert report["reasoning_parser"] == "deepseek_r1"
    assert "thinking.budget_tokens" in {n["field"] for n in report["ignored"]}
    with client.messages.stream(**kwargs, thinking={"type": "enabled",
                                                    "budget_tokens": 1024}) as stream:
        events = list(stream)
        final = stream.get_final_message()
    assert final.content[0].thinking == thought.content[0].thinking
    assert any(e.type == "content_block_delta" and e.delta.type == "thinking_delta"
               for e in events)
    plain = client.messages.create(**kwargs, thinking={"type": "disabled"})
    assert [b.type for b in plain.content] == ["text"]
    assert "reasoning_parser" not in plain.model_extra["candor"]
    # a thinking block sent back is the assistant turn's reasoning_content
    again = client.messages.create(
        model=MODEL, max_tokens=2, **GREEDY,
        messages=[*kwargs["messages"],
                  {"role": "assistant", "content": [b.model_dump() for b in thought.content]
                   + [{"type": "text", "text": "Done."}]},
                  {"role": "user", "content": "And?"}])
    assert again.content


def test_chat_usage_counts_reasoning_tokens(thinking_server):
    """Item 4: chat's usage.completion_tokens_details.reasoning_tokens counts what the
    reasoning parser split off (here every token), whole and in the streamed usage."""
    body = {"model": MODEL, "max_tokens": 10, "temperature": 0,
            "messages": [{"role": "user", "content": "Think first."}]}
    status, _, text = _post(thinking_server.base_url, "/v1/chat/completions", body)
    whole = json.loads(text)
    assert status == 200 and whole["choices"][0]["message"]["reasoning_content"]
    assert whole["usage"]["completion_tokens_details"] == {"reasoning_tokens": 10}
    status, _, text = _post(thinking_server.base_url, "/v1/chat/completions",
                            {**body, "stream": True, "stream_options": {"include_usage": True}})
    frames = [json.loads(line[6:]) for line in text.split("\n")
              if line.startswith("data: {")]
    assert frames[-1]["usage"]["completion_tokens_details"] == {"reasoning_tokens": 10}
    off = {**body, "chat_template_kwargs": {"thinking": False}}
    status, _, text = _post(thinking_server.base_url, "/v1/chat/completions", off)
    assert "completion_tokens_details" not in json.loads(text)["usage"]


def _anthropic_error(status: int, text: str, kind: str) -> dict:
    body = json.loads(text)
    assert body["type"] == "error" and set(body) == {"type", "error"}, body
    assert set(body["error"]) == {"type", "message"} and body["error"]["type"] == kind, body
    return body["error"]


@pytest.mark.parametrize("body, status, kind, named", [
    ({"messages": [{"role": "user", "content": "hi"}]}, 400, "invalid_request_error",
     "max_tokens"),
    ({"max_tokens": 4, "messages": [{"role": "system", "content": "hi"}]}, 400,
     "invalid_request_error", "messages[0].role"),
    ({"max_tokens": 4, "messages": [{"role": "user", "content": "hi"}], "tools": TOOLS,
      "tool_choice": {"type": "sometimes"}}, 400, "invalid_request_error", "tool_choice"),
    ({"max_tokens": 4, "messages": [{"role": "user", "content": "hi"}],
      "tool_choice": {"type": "any"}}, 400, "invalid_request_error", "tool_choice"),
    ({"max_tokens": 4, "messages": [{"role": "user", "content": "hi"}], "tools": TOOLS,
      "tool_choice": {"type": "tool", "name": "nope"}}, 400, "invalid_request_error",
     "tool_choice"),
    ({"max_tokens": 4, "messages": [{"role": "user", "content": [
        {"type": "image", "source": {"type": "base64", "data": "x"}}]}]}, 400,
     "invalid_request_error", "messages[0].content[0].type"),
    ({"max_tokens": 4, "messages": [{"role": "user", "content": "hi"}],
      "tools": [{"type": "web_search_20250305", "name": "web_search"}]}, 400,
     "invalid_request_error", "tools[0].type"),
    ({"max_tokens": 4, "temperature": 1.5, "messages": [{"role": "user", "content": "hi"}]},
     400, "invalid_request_error", "temperature"),
    ({"max_tokens": 4000, "messages": [{"role": "user", "content": "hi"}]}, 400,
     "invalid_request_error", "max_tokens"),
    ({"max_tokens": 4, "messages": [{"role": "user", "content": "hi"}],
      "mcp_servers": [{"url": "http://x"}]}, 400, "invalid_request_error", "mcp_servers"),
    ({"model": "nope", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]},
     404, "not_found_error", "nope"),
])
def test_errors_are_4xx_in_anthropics_shape(tools_server, client, body, status, kind, named):
    """Bad input is a 4xx in Anthropic's error shape whose message names the field, from
    raw HTTP and as the SDK's typed exceptions."""
    got, _, text = _post(tools_server.base_url, "/v1/messages", {"model": MODEL, **body},
                         _auth())
    assert got == status, text
    assert named in _anthropic_error(got, text, kind)["message"]
    with pytest.raises(anthropic.APIStatusError) as caught:  # the SDK's own parsing of it
        client.post("/v1/messages", body={"model": MODEL, **body},
                    cast_to=anthropic.types.Message)
    assert caught.value.status_code == status and caught.value.body["error"]["type"] == kind


def test_error_shape_covers_the_routes_own_refusals(tools_server):
    """Errors raised before the handler (the API key, a bad body, the method) take the
    same shape on these routes; the other routes keep OpenAI's."""
    url = tools_server.base_url
    ok = {"model": MODEL, "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]}
    got, _, text = _post(url, "/v1/messages", ok)
    assert got == 401
    assert "x-api-key" in _anthropic_error(got, text, "authentication_error")["message"]
    got, _, text = _post(url, "/v1/messages/count_tokens", b"{not json", _auth())
    assert got == 400 and _anthropic_error(got, text, "invalid_request_error")
    got, _, text = _post(url, "/v1/messages", b"", _auth(), method="GET")
    assert got == 405 and _anthropic_error(got, text, "invalid_request_error")
    got, _, text = _post(url, "/v1/chat/completions", {"model": MODEL})
    assert got == 401 and set(json.loads(text)["error"]) == {"message", "type", "param", "code"}


def test_x_api_key_and_bearer_both_authenticate(tools_server):
    """x-api-key (Anthropic's header) and Authorization: Bearer both carry the key, on
    every protected route; a wrong key is a 401."""
    url = tools_server.base_url
    ok = {"model": MODEL, "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]}
    assert _post(url, "/v1/messages", ok, {"x-api-key": KEY})[0] == 200
    assert _post(url, "/v1/messages", ok, {"Authorization": f"Bearer {KEY}"})[0] == 200
    assert _post(url, "/v1/chat/completions", ok, {"x-api-key": KEY})[0] == 200
    got, _, text = _post(url, "/v1/messages", ok, {"x-api-key": "wrong"})
    assert got == 401 and _anthropic_error(got, text, "authentication_error")


def test_ignored_fields_are_reported(tools_server, client):
    """metadata.user_id, service_tier and unknown fields are reported as ignored (strict:
    a 400 naming the first); ?beta=true (the SDK's beta client) is the same route."""
    reply = client.messages.create(model=MODEL, max_tokens=2, metadata={"user_id": "u-1"},
                                   service_tier="auto", extra_body={"mystery": 1},
                                   output_config={"effort": "high"}, speed="fast",
                                   messages=[{"role": "user", "content": "hi"}])
    ignored = {n["field"] for n in reply.model_extra["candor"]["ignored"]}
    assert {"metadata.user_id", "service_tier", "mystery", "output_config.effort",
            "speed"} <= ignored
    got, _, text = _post(tools_server.base_url, "/v1/messages",
                         {"model": MODEL, "max_tokens": 2, "strict": True,
                          "metadata": {"user_id": "u-1"},
                          "messages": [{"role": "user", "content": "hi"}]}, _auth())
    assert got == 400 and "metadata.user_id" in _anthropic_error(
        got, text, "invalid_request_error")["message"]
    beta = client.beta.messages.create(model=MODEL, max_tokens=2,
                                       messages=[{"role": "user", "content": "hi"}])
    assert beta.usage.output_tokens == 2


def test_unknown_fields_inside_objects_are_reported(tools_server, client):
    """A field inside an object the request's types do not have (metadata's, a block's,
    a tool's) is reported as ignored by its path, as a top-level one is (strict: a 400
    naming it); a tool's input_schema and a sent-back block's nulls are not."""
    messages = [{"role": "user", "content": [{"type": "text", "text": "hi", "lang": "en"}]}]
    reply = client.messages.create(model=MODEL, max_tokens=2, messages=messages,
                                   metadata={"user_id": "u-1", "tenant": "t"},
                                   tools=[{**TOOLS[0], "color": "red"}])
    ignored = {n["field"] for n in reply.model_extra["candor"]["ignored"]}
    assert {"metadata.tenant", "messages[0].content[0].lang", "tools[0].color"} <= ignored
    assert not {f for f in ignored if "input_schema" in f}
    got, _, text = _post(tools_server.base_url, "/v1/messages",
                         {"model": MODEL, "max_tokens": 2, "strict": True,
                          "thinking": {"type": "disabled", "depth": 1},
                          "messages": [{"role": "user", "content": "hi"}]}, _auth())
    assert got == 400 and "thinking.depth" in _anthropic_error(
        got, text, "invalid_request_error")["message"]
    call = {"type": "tool_use", "id": "toolu_1", "name": "get_weather",
            "input": {"city": "Paris", "days": 1}, "caller": None, "toolset_name": None}
    turns = [{"role": "user", "content": "Weather?"},
             {"role": "assistant", "content": [call]},
             {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1",
                                           "content": "Sunny"}]}]
    back = client.messages.create(model=MODEL, max_tokens=2, messages=turns, tools=TOOLS)
    assert back.model_extra["candor"].get("ignored", []) == []  # (empty lists are omitted)


def _chat_anthropic(tools_server, **kwargs):
    """LangChain's ChatAnthropic on the local server (no network: base_url is it)."""
    from langchain_anthropic import ChatAnthropic

    return ChatAnthropic(base_url=tools_server.base_url, api_key=KEY, model=MODEL,
                         max_retries=0, **kwargs)


def test_langchain_chat_anthropic_invoke_and_stream_match_the_sdk(tools_server, client):
    """ChatAnthropic's invoke (greedy) gives the SDK's create's text for the same
    messages, with its usage; its .stream() chunks join to the same text."""
    from langchain_core.messages import HumanMessage, SystemMessage

    sdk = client.messages.create(model=MODEL, max_tokens=12, **GREEDY, system=SYSTEM,
                                 messages=[{"role": "user", "content": "Tell me about Paris."}])
    llm = _chat_anthropic(tools_server, max_tokens=12, temperature=0)
    messages = [SystemMessage(SYSTEM), HumanMessage("Tell me about Paris.")]
    reply = llm.invoke(messages)
    assert reply.content == sdk.content[0].text and reply.content
    assert reply.response_metadata["stop_reason"] == "max_tokens"
    assert reply.usage_metadata["output_tokens"] == 12
    # every field ChatAnthropic sends is one Candor honours (empty lists are omitted)
    assert reply.response_metadata["candor"].get("ignored", []) == []
    chunks = list(llm.stream(messages))
    assert len(chunks) > 1
    joined = functools.reduce(operator.add, chunks)  # LangChain's own chunk merging
    assert joined.text == sdk.content[0].text
    assert joined.usage_metadata["output_tokens"] == 12
    # ChatAnthropic's default max_tokens (4096 for a model it has no profile of) does not
    # fit this 1024-token context: a 400 naming max_tokens, as Anthropic's own API answers
    with pytest.raises(anthropic.BadRequestError, match="max_tokens") as caught:
        _chat_anthropic(tools_server).invoke(messages)
    assert caught.value.status_code == 400


def test_langchain_bind_tools_forced_call_has_parsed_args(tools_server):
    """bind_tools with a forcing tool_choice is Candor's constrained call: the AIMessage
    carries one tool call whose args are the schema's object, whole and streamed; the
    tool's result sent back is the next turn's prompt, as count_tokens counts it."""
    from langchain_core.messages import HumanMessage, ToolMessage

    llm = _chat_anthropic(tools_server, max_tokens=200, temperature=0)
    tool = TOOLS[0]
    bound = llm.bind_tools([tool], tool_choice="get_weather")
    ask = [HumanMessage("What is the weather in a city?")]
    reply = bound.invoke(ask)
    assert reply.response_metadata["stop_reason"] == "tool_use", reply
    assert reply.response_metadata["candor"]["constraint"] == "tool_choice"
    [call] = reply.tool_calls
    assert call["name"] == "get_weather" and call["id"]
    jsonschema.validate(call["args"], WEATHER)
    joined = functools.reduce(operator.add, bound.stream(ask))
    assert [c["args"] for c in joined.tool_calls] == [call["args"]]
    anyone = llm.bind_tools([tool], tool_choice="any").invoke(ask)
    assert anyone.tool_calls and anyone.tool_calls[0]["name"] == "get_weather"
    # the round trip: the ToolMessage goes back as a tool_result block; LangChain's token
    # count (count_tokens on the beta route) is the prompt that second turn ran
    turns = [*ask, reply, ToolMessage("Sunny, 24 C", tool_call_id=call["id"])]
    second = llm.bind_tools([tool]).invoke(turns)
    assert second.response_metadata["stop_reason"] in ("max_tokens", "end_turn", "tool_use")
    usage = second.response_metadata["usage"]
    assert llm.get_num_tokens_from_messages(turns, tools=[tool]) == (
        usage["input_tokens"] + usage["cache_read_input_tokens"])
