"""/v1/responses in process: the conversation as chat messages, the chat pipeline's
errors under this API's names, and the event builder's order and failure path as the
openai SDK's own stream parser reads them."""

from __future__ import annotations

import json

import msgspec
import pytest

from api_frontend.errors import ApiError
from api_frontend.endpoints.responses.builder import ResponseBuilder
from api_frontend.endpoints.responses.translate import (chat_messages, input_items, responses_name,
                                                  to_chat)
from cluster.topology import RequestLimits
from protocol import ipc
from protocol.responses_api import ResponseObject, ResponsesRequest


def _items(raw):
    return input_items(raw, RequestLimits())


def test_items_become_chat_turns():
    """A reasoning item opens the assistant turn its text and calls join; consecutive calls
    are one turn; outputs are tool messages; instructions come first."""
    items = _items([
        {"role": "user", "content": [{"type": "input_text", "text": "Weather?"}]},
        {"type": "reasoning", "id": "rs_1", "summary": [],
         "content": [{"type": "reasoning_text", "text": "look it up"}]},
        {"type": "message", "role": "assistant",
         "content": [{"type": "output_text", "text": "Checking.", "annotations": []}]},
        {"type": "function_call", "call_id": "c1", "name": "w", "arguments": "{}"},
        {"type": "function_call", "call_id": "c2", "name": "t", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c1", "output": "sunny"},
        {"type": "function_call_output", "call_id": "c2",
         "output": [{"type": "input_text", "text": "noon"}]},
        {"role": "user", "content": "thanks"}])
    assert all(item.id for item in items)
    messages = chat_messages("Be brief.", items)
    assert [m["role"] for m in messages] == ["system", "user", "assistant", "tool", "tool",
                                             "user"]
    turn = messages[2]
    assert turn["reasoning_content"] == "look it up"
    assert turn["content"] == [{"type": "text", "text": "Checking."}]
    assert [c["id"] for c in turn["tool_calls"]] == ["c1", "c2"]
    assert messages[4] == {"role": "tool", "tool_call_id": "c2", "content": "noon"}


def test_a_reasoning_item_alone_is_its_own_turn():
    messages = chat_messages(None, _items([
        {"role": "user", "content": "hi"},
        {"type": "reasoning", "content": [{"type": "reasoning_text", "text": "hm"}]},
        {"role": "user", "content": "well?"}]))
    assert messages[1] == {"role": "assistant", "content": "", "reasoning_content": "hm"}
    assert messages[2]["role"] == "user"


@pytest.mark.parametrize("raw,param", [
    ([{"type": "item_reference", "id": "x"}], "input[0].type"),
    ([{"role": "user", "content": [{"type": "input_file", "file_id": "f"}]}],
     "input[0].content[0].type"),
    ([{"type": "function_call_output", "call_id": "c", "output": [{"type": "input_image"}]}],
     "input[0].output[0].type"),
    ([{"role": "robot", "content": "x"}], "input[0].role"),
    ([{"type": 7}], "input[0].type"),
])
def test_bad_items_name_their_path(raw, param):
    with pytest.raises(ApiError) as err:
        _items(raw)
    assert err.value.status == 400 and err.value.param == param


@pytest.mark.parametrize("chat_param,ours", [
    ("response_format.json_schema.schema", "text.format.schema"),
    ("max_completion_tokens", "max_output_tokens"),
    ("tools[3].function.name", "tools[3].name"),
    ("tool_choice.function.name", "tool_choice.name"),
    ("messages[2].content", "input"),
    ("temperature", "temperature"),
])
def test_chat_errors_take_this_apis_names(chat_param, ours):
    err = responses_name(ApiError(400, f"`{chat_param}` is wrong", chat_param))
    assert err.param == ours and err.message == f"`{ours}` is wrong"


def test_forced_calls_leave_no_text_to_format():
    req = msgspec.convert({"model": "m", "input": "x", "tool_choice": "required",
                           "tools": [{"type": "function", "name": "f"}],
                           "text": {"format": {"type": "json_object"}}}, ResponsesRequest)
    plan = to_chat(req, ["model", "input", "tool_choice", "tools", "text"], None,
                   RequestLimits())
    assert plan.chat.response_format is None
    assert [n.field for n in plan.notes] == ["text.format"]
    assert plan.chat.tools == [{"type": "function", "function": {"name": "f"}}]


def _delta(text: str, n: int, finish: str | None = None) -> ipc.TextDelta:
    return ipc.TextDelta("r", text, finish, 5, n, token_ids=[n])


def test_stream_events_parse_with_the_sdk_and_end_failed_on_error():
    """The frames the builder writes, read by the openai SDK's SSE decoder and its
    Responses stream state: every event accepted, text accumulated, then error and
    response.failed after a failure."""
    from openai.lib.streaming.responses._responses import ResponseStreamState
    from openai.types.responses import ResponseStreamEvent
    from openai._models import construct_type
    from openai import NOT_GIVEN

    response = ResponseObject(id="resp_x", created_at=0, status="in_progress", model="m")
    builder = ResponseBuilder(response, None, "deepseek_r1", streaming=True)
    builder.start()
    for n, text in enumerate(["think", "ing</th", "ink>Hel", "lo"], start=1):
        builder.feed(_delta(text, n))
    builder.fail(ApiError(500, "boom", None, "internal_error"))
    state = ResponseStreamState(input_tools=NOT_GIVEN, text_format=NOT_GIVEN)
    seen = []
    for block in builder.take().decode().split("\n\n"):
        if block:
            data = json.loads(block.split("\ndata: ", 1)[1])
            event = construct_type(type_=ResponseStreamEvent, value=data)
            seen += [e.type for e in state.handle_event(event)]
    assert seen[:2] == ["response.created", "response.in_progress"]
    assert seen[-2:] == ["error", "response.failed"]
    assert "response.reasoning_text.delta" in seen and "response.output_text.delta" in seen
    assert [type(o).__struct_config__.tag for o in response.output] == ["reasoning", "message"]
    assert response.output[0].content[0].text == "thinking"
    assert response.output[1].content[0].text == "Hello"
    assert response.output[1].status == "incomplete" and response.status == "failed"
    assert response.usage.output_tokens_details.reasoning_tokens == 2


@pytest.mark.parametrize("finish, status", [("stop", "completed"), ("length", "incomplete")])
def test_a_function_call_cut_before_its_end_is_an_incomplete_item(finish, status):
    """Policy (README): a reply that a stop or max_output_tokens ends inside a call keeps
    the call as far as it was written (its fragments were streamed); the item says it was
    cut (``incomplete``), as chat's finish_reason does (never tool_calls)."""
    from api_frontend.tools import ToolPlan
    plan = ToolPlan([{"type": "function", "function": {"name": "get_time"}}], "named",
                    "get_time")
    response = ResponseObject(id="resp_x", created_at=0, status="in_progress", model="m")
    builder = ResponseBuilder(response, plan, None, streaming=False)
    builder.start()
    builder.feed(_delta('{"zone": "U', 1))
    builder.feed(_delta("", 2, finish))
    builder.finish()
    [item] = response.output
    assert (item.name, item.arguments, item.status) == ("get_time", '{"zone": "U', "incomplete")
    assert response.status == status
    whole = ResponseObject(id="resp_y", created_at=0, status="in_progress", model="m")
    builder = ResponseBuilder(whole, plan, None, streaming=False)
    builder.start()
    builder.feed(_delta('{"zone": "UTC"}', 1, "stop"))
    builder.finish()
    assert whole.output[0].status == "completed" and whole.status == "completed"
