"""``/v1/responses`` through real servers: the openai SDK (create, stream, parse,
retrieve, delete, input items), the OpenAI Agents SDK, and raw HTTP for the event order
and the error shape.

Two servers: the session's default one (one frontend, the hermes tool parser the tiny
template implies), and ``pair``: two frontends on one port, the deepseek_r1 reasoning
parser (random weights never close ``<think>``, so every answer there is reasoning), a
small store, and a gpu_worker that fails a step feeding ``FAULT_TOKEN``.
"""

from __future__ import annotations

import asyncio
import json
import urllib.request

import jsonschema
import msgspec
import openai
import pytest
from pydantic import BaseModel, Field

from api_frontend.endpoints.responses.store import ResponseStore
from cluster.topology import ResponsesStoreSpec
from tests.support.faults import fault_env
from tests.support.metrics_text import scrape
from tests.support.polling import wait_until
from tests.support.server import CandorServer

MODEL = "tiny-llama"
FAULT_TOKEN = 300
WEATHER = {"type": "object", "properties": {
    "city": {"type": "string", "enum": ["Paris", "Rome"]},
    "days": {"type": "integer", "minimum": 1, "maximum": 7}},
    "required": ["city", "days"], "additionalProperties": False}
TOOLS = [{"type": "function", "name": "get_weather", "description": "weather in a city",
          "parameters": WEATHER}]
TERMINAL = ("response.completed", "response.incomplete", "response.failed")


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def pair(tiny_model_dir):
    srv = CandorServer(tiny_model_dir, "--served-model-name", MODEL, "--max-model-len", "1024",
                       "--frontends", "2", "--reasoning-parser", "deepseek_r1",
                       "--tool-call-parser", "none", "--responses-store-max-entries", "3",
                       env=fault_env(FAULT_TOKEN)).start()
    yield srv
    assert srv.stop() == 0


def _post(base_url: str, body: dict) -> tuple[int, str, str]:
    req = urllib.request.Request(base_url + "/v1/responses", json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=120) as resp:
            return resp.status, resp.headers.get("Content-Type", ""), resp.read().decode()
    except urllib.error.HTTPError as err:
        return err.code, err.headers.get("Content-Type", ""), err.read().decode()


def sse_events(text: str) -> list[dict]:
    """Every event of a Responses stream; each ``event:`` line names its data's type."""
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
    """OpenAI's order: created, in_progress, then each item opened, grown and closed
    before the next (parts inside their item), then one terminal event; sequence numbers
    0, 1, 2, ... without gaps."""
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    types = [e["type"] for e in events]
    assert types[:2] == ["response.created", "response.in_progress"]
    assert types[-1] in TERMINAL or types[-2:] == ["error", "response.failed"]
    open_item = None
    part_open = False
    for e in events[2:]:
        t = e["type"]
        if t == "response.output_item.added":
            assert open_item is None, "an item opened before the last one closed"
            open_item = e["output_index"]
        elif t == "response.output_item.done":
            assert e["output_index"] == open_item and not part_open
            open_item = None
        elif t == "response.content_part.added":
            assert e["output_index"] == open_item and not part_open
            part_open = True
        elif t == "response.content_part.done":
            assert part_open
            part_open = False
        elif t.endswith(".delta") or t.endswith(".done"):
            assert e["output_index"] == open_item, e
        else:
            assert t in TERMINAL or t == "error", t
            assert open_item is None, "a terminal event with an item still open"


def test_create_whole_and_streamed_agree_event_by_event(server, client):
    """The SDK's typed stream parser takes every event and builds the same response as
    the whole body; the raw events follow OpenAI's order; max_output_tokens reached is
    status incomplete."""
    kwargs = dict(model=MODEL, input="Tell me about Paris.", max_output_tokens=12,
                  temperature=0, instructions="Be brief.")
    whole = client.responses.create(**kwargs)
    assert whole.status == "incomplete"
    assert whole.incomplete_details.reason == "max_output_tokens"
    assert whole.usage.output_tokens == 12 and whole.usage.input_tokens > 0
    assert [o.type for o in whole.output] == ["message"] and whole.output_text
    assert whole.temperature == 0 and whole.instructions == "Be brief."
    with client.responses.stream(**kwargs) as stream:
        typed = list(stream)  # the SDK's typed parser accepts every event
    deltas = [e.delta for e in typed if e.type == "response.output_text.delta"]
    assert "".join(deltas) == whole.output_text
    assert typed[-1].type == "response.incomplete"
    assert typed[-1].response.output_text == whole.output_text
    status, ctype, text = _post(server.base_url, {**kwargs, "stream": True})
    assert status == 200 and ctype.startswith("text/event-stream")
    events = sse_events(text)
    check_event_order(events)
    assert events[-1]["type"] == "response.incomplete"
    assert events[0]["response"]["candor"]["chat_template"]["source"] == "checkpoint"
    last = events[-1]["response"]
    assert last["output"][0]["content"][0]["text"] == whole.output_text
    assert last["usage"]["output_tokens"] == 12
    # with room to finish: completed (a stop string ends it)
    done = client.responses.create(**{**kwargs, "max_output_tokens": 200},
                                   extra_body={"stop": [" "]})
    assert done.status == "completed" and done.output[0].status == "completed"


def test_function_call_round_trip_with_the_openai_sdk(client):
    """tool_choice required makes the model call; the client sends function_call_output
    (through previous_response_id, and stateless with the whole conversation as input);
    the model answers in a format that parses."""
    first = client.responses.create(model=MODEL, input="Weather in Paris?", tools=TOOLS,
                                    tool_choice="required", parallel_tool_calls=False,
                                    max_output_tokens=80, temperature=0)
    assert first.status == "completed"
    calls = [o for o in first.output if o.type == "function_call"]
    assert len(calls) == 1 and calls[0].name == "get_weather" and calls[0].call_id
    jsonschema.validate(json.loads(calls[0].arguments), WEATHER)
    answer_format = {"format": {"type": "json_schema", "name": "answer", "strict": True,
                                "schema": {"type": "object", "properties": {
                                    "sunny": {"type": "boolean"}}, "required": ["sunny"],
                                    "additionalProperties": False}}}
    result = {"type": "function_call_output", "call_id": calls[0].call_id,
              "output": '{"sky": "clear"}'}
    second = client.responses.create(model=MODEL, previous_response_id=first.id,
                                     input=[result], tools=TOOLS, text=answer_format,
                                     max_output_tokens=40, temperature=0)
    assert second.status == "completed" and second.previous_response_id == first.id
    assert isinstance(json.loads(second.output_text)["sunny"], bool)
    # stateless: the same conversation sent whole gives the same answer
    history = [{"role": "user", "content": "Weather in Paris?"},
               *[o.model_dump(exclude_none=True) for o in first.output], result]
    again = client.responses.create(model=MODEL, input=history, tools=TOOLS,
                                    text=answer_format, max_output_tokens=40, temperature=0,
                                    store=False)
    assert again.output_text == second.output_text
    assert again.usage.input_tokens == second.usage.input_tokens


def test_json_schema_output_parses(client):
    """text.format through the grammar engine: the SDK's parse() gets a validated object,
    json_object parses; the report names the constraint by this API's field."""

    class City(BaseModel):
        name: str = Field(max_length=12)
        population: int = Field(ge=0, le=10_000_000)

    parsed = client.responses.parse(model=MODEL, input="A city?", text_format=City,
                                    max_output_tokens=80, temperature=0)
    assert isinstance(parsed.output_parsed, City)
    assert parsed.model_extra["candor"]["constraint"] == "text.format.schema"
    obj = client.responses.create(model=MODEL, input="JSON please",
                                  text={"format": {"type": "json_object"}},
                                  max_output_tokens=10, temperature=0)
    # any JSON object: random weights rarely close it within the limit, but it opens one
    assert obj.output_text.startswith("{")
    assert obj.model_extra["candor"]["constraint"] == "text.format"


def test_auto_tool_call_streams_function_call_events(server, client):
    """tool_choice auto is read by the deployment's parser (hermes here): text, then a
    call; streamed as a message item then a function_call item whose argument deltas
    concatenate to the whole body's. (The guided_regex extension spells out a call, which
    random weights would never write.)"""
    call = '<tool_call>{"name": "get_weather", "arguments": {"city": "Rome", "days": 2}}'
    body = dict(model=MODEL, input="Weather?", tools=TOOLS, max_output_tokens=120,
                temperature=0, guided_regex=r"Sure\." + _escape(call) + r"</tool_call>")
    whole = client.responses.create(**{k: v for k, v in body.items() if k != "guided_regex"},
                                    extra_body={"guided_regex": body["guided_regex"]})
    assert [o.type for o in whole.output] == ["message", "function_call"]
    assert whole.output[0].content[0].text == "Sure."
    assert json.loads(whole.output[1].arguments) == {"city": "Rome", "days": 2}
    assert whole.model_extra["candor"]["tool_parser"] == "hermes"
    assert whole.model_extra["candor"]["extensions"] == ["guided_regex"]
    status, _, text = _post(server.base_url, {**body, "stream": True})
    events = sse_events(text)
    check_event_order(events)
    args = "".join(e["delta"] for e in events
                   if e["type"] == "response.function_call_arguments.delta")
    assert args == whole.output[1].arguments
    done = [e for e in events if e["type"] == "response.function_call_arguments.done"]
    assert done[0]["arguments"] == args and done[0]["name"] == "get_weather"


def _escape(text: str) -> str:
    return "".join("\\" + c if c in "{}[]().*+?|\\^$" else c for c in text)


def test_continuation_and_the_store_through_the_sdk(client):
    """previous_response_id carries the conversation, not the instructions; retrieve,
    input_items and delete; every id that cannot be continued is a 404 saying why."""
    first = client.responses.create(model=MODEL, input="Hello", instructions="Speak Latin.",
                                    max_output_tokens=4, temperature=0,
                                    metadata={"ticket": "42"})
    assert first.metadata == {"ticket": "42"}
    second = client.responses.create(model=MODEL, input="More", previous_response_id=first.id,
                                     max_output_tokens=4, temperature=0)
    with_instructions = client.responses.create(
        model=MODEL, input="More", previous_response_id=first.id, max_output_tokens=4,
        temperature=0, instructions="Speak Latin.")
    # the instructions of the first response are not carried: the prompt is shorter
    assert second.usage.input_tokens < with_instructions.usage.input_tokens
    got = client.responses.retrieve(second.id)
    assert got.id == second.id and got.output_text == second.output_text
    items = client.responses.input_items.list(second.id, order="asc")
    assert [i.type for i in items.data] == ["message", "message", "message"]
    assert [i.role for i in items.data] == ["user", "assistant", "user"]
    newest = client.responses.input_items.list(second.id, limit=1)
    assert newest.data[0].id == items.data[-1].id and newest.has_more
    client.responses.delete(second.id)
    for call in (lambda: client.responses.retrieve(second.id),
                 lambda: client.responses.create(model=MODEL, input="x",
                                                 previous_response_id=second.id)):
        with pytest.raises(openai.NotFoundError) as err:
            call()
        assert "deleted" in err.value.body["message"]
    unstored = client.responses.create(model=MODEL, input="x", store=False,
                                       max_output_tokens=2)
    with pytest.raises(openai.NotFoundError) as err:
        client.responses.create(model=MODEL, input="y", previous_response_id=unstored.id)
    assert "store: false" in err.value.body["message"]
    assert err.value.body["param"] == "previous_response_id"
    with pytest.raises(openai.NotFoundError) as err:
        client.responses.retrieve("resp_nope")
    assert "not an id this deployment issued" in err.value.body["message"]


def test_bad_requests_are_4xx_naming_the_field(server):
    base = {"model": MODEL, "input": "hi", "max_output_tokens": 2}
    cases = [
        ({"model": "nope"}, 404, "model"),
        ({"input": []}, 400, "input"),
        ({"input": [{"type": "item_reference", "id": "x"}]}, 400, "input[0].type"),
        ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "u"}]}]},
         400, "input[0].content[0].type"),
        ({"input": [{"type": "function_call", "name": "f"}]}, 400, "input[0].call_id"),
        ({"tools": [{"type": "web_search"}]}, 400, "tools[0].type"),
        ({"tools": [{"type": "function", "name": "bad name!"}]}, 400, "tools[0].name"),
        ({"tools": TOOLS, "tool_choice": {"type": "function", "name": "other"}}, 400,
         "tool_choice"),
        ({"tools": TOOLS, "tool_choice": {"type": "allowed_tools", "tools": []}}, 400,
         "tool_choice.type"),
        ({"text": {"format": {"type": "json_schema", "name": "x", "schema": {
            "type": "object", "properties": {"a": {"not": {"type": "string"}}}}}}}, 400,
         "text.format.schema"),
        ({"text": {"format": {"type": "yaml"}}}, 400, "text.format.type"),
        ({"max_output_tokens": 5000}, 400, "max_output_tokens"),
        ({"temperature": 3}, 400, "temperature"),
        ({"metadata": {f"k{i}": "v" for i in range(17)}}, 400, "metadata"),
        ({"background": True}, 400, "background"),
        ({"conversation": "conv_1"}, 400, "conversation"),
        ({"prompt": {"id": "pmpt_1"}}, 400, "prompt"),
        ({"include": ["reasoning.encrypted_content"]}, 400, "include[0]"),
        ({"truncation": "auto"}, 400, "truncation"),
        ({"top_logprobs": 3}, 400, "top_logprobs"),
        ({"priority": 1}, 400, "priority"),
        ({"guided_json": {"type": "object"}, "text": {"format": {"type": "json_object"}}},
         400, "guided_json"),
    ]
    for extra, status, param in cases:
        got, _, text = _post(server.base_url, {**base, **extra})
        body = json.loads(text)
        assert got == status, (extra, text)
        assert set(body["error"]) == {"message", "type", "param", "code"}
        assert body["error"]["param"] == param, (extra, body)
    assert server.health()[0] == 200


def test_ignored_and_unbuilt_fields_are_reported_or_400(server, client):
    r = client.responses.create(model=MODEL, input="hi", max_output_tokens=2, user="u1",
                                service_tier="flex", reasoning={"effort": "high"},
                                include=[], background=False, truncation="disabled",
                                extra_body={"mystery": 1, "top_k": 5})
    report = r.model_extra["candor"]
    ignored = {n["field"] for n in report["ignored"]}
    assert {"user", "service_tier", "reasoning.effort", "mystery"} <= ignored
    assert "background" in ignored  # false: the value asks for what Candor does
    assert report["extensions"] == ["top_k"]
    for field, value in (("user", "u1"), ("reasoning", {"summary": "auto"})):
        got, _, text = _post(server.base_url, {"model": MODEL, "input": "hi", "strict": True,
                                               field: value})
        assert got == 400 and json.loads(text)["error"]["code"] == "ignored_field", text
    caps = json.loads(server.get("/v1/capabilities")[1])
    fields = caps["fields"]["/v1/responses"]
    assert fields["store"] == "honoured" and fields["background"] == "rejected"
    assert fields["user"] == "ignored" and fields["seed"] == "extension"
    assert "/v1/responses" in caps["endpoints"]


def test_reasoning_items_whole_and_streamed(pair):
    """deepseek_r1: the reply is reasoning until </think> (never written here): one
    reasoning item, its text streamed as reasoning_text deltas; reasoning_tokens counts it."""
    client = openai.OpenAI(base_url=pair.base_url + "/v1", api_key="unused", max_retries=0)
    kwargs = dict(model=MODEL, input="Think.", max_output_tokens=10, temperature=0)
    whole = client.responses.create(**kwargs)
    assert [o.type for o in whole.output] == ["reasoning"]
    thought = whole.output[0].content[0].text
    assert thought and whole.output[0].summary == []
    assert whole.usage.output_tokens_details.reasoning_tokens == 10
    assert whole.model_extra["candor"]["reasoning_parser"] == "deepseek_r1"
    with client.responses.stream(**kwargs) as stream:
        events = list(stream)
    deltas = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
    assert deltas == thought
    done = [e for e in events if e.type == "response.reasoning_text.done"]
    assert done and done[0].text == thought
    # the reasoning item sent back is the next assistant turn's reasoning_content
    again = client.responses.create(model=MODEL, previous_response_id=whole.id,
                                    input="And?", max_output_tokens=2, temperature=0)
    assert again.usage.input_tokens > whole.usage.input_tokens + 5


def test_failure_after_the_first_event_is_error_then_failed(pair):
    """A step fails feeding FAULT_TOKEN (forced first by logit_bias): the stream, already
    started, ends with an error event in the error shape's terms, then response.failed;
    the openai SDK's stream parser takes both."""
    body = {"model": MODEL, "input": "go", "max_output_tokens": 5, "stream": True,
            "logit_bias": {str(FAULT_TOKEN): 100}}
    status, _, text = _post(pair.base_url, body)
    assert status == 200
    events = sse_events(text)
    check_event_order(events)
    error, failed = events[-2], events[-1]
    assert error["type"] == "error" and error["message"] and "code" in error
    assert failed["type"] == "response.failed"
    assert failed["response"]["status"] == "failed"
    assert failed["response"]["error"]["message"] == error["message"]
    client = openai.OpenAI(base_url=pair.base_url + "/v1", api_key="unused", max_retries=0)
    with client.responses.stream(**{k: v for k, v in body.items() if k not in (
            "stream", "logit_bias")}, extra_body={"logit_bias": body["logit_bias"]}) as s:
        kinds = [e.type for e in s]
    assert kinds[-2:] == ["error", "response.failed"]
    pair.wait_all_blocks_free()


def test_continuation_finds_its_response_on_either_of_two_frontends(pair):
    """Two frontends share the port; each fresh connection lands on either. A response
    stored by one is continued, retrieved and deleted through the other (counted as
    peer lookups), and the id names the frontend that stored it."""
    client = openai.OpenAI(base_url=pair.base_url + "/v1", api_key="unused", max_retries=0)
    seen = set()
    for _ in range(40):
        seen.add(json.loads(pair.get("/version")[1])["frontend"])
        if len(seen) == 2:
            break
    assert seen == {0, 1}, "every connection landed on one frontend"
    first = client.responses.create(model=MODEL, input="One", max_output_tokens=3,
                                    temperature=0)

    def peer_lookups() -> float:
        return scrape(pair).total("candor_responses_store_lookups_total", where="peer",
                                  result="found")

    before = peer_lookups()
    owners = set()
    for _ in range(40):  # fresh connections until some landed on the other frontend
        fresh = openai.OpenAI(base_url=pair.base_url + "/v1", api_key="unused",
                              max_retries=0)
        # not stored: three stored continuations on first's frontend would evict it
        nxt = fresh.responses.create(model=MODEL, input="Two", previous_response_id=first.id,
                                     max_output_tokens=3, temperature=0, store=False)
        owners.add(nxt.id[-2])
        assert fresh.responses.retrieve(first.id).id == first.id
        if peer_lookups() - before >= 2 and len(owners) == 2:
            break
    assert peer_lookups() - before >= 2 and owners == {"0", "1"}
    client.responses.delete(first.id)
    for _ in range(6):
        fresh = openai.OpenAI(base_url=pair.base_url + "/v1", api_key="unused",
                              max_retries=0)
        with pytest.raises(openai.NotFoundError) as err:
            fresh.responses.retrieve(first.id)
        assert "deleted" in err.value.body["message"]


def test_store_bounds_say_what_became_of_an_id(pair):
    """max_entries 3 per frontend: the oldest goes first and its id's 404 says so; the
    store's size and removals are on /metrics."""
    client = openai.OpenAI(base_url=pair.base_url + "/v1", api_key="unused", max_retries=0)
    made = [client.responses.create(model=MODEL, input=f"n{i}", max_output_tokens=1)
            for i in range(8)]
    by_owner: dict[str, list[str]] = {}
    for r in made:
        by_owner.setdefault(r.id[-2], []).append(r.id)
    owner, ids = max(by_owner.items(), key=lambda kv: len(kv[1]))
    assert len(ids) >= 4
    with pytest.raises(openai.NotFoundError) as err:
        client.responses.retrieve(ids[0])
    assert "max_entries" in err.value.body["message"]
    assert client.responses.retrieve(ids[-1]).id == ids[-1]
    metrics = scrape(pair)
    assert metrics.total("candor_responses_store_removed_total", reason="max_entries") >= 1
    assert 0 < metrics.total("candor_responses_store_entries") <= 6


def test_store_expires_and_evicts_by_bytes():
    """The store alone, on a fake clock: TTL, the byte bound, an entry too large to
    keep, and the reason each id is gone."""
    now = [0.0]
    store = ResponseStore(ResponsesStoreSpec(max_entries=10, max_bytes=100, ttl_s=5.0),
                          clock=lambda: now[0])
    store.put("a", b"x" * 40)
    store.put("b", b"x" * 40)
    store.put("c", b"x" * 40)  # 120 bytes: "a" goes
    with pytest.raises(Exception, match="max_bytes"):
        store.get("a")
    assert store.get("c") and store.size == 80
    assert not store.put("big", b"x" * 101)
    with pytest.raises(Exception, match="exceed"):
        store.get("big")
    now[0] = 6.0
    with pytest.raises(Exception, match="expired"):
        store.get("b")
    assert len(store) == 0 and store.size == 0


def test_agents_sdk_runs_a_tool_agent(server):
    """The OpenAI Agents SDK over /v1/responses: the agent must call its tool (tool_choice
    required, constrained), gets the result, then answers in its output type (json_schema,
    constrained), run whole and streamed."""
    from agents import (Agent, ModelSettings, OpenAIResponsesModel, Runner, function_tool,
                        set_tracing_disabled)

    set_tracing_disabled(True)
    calls: list[tuple[str, int]] = []

    @function_tool
    def get_weather(city: str, days: int) -> str:
        """Weather in a city for some days."""
        calls.append((city, days))
        return f"{city}: sunny for {days} days"

    class Report(BaseModel):
        sunny: bool

    def make_agent() -> Agent:  # an async client belongs to the event loop it runs on
        model = OpenAIResponsesModel(model=MODEL, openai_client=openai.AsyncOpenAI(
            base_url=server.base_url + "/v1", api_key="unused", max_retries=0))
        return Agent(name="weather", instructions="Use the tool.", tools=[get_weather],
                     model=model, output_type=Report,
                     model_settings=ModelSettings(tool_choice="required", max_tokens=120,
                                                  temperature=0))

    result = Runner.run_sync(make_agent(), "Weather in Paris?")
    assert isinstance(result.final_output, Report)
    assert len(calls) >= 1 and all(isinstance(c[0], str) for c in calls)
    kinds = [item.type for item in result.new_items]
    assert "tool_call_item" in kinds and "tool_call_output_item" in kinds

    async def streamed():
        run = Runner.run_streamed(make_agent(), "Weather in Rome?")
        events = [e.type async for e in run.stream_events()]
        return run.final_output, events

    before = len(calls)
    output, events = asyncio.run(streamed())
    assert isinstance(output, Report) and len(calls) > before
    assert "raw_response_event" in events
