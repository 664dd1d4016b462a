"""Tool calling through the running server (random weights), with the openai SDK.

The tiny model's own template writes Hermes-style ``<tool_call>`` tags, so the server
detects the hermes parser. ``required`` and named choices are constrained decoding: every
call must parse and validate against its tool's schema whatever the weights say. ``auto``
is parsed after the fact; to make random weights write a real Hermes call, those tests
add a ``guided_regex`` that spells one out.
"""

from __future__ import annotations

import json

import jsonschema
import msgspec
import openai
import pytest

from api_frontend.errors import ApiError
from api_frontend.endpoints.chat.translate import chat_to_generate
from cluster.topology import ApiSpec
from protocol.openai_api import ChatCompletionRequest
from tests.support.server import CandorServer

WEATHER = {"type": "object", "properties": {
    "city": {"type": "string", "enum": ["Paris", "Zürich", "Rome"]},
    "days": {"type": "integer", "minimum": 1, "maximum": 14},
    "metric": {"type": "boolean"}},
    "required": ["city", "days", "metric"], "additionalProperties": False}
TIME = {"type": "object", "properties": {"zone": {"type": "string", "maxLength": 6},
                                         "hour24": {"type": "boolean"}},
        "required": ["zone"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "weather",
                                           "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "parameters": TIME}}]
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}
MESSAGES = [{"role": "user", "content": "Weather in Paris and the time there?"}]


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0)


def _valid_calls(message) -> list[tuple[str, dict]]:
    assert message.tool_calls, message
    out = []
    for call in message.tool_calls:
        assert call.type == "function" and call.id
        args = json.loads(call.function.arguments)
        jsonschema.validate(args, SCHEMAS[call.function.name])
        out.append((call.function.name, args))
    return out


def _streamed(client, **kwargs):
    """(content, {index: [id, name, arguments]}, finish_reason) of a streamed chat."""
    content, calls, finish = "", {}, None
    for chunk in client.chat.completions.create(stream=True, **kwargs):
        for choice in chunk.choices:
            delta = choice.delta
            content += delta.content or ""
            indices = [d.index for d in delta.tool_calls or []]
            assert len(set(indices)) == len(indices), "two deltas of one call in a chunk"
            for d in delta.tool_calls or []:
                if d.index not in calls:  # the first delta of a call names it
                    assert d.id and d.type == "function" and d.function.name
                    calls[d.index] = [d.id, d.function.name, ""]
                else:
                    assert d.id is None and not d.function.name
                calls[d.index][2] += d.function.arguments or ""
            finish = choice.finish_reason or finish
    return content, calls, finish


def test_parser_detected_and_published(server):
    status, body = server.get("/v1/capabilities")
    policy = json.loads(body)["policy"]
    assert policy["tool_call_parser"] == "hermes"
    assert "detected" in policy["tool_call_parser_source"]


@pytest.mark.parametrize("seed", range(6))
def test_required_calls_always_validate(client, seed):
    r = client.chat.completions.create(model="tiny-llama", messages=MESSAGES, tools=TOOLS,
                                       tool_choice="required", max_tokens=300, seed=seed,
                                       temperature=1.0)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content is None
    assert len(_valid_calls(choice.message)) >= 1
    assert r.model_extra["candor"]["constraint"] == "tools"


@pytest.mark.parametrize("seed", range(4))
def test_named_call_validates_and_streams_the_same_arguments(client, seed):
    kwargs = dict(model="tiny-llama", messages=MESSAGES, tools=TOOLS, max_tokens=200,
                  seed=seed, tool_choice={"type": "function", "function": {"name": "get_time"}})
    whole = client.chat.completions.create(**kwargs)
    [(name, args)] = _valid_calls(whole.choices[0].message)
    assert name == "get_time" and whole.choices[0].finish_reason == "tool_calls"
    content, calls, finish = _streamed(client, **kwargs)
    assert content == "" and finish == "tool_calls"
    assert [(c[1], c[2]) for c in calls.values()] == [
        ("get_time", whole.choices[0].message.tool_calls[0].function.arguments)]


@pytest.mark.parametrize("seed", range(3))
def test_required_calls_stream_the_same_calls(client, seed):
    kwargs = dict(model="tiny-llama", messages=MESSAGES, tools=TOOLS, tool_choice="required",
                  max_tokens=300, seed=seed, n=2)
    whole = client.chat.completions.create(**kwargs)
    expected = [[(c.function.name, c.function.arguments) for c in ch.message.tool_calls]
                for ch in whole.choices]
    got: dict[int, dict[int, list]] = {}
    for chunk in client.chat.completions.create(stream=True, **kwargs):
        for choice in chunk.choices:
            for d in choice.delta.tool_calls or []:
                calls = got.setdefault(choice.index, {})
                if d.index not in calls:
                    assert d.id and d.function.name
                    calls[d.index] = [d.function.name, ""]
                calls[d.index][1] += d.function.arguments or ""
            if choice.finish_reason is not None:
                assert choice.finish_reason == "tool_calls"
    assert [[tuple(c) for c in got[i].values()] for i in range(2)] == expected


NAMED_WEATHER = {"type": "function", "function": {"name": "get_weather"}}


def _whole(client, **kwargs):
    """(content, {index: [id, name, arguments]}, finish_reason), as ``_streamed``."""
    choice = client.chat.completions.create(**kwargs).choices[0]
    calls = {k: [c.id, c.function.name, c.function.arguments]
             for k, c in enumerate(choice.message.tool_calls or [])}
    return choice.message.content or "", calls, choice.finish_reason


@pytest.mark.parametrize("tool_choice", ["required", NAMED_WEATHER])
@pytest.mark.parametrize("cut", ["stop", "stop_token_ids", "max_tokens"])
def test_a_call_cut_before_its_end_never_finishes_tool_calls(client, tool_choice, cut):
    """Policy (README): a reply that ends inside a call (a stop string or stop token,
    max_tokens) reports the call as far as it was written, whole and streamed alike (its
    argument fragments were streamed as written), and finish_reason says what ended it:
    never ``tool_calls``, which is kept for replies whose every call's arguments parse."""
    kwargs = dict(model="tiny-llama", messages=MESSAGES, tools=TOOLS, tool_choice=tool_choice,
                  max_tokens=200, temperature=0)
    full = client.chat.completions.create(**kwargs, extra_body={"return_token_ids": True})
    ids = full.choices[0].model_extra["token_ids"]
    full_calls = [(c.function.name, c.function.arguments)
                  for c in full.choices[0].message.tool_calls]
    args = full_calls[0][1]
    extra: dict = {}
    if cut == "stop":  # the first key's name, inside the arguments
        extra["stop"] = args[2:6]
    elif cut == "stop_token_ids":  # a token first written in the second half
        extra["extra_body"] = {"stop_token_ids": [next(
            t for k, t in enumerate(ids) if k >= len(ids) // 2 and t not in ids[:k])]}
    else:
        extra["max_tokens"] = len(ids) // 2
    want = "length" if cut == "max_tokens" else "stop"
    whole = _whole(client, **kwargs | extra)
    streamed = _streamed(client, **kwargs | extra)
    assert [c[1:] for c in whole[1].values()] == [c[1:] for c in streamed[1].values()]
    assert (whole[0], whole[2]) == (streamed[0], streamed[2]) == (whole[0], want)
    got = [tuple(c[1:]) for c in whole[1].values()]
    if cut == "stop":  # it ends inside the first call's arguments
        assert len(got) == 1 and got[0][1] != args
    assert got[:-1] == full_calls[:len(got) - 1]  # the calls before the cut are whole
    if got:  # the last one is as far as it was written; cut, its arguments do not parse
        name, written = got[-1]
        whole_name, whole_args = full_calls[len(got) - 1]
        assert name == whole_name and whole_args.startswith(written)
        if written != whole_args:
            with pytest.raises(ValueError):
                json.loads(written)


@pytest.mark.parametrize("seed", range(4))
def test_parallel_false_yields_exactly_one_call(client, seed):
    r = client.chat.completions.create(model="tiny-llama", messages=MESSAGES, tools=TOOLS,
                                       tool_choice="required", parallel_tool_calls=False,
                                       max_tokens=300, seed=seed)
    assert len(_valid_calls(r.choices[0].message)) == 1


def test_required_with_n_and_logprobs(client):
    r = client.chat.completions.create(model="tiny-llama", messages=MESSAGES, tools=TOOLS,
                                       tool_choice="required", max_tokens=300, n=3, seed=5,
                                       logprobs=True, top_logprobs=2)
    assert len(r.choices) == 3
    for choice in r.choices:
        _valid_calls(choice.message)
        assert choice.logprobs.content


HERMES_REGEX = (r'Sure\.<tool_call>\{"name": "get_weather", "arguments": '
                r'\{"city": "(Paris|Rome)", "days": [1-9], "metric": (true|false)\}\}'
                r'</tool_call>(<tool_call>\{"name": "get_time", "arguments": '
                r'\{"zone": "UTC"\}\}</tool_call>)?')


@pytest.mark.parametrize("seed", range(3))
def test_auto_reads_hermes_calls_whole_and_streamed(client, seed):
    kwargs = dict(model="tiny-llama", messages=MESSAGES, tools=TOOLS, max_tokens=300,
                  seed=seed, extra_body={"guided_regex": HERMES_REGEX})
    whole = client.chat.completions.create(**kwargs)
    message = whole.choices[0].message
    assert message.content == "Sure."
    calls = _valid_calls(message)
    assert calls[0][0] == "get_weather"
    assert whole.choices[0].finish_reason == "tool_calls"
    assert whole.model_extra["candor"]["tool_parser"] == "hermes"
    content, streamed, finish = _streamed(client, **kwargs)
    assert content == "Sure." and "<tool" not in content and finish == "tool_calls"
    assert [(c[1], c[2]) for c in streamed.values()] == [
        (c.function.name, c.function.arguments) for c in message.tool_calls]


def test_auto_without_calls_is_plain_content(client):
    r = client.chat.completions.create(model="tiny-llama", messages=MESSAGES, tools=TOOLS,
                                       max_tokens=8, seed=1,
                                       extra_body={"guided_regex": "[a-z ]{3,20}"})
    assert r.choices[0].message.tool_calls is None
    assert r.choices[0].message.content and r.choices[0].finish_reason in ("stop", "length")


@pytest.mark.parametrize("body,param", [
    ({"tools": []}, "tools"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "tool_choice"),
    ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice"),
    ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]},
     "tools[0].function.name"),
    ({"tools": TOOLS, "tool_choice": "required",
      "response_format": {"type": "json_object"}}, "response_format"),
    ({"tools": TOOLS, "tool_choice": "required", "ignore_eos": True}, "ignore_eos"),
])
def test_tool_validation_names_the_field(client, body, param):
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model="tiny-llama", messages=MESSAGES, max_tokens=4,
                                       extra_body=body)
    assert err.value.body["param"] == param, err.value.body


def test_auto_without_a_parser_is_a_400():
    req = msgspec.convert({"model": "m", "messages": MESSAGES, "tools": TOOLS},
                          ChatCompletionRequest)
    with pytest.raises(ApiError) as err:
        chat_to_generate(req, "r", "x", 0.0, [], ApiSpec(tool_call_parser=None))
    assert err.value.param == "tool_choice" and "--tool-call-parser" in err.value.message
    tr = chat_to_generate(req, "r", "x", 0.0, [], ApiSpec(tool_call_parser="hermes"))
    assert tr.gen.tools == TOOLS and tr.report.tool_parser == "hermes"


def test_assistant_tool_calls_and_tool_results_render(client):
    """A full round trip: the model's call and the tool's answer go back through the
    template (arguments as the JSON string the API returned)."""
    first = client.chat.completions.create(model="tiny-llama", messages=MESSAGES, tools=TOOLS,
                                           tool_choice="required", max_tokens=300, seed=3)
    call = first.choices[0].message.tool_calls[0]
    messages = MESSAGES + [first.choices[0].message.model_dump(exclude_none=True),
                           {"role": "tool", "tool_call_id": call.id, "content": "sunny"}]
    r = client.chat.completions.create(model="tiny-llama", messages=messages, tools=TOOLS,
                                       tool_choice="none", max_tokens=4)
    assert r.choices[0].message.tool_calls is None


@pytest.mark.parametrize("stream", [False, True])
def test_parallel_false_under_auto_stops_after_the_first_call(client, stream):
    """The regex makes the model write two calls; parallel_tool_calls false keeps one and
    bills only the tokens up to the end of the first."""
    regex = HERMES_REGEX.replace(")?", ")")  # the second call is no longer optional
    kwargs = dict(model="tiny-llama", messages=MESSAGES, tools=TOOLS, max_tokens=300, seed=4,
                  extra_body={"guided_regex": regex})
    both = client.chat.completions.create(**kwargs)
    assert len(both.choices[0].message.tool_calls) == 2
    kwargs["parallel_tool_calls"] = False
    if stream:
        content, calls, finish = _streamed(client, **kwargs)
        assert content == "Sure." and finish == "tool_calls"
        assert [c[1] for c in calls.values()] == ["get_weather"]
        return
    one = client.chat.completions.create(**kwargs)
    assert [c.function.name for c in one.choices[0].message.tool_calls] == ["get_weather"]
    assert one.choices[0].finish_reason == "tool_calls"
    assert one.usage.completion_tokens < both.usage.completion_tokens


@pytest.fixture(scope="module")
def r1_server(tiny_model_dir):
    srv = CandorServer(tiny_model_dir, "--served-model-name", "tiny-llama", "--max-model-len",
                       "1024", "--reasoning-parser", "deepseek_r1",
                       "--tool-call-parser", "none").start()
    yield srv
    assert srv.stop() == 0


def test_reasoning_parser_fills_reasoning_content_whole_and_streamed(r1_server):
    """deepseek_r1: the reply is reasoning until </think>, which random weights never
    write, so everything is reasoning_content and nothing reaches content."""
    client = openai.OpenAI(base_url=r1_server.base_url + "/v1", api_key="unused",
                           max_retries=0)
    policy = json.loads(r1_server.get("/v1/capabilities")[1])["policy"]
    assert (policy["reasoning_parser"], policy["reasoning_parser_source"]) == (
        "deepseek_r1", "flag")
    assert policy["tool_call_parser"] is None
    kwargs = dict(model="tiny-llama", messages=MESSAGES, max_tokens=12, seed=7)
    whole = client.chat.completions.create(**kwargs)
    message = whole.choices[0].message
    assert message.content is None and message.model_extra["reasoning_content"]
    assert whole.model_extra["candor"]["reasoning_parser"] == "deepseek_r1"
    thought, content = "", ""
    for chunk in client.chat.completions.create(stream=True, **kwargs):
        for choice in chunk.choices:
            thought += choice.delta.model_extra.get("reasoning_content") or ""
            content += choice.delta.content or ""
    assert (thought, content) == (message.model_extra["reasoning_content"], "")
    # no parser: tool_choice auto is refused rather than answered as content
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(tools=TOOLS, **kwargs)
    assert err.value.body["param"] == "tool_choice"

    # a constraint applies to the answer after </think>, which random weights never
    # reach: the reply is all (free) reasoning until max_tokens, and no call was begun
    for choice_field in ("required", {"type": "function", "function": {"name": "get_time"}}):
        r = client.chat.completions.create(tools=TOOLS, tool_choice=choice_field, **{
            **kwargs, "max_tokens": 40})
        choice = r.choices[0]
        assert choice.finish_reason == "length" and choice.message.tool_calls is None
        assert choice.message.model_extra["reasoning_content"]
        assert r.model_extra["candor"]["constraint"] in ("tools", "tool_choice")
        content, calls, finish = _streamed(client, tools=TOOLS, tool_choice=choice_field,
                                           **{**kwargs, "max_tokens": 40})
        assert (content, calls, finish) == ("", {}, "length")


# ------------------------------------------------ tool calls beside a reasoning parser
# The gpu_worker writes scripted replies (tests/support/faults.py): a request's seed picks one.

DRAFT = ('<tool_call>{"name": "get_time", "arguments": {"zone": "UTC"}}</tool_call>')
WEATHER_CALL = ('<tool_call>{"name": "get_weather", "arguments": {"city": "Rome", "days": 2, '
                '"metric": true}}</tool_call>')
SCRIPTS = {
    # a call drafted inside <think>, then a plain answer
    101: f"<think>I could call {DRAFT} but the user wants none.</think>It is noon.",
    # a drafted call in <think>, then two real calls
    102: f"<think>Plan: {DRAFT}</think>{WEATHER_CALL}{DRAFT}",
    # a call to a tool the request does not declare
    103: '<tool_call>{"name": "launch_rockets", "arguments": {"count": 3}}</tool_call>',
}


@pytest.fixture(scope="module")
def think_server(tiny_model_dir):
    from tokenizers import Tokenizer

    from tests.support.faults import script_env
    tok = Tokenizer.from_file(str(tiny_model_dir / "tokenizer.json"))
    eos = json.loads((tiny_model_dir / "config.json").read_text())["eos_token_id"]
    eos = eos[0] if isinstance(eos, list) else eos
    scripts = {seed: tok.encode(text, add_special_tokens=False).ids + [eos]
               for seed, text in SCRIPTS.items()}
    srv = CandorServer(tiny_model_dir, "--served-model-name", "tiny-llama", "--max-model-len",
                       "1024", "--reasoning-parser", "qwen3",
                       env=script_env(scripts)).start()
    yield srv
    assert srv.stop() == 0


def _think_reply(server, stream: bool, **kwargs):
    """(reasoning, content, [(name, arguments)], finish_reason, completion_tokens)."""
    client = openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0)
    kwargs = dict(model="tiny-llama", messages=MESSAGES, tools=TOOLS, max_tokens=200,
                  **kwargs)
    if not stream:
        r = client.chat.completions.create(**kwargs)
        m = r.choices[0].message
        return (m.model_extra.get("reasoning_content"), m.content,
                [(c.function.name, c.function.arguments) for c in m.tool_calls or []],
                r.choices[0].finish_reason, r.usage.completion_tokens)
    thought, content, calls, finish, usage = "", "", {}, None, None
    for chunk in client.chat.completions.create(stream=True, stream_options={
            "include_usage": True}, **kwargs):
        usage = chunk.usage or usage
        for choice in chunk.choices:
            thought += choice.delta.model_extra.get("reasoning_content") or ""
            content += choice.delta.content or ""
            for d in choice.delta.tool_calls or []:
                calls.setdefault(d.index, [d.function.name, ""])[1] += d.function.arguments or ""
            finish = choice.finish_reason or finish
    return (thought or None, content or None, [tuple(c) for c in calls.values()], finish,
            usage.completion_tokens)


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("parallel", [None, False])
def test_a_call_drafted_inside_think_is_reasoning_not_a_call(think_server, stream, parallel):
    """Tool-call detection (and parallel_tool_calls false's early stop) reads only the text
    after </think>: a <tool_call> drafted in the reasoning neither ends the reply nor
    becomes a call."""
    extra = {} if parallel is None else {"parallel_tool_calls": parallel}
    thought, content, calls, finish, _ = _think_reply(think_server, stream, seed=101, **extra)
    assert thought == f"I could call {DRAFT} but the user wants none."
    assert (content, calls, finish) == ("It is noon.", [], "stop")


@pytest.mark.parametrize("stream", [False, True])
def test_parallel_false_keeps_the_first_call_after_think(think_server, stream):
    full = _think_reply(think_server, stream, seed=102)
    assert [c[0] for c in full[2]] == ["get_weather", "get_time"] and full[3] == "tool_calls"
    thought, content, calls, finish, billed = _think_reply(think_server, stream, seed=102,
                                                           parallel_tool_calls=False)
    assert thought == f"Plan: {DRAFT}" and content is None
    assert [(n, json.loads(a)) for n, a in calls] == [
        ("get_weather", {"city": "Rome", "days": 2, "metric": True})]
    assert finish == "tool_calls" and billed < full[4]


@pytest.mark.parametrize("stream", [False, True])
def test_a_call_to_an_undeclared_tool_stays_content(think_server, stream):
    """Policy (README): a name no tool in `tools` has is not a call; the text stays
    `content`, verbatim, and the reply finishes `stop`."""
    thought, content, calls, finish, _ = _think_reply(think_server, stream, seed=103)
    assert (thought, content, calls, finish) == (None, SCRIPTS[103], [], "stop")
