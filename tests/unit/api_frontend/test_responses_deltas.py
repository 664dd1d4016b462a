"""A ``/v1/responses`` reply is the same however its text is split into deltas.

The detokenizer hands the builder (``api_frontend/endpoints/responses/builder.py``) whatever text
one step released: one token's, several (a stop string held back, speculative decoding),
or the whole reply. The reference is the reply fed one character at a time (no token is
shorter); every other split must give the same output items and the same stream events
once consecutive text / argument deltas of one item are merged (their grouping is the
split's), for every parser, with text before, between and after calls, several calls and
reasoning before them. Every split into two pieces is tried, then random splits
(hypothesis)."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from api_frontend.endpoints.responses.builder import ResponseBuilder
from api_frontend.tool_parsers.deepseek_v31 import CALL_BEGIN, CALL_END, CALLS_BEGIN, CALLS_END, SEP
from api_frontend.tools import ToolPlan
from protocol import ipc
from protocol.responses_api import ResponseObject

TOOLS = [{"type": "function", "function": {"name": "get_weather"}},
         {"type": "function", "function": {"name": "get_time"}}]
WEATHER = '{"city": "Paris", "days": 3}'
TIME = '{"zone": "UTC"}'


def _hermes(name: str, args: str) -> str:
    return f'<tool_call>{{"name": "{name}", "arguments": {args}}}</tool_call>'


def _deepseek(name: str, args: str) -> str:
    return f"{CALL_BEGIN}{name}{SEP}{args}{CALL_END}"


# name -> (tool plan, reasoning parser, reply)
REPLIES: dict[str, tuple[ToolPlan, str | None, str]] = {
    "hermes-text-around-two-calls": (
        ToolPlan(TOOLS, "auto", parser_name="hermes"), None,
        f"Sure. {_hermes('get_weather', WEATHER)} Then the time:\n{_hermes('get_time', TIME)} Done."),
    "hermes-calls-only": (
        ToolPlan(TOOLS, "auto", parser_name="hermes"), None,
        _hermes("get_time", TIME) + _hermes("get_weather", WEATHER)),
    "hermes-not-a-call-then-a-call": (
        ToolPlan(TOOLS, "auto", parser_name="hermes"), None,
        '<tool_call>{"name": "nope", "arguments": {}}</tool_call> ok ' + _hermes("get_time", TIME) + "!"),
    "hermes-after-reasoning": (
        ToolPlan(TOOLS, "auto", parser_name="hermes"), "deepseek_r1",
        f"<think>Which city?</think>Paris it is. {_hermes('get_weather', WEATHER)}Bye."),
    "hermes-cut-inside-a-call": (
        ToolPlan(TOOLS, "auto", parser_name="hermes"), None,
        f"Look: {_hermes('get_time', TIME)}and {_hermes('get_weather', WEATHER)[:-20]}"),
    "mistral-text-then-calls-then-text": (
        ToolPlan(TOOLS, "auto", parser_name="mistral"), None,
        f'Checking.[TOOL_CALLS][{{"name": "get_weather", "arguments": {WEATHER}}}, '
        f'{{"name": "get_time", "arguments": {TIME}}}] trailing words'),
    "llama3_json-two-calls": (
        ToolPlan(TOOLS, "auto", parser_name="llama3_json"), None,
        f'{{"name": "get_time", "parameters": {TIME}}}; {{"name": "get_weather", "parameters": {WEATHER}}}'),
    "deepseek_v31-text-calls-text": (
        ToolPlan(TOOLS, "auto", parser_name="deepseek_v31"), None,
        f"Let me see. {CALLS_BEGIN}{_deepseek('get_time', TIME)} {_deepseek('get_weather', WEATHER)}"
        f"{CALLS_END} All done."),
    "pythonic": (
        ToolPlan(TOOLS, "auto", parser_name="pythonic"), None,
        "[get_time(zone='UTC'), get_weather(city='Paris', days=3)]"),
    "required": (
        ToolPlan(TOOLS, "required"), None,
        f'[{{"name": "get_weather", "parameters": {WEATHER}}}, {{"name": "get_time", "parameters": {TIME}}}]'),
    "named": (ToolPlan(TOOLS, "named", "get_time"), None, TIME),
    "text-only-with-reasoning": (None, "deepseek_r1", "<think>hmm, let me think</think>  The answer is 4.  "),
}
MERGED = ("response.output_text.delta", "response.reasoning_text.delta",
          "response.function_call_arguments.delta")


def _run(name: str, cuts: list[int]) -> tuple[list[dict], list[dict]]:
    """The stream's events (normalised, see the module docstring) and the final output
    items of reply ``name`` fed in pieces ending at ``cuts`` (and at its end)."""
    plan, reasoning, reply = REPLIES[name]
    response = ResponseObject(id="resp_x", created_at=0, status="in_progress", model="m")
    builder = ResponseBuilder(response, plan, reasoning, streaming=True)
    builder.start()
    ends = sorted({c for c in cuts if 0 < c < len(reply)} | {len(reply)})
    start = 0
    for end in ends:
        builder.feed(ipc.TextDelta("r", reply[start:end], "stop" if end == len(reply) else None,
                                   5, end))
        start = end
    builder.finish()
    ids: dict[str, str] = {}

    def plain(value):  # ids numbered in order of appearance: they are random
        if isinstance(value, dict):
            return {k: (ids.setdefault(v, f"id{len(ids)}") if k in ("id", "item_id", "call_id")
                        else plain(v)) for k, v in value.items()
                    if k not in ("sequence_number", "output_tokens_details")}
        if isinstance(value, list):
            return [plain(v) for v in value]
        return value

    events: list[dict] = []
    for block in builder.take().decode().split("\n\n"):
        if not block:
            continue
        event = plain(json.loads(block.split("\ndata: ", 1)[1]))
        last = events[-1] if events else None
        if (last is not None and event["type"] in MERGED and last["type"] == event["type"]
                and last["item_id"] == event["item_id"]):
            last["delta"] += event["delta"]
        else:
            events.append(event)
    return events, events[-1]["response"]["output"]


_REFERENCES: dict[str, tuple[list[dict], list[dict]]] = {}


def _reference(name: str) -> tuple[list[dict], list[dict]]:
    """One character per delta."""
    if name not in _REFERENCES:
        _REFERENCES[name] = _run(name, list(range(1, len(REPLIES[name][2]))))
    return _REFERENCES[name]


def _assert_like_the_reference(name: str, cuts: list[int]) -> None:
    events, output = _run(name, cuts)
    want_events, want_output = _reference(name)
    assert output == want_output, f"{name} split at {cuts}: other output items"
    assert [e["type"] for e in events] == [e["type"] for e in want_events], f"{name} split at {cuts}"
    assert events == want_events, f"{name} split at {cuts}: other events"


def test_the_references_hold_what_each_reply_says():
    """The character-at-a-time references are right: items in the order the text has them."""
    kinds = {name: [item["type"] for item in _reference(name)[1]] for name in REPLIES}
    assert kinds["hermes-text-around-two-calls"] == ["message", "function_call", "message",
                                                     "function_call", "message"]
    assert kinds["hermes-after-reasoning"] == ["reasoning", "message", "function_call", "message"]
    assert kinds["mistral-text-then-calls-then-text"] == ["message", "function_call",
                                                          "function_call", "message"]
    assert kinds["deepseek_v31-text-calls-text"] == ["message", "function_call",
                                                     "function_call", "message"]
    assert kinds["pythonic"] == kinds["required"] == ["function_call", "function_call"]
    output = _reference("hermes-text-around-two-calls")[1]
    assert [json.loads(item["arguments"]) for item in output if item["type"] == "function_call"] == [
        json.loads(WEATHER), json.loads(TIME)]
    assert output[0]["content"][0]["text"] == "Sure."
    assert _reference("hermes-cut-inside-a-call")[1][-1]["status"] == "incomplete"


@pytest.mark.parametrize("name", sorted(REPLIES))
def test_every_split_in_two_and_the_whole_reply_in_one_delta(name):
    reply = REPLIES[name][2]
    _assert_like_the_reference(name, [])  # one delta
    for cut in range(1, len(reply)):
        _assert_like_the_reference(name, [cut])


@settings(max_examples=300, deadline=None)
@given(name=st.sampled_from(sorted(REPLIES)), data=st.data())
def test_random_splits(name, data):
    reply = REPLIES[name][2]
    cuts = data.draw(st.lists(st.integers(1, len(reply) - 1), max_size=12), label="cuts")
    _assert_like_the_reference(name, cuts)
