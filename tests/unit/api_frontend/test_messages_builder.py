"""A ``/v1/messages`` reply (``endpoints/messages/builder.py``) and chat's reasoning-token
count, however the text is split into deltas.

The reference is the reply fed one character at a time; every two-piece split and the
whole reply in one delta must build the same content blocks, the stream's events must come
in Anthropic's order (message_start, ping, each block started, grown and stopped before
the next, message_delta, message_stop) and their deltas must add up to the blocks. The
stop_reason follows what ended the reply (the limit, a stop string, a finished call)."""

from __future__ import annotations

import json

import msgspec
import pytest

from api_frontend.endpoints.chat.assembler import ChatAssembler
from api_frontend.endpoints.messages.builder import MessageBuilder
from api_frontend.errors import ApiError
from api_frontend.assembly import Collected
from api_frontend.tools import ToolPlan
from protocol import ipc
from protocol.anthropic_api import Message, Usage

TOOLS = [{"type": "function", "function": {"name": "get_weather"}}]
CALL = '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}</tool_call>'
PROMPT, CACHED = 40, 16


def _deltas(pieces: list[str], finish: str = "stop", stop_string: str | None = None):
    out = []
    for i, piece in enumerate(pieces):
        last = i == len(pieces) - 1
        out.append(ipc.TextDelta("r", piece, finish if last else None, PROMPT, (i + 1) * 2,
                                 cached_tokens=CACHED, stop_string=stop_string if last else None))
    return out


def _build(pieces, tools=None, parser=None, finish="stop", stop_string=None, streaming=True):
    builder = MessageBuilder(Message("msg_1", "m", [], Usage(0, 0)), tools, parser, streaming)
    for d in _deltas(pieces, finish, stop_string):
        builder.feed(d)
    builder.finish()
    events = [json.loads(block.split(b"\ndata: ", 1)[1]) for block in
              builder.take().split(b"\n\n") if block]
    return builder.message, events


def _norm(message: Message | dict) -> dict:
    """The message without what the split decides (usage: the test's token counts) or
    chance does (call ids)."""
    out = msgspec.to_builtins(message) if isinstance(message, Message) else dict(message)
    out.pop("usage", None)
    out["content"] = [{k: v for k, v in b.items() if k != "id"} for b in out["content"]]
    return out


def check_order(events: list[dict]) -> None:
    types = [e["type"] for e in events]
    assert types[:2] == ["message_start", "ping"]
    assert types[-2:] == ["message_delta", "message_stop"]
    assert events[0]["message"]["content"] == [] and events[0]["message"]["stop_reason"] is None
    open_index = None
    for e in events[2:-2]:
        if e["type"] == "content_block_start":
            assert open_index is None, "a block started before the last one stopped"
            open_index = e["index"]
        elif e["type"] == "content_block_delta":
            assert e["index"] == open_index
        else:
            assert e["type"] == "content_block_stop" and e["index"] == open_index
            open_index = None
    assert open_index is None


def _from_events(events: list[dict]) -> list[dict]:
    """The blocks the events describe, as a client accumulates them."""
    blocks: list[dict] = []
    partial: dict[int, str] = {}
    for e in events:
        if e["type"] == "content_block_start":
            blocks.append(dict(e["content_block"]))
        elif e["type"] == "content_block_delta":
            d, block = e["delta"], blocks[e["index"]]
            if d["type"] == "text_delta":
                block["text"] += d["text"]
            elif d["type"] == "thinking_delta":
                block["thinking"] += d["thinking"]
            else:
                partial[e["index"]] = partial.get(e["index"], "") + d["partial_json"]
    for index, text in partial.items():
        blocks[index]["input"] = json.loads(text)
    return blocks


CASES = {
    "text": (None, None, "Hello there, friend."),
    "reasoning-then-text": (None, "deepseek_r1", "<think>Let me see.</think>It is sunny."),
    "text-then-call": (ToolPlan(TOOLS, "auto", parser_name="hermes"), None, "Sure. " + CALL),
    "reasoning-then-call": (ToolPlan(TOOLS, "auto", parser_name="hermes"), "deepseek_r1",
                            "<think>Weather?</think>" + CALL),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_every_split_builds_the_same_blocks_in_anthropics_order(name):
    tools, parser, reply = CASES[name]
    reference, _ = _build(list(reply), tools, parser, streaming=False)
    ref = _norm(reference)
    for cut in range(1, len(reply)):
        message, events = _build([reply[:cut], reply[cut:]], tools, parser)
        check_order(events)
        assert _norm(message) == ref, cut
        assert _norm({"content": _from_events(events)})["content"] == ref["content"], cut
        assert events[-2]["usage"] == msgspec.to_builtins(message.usage)
    whole, _ = _build([reply], tools, parser, streaming=False)
    assert _norm(whole) == ref


def test_blocks_usage_and_stop_reasons():
    message, _ = _build(list(CASES["reasoning-then-call"][2]), *CASES["reasoning-then-call"][:2])
    assert [b.__struct_config__.tag for b in message.content] == ["thinking", "tool_use"]
    assert message.content[0].thinking == "Weather?"
    assert message.content[1].input == {"city": "Paris", "days": 3}
    assert message.stop_reason == "tool_use"
    # the reasoning's share of the output (up to the delta that began the answer)
    assert 0 < message.usage.output_tokens_details.thinking_tokens < message.usage.output_tokens
    # the prefix cache's share of the prompt is cache_read, the rest input_tokens
    assert (message.usage.input_tokens, message.usage.cache_read_input_tokens) == (
        PROMPT - CACHED, CACHED)
    cut, _ = _build(["Sure. ", CALL[:-25]], ToolPlan(TOOLS, "auto", parser_name="hermes"),
                    finish="length")
    assert cut.stop_reason == "max_tokens" and cut.content[-1].input == {}
    stopped, events = _build(["Hello"], stop_string="END")
    assert (stopped.stop_reason, stopped.stop_sequence) == ("stop_sequence", "END")
    assert events[-2]["delta"] == {"stop_reason": "stop_sequence", "stop_sequence": "END"}
    ended, _ = _build(["Hello"])
    assert ended.stop_reason == "end_turn" and ended.stop_sequence is None
    assert "output_tokens_details" not in msgspec.to_builtins(ended.usage)  # no parser


def test_a_failure_mid_stream_is_an_error_event_in_anthropics_shape():
    builder = MessageBuilder(Message("msg_1", "m", [], Usage(0, 0)), None, None, True)
    builder.feed(_deltas(["Hel", "lo"])[0])
    builder.fail(ApiError(503, "the engine went away", None, "replica_lost"))
    events = [json.loads(b.split(b"\ndata: ", 1)[1]) for b in builder.take().split(b"\n\n") if b]
    assert [e["type"] for e in events] == ["message_start", "ping", "content_block_start",
                                           "content_block_delta", "content_block_stop", "error"]
    assert events[-1]["error"] == {"type": "overloaded_error", "message": "the engine went away"}
    assert builder.finish_reason == "error"


@pytest.mark.parametrize("reply, spent", [
    ("<think>Let me think.</think>Answer.", 4),  # the deltas before the answer's
    ("<think>Still thinking", 6),  # no answer began: every token
    ("No reasoning at all.", 0),
])
def test_chat_counts_reasoning_tokens_whole_and_streamed_alike(reply, spent):
    """usage.completion_tokens_details.reasoning_tokens: the completion tokens before the
    delta that began the answer, the same in the whole body and the streamed usage."""
    pieces = [reply[:8], reply[8:20], reply[20:]]
    deltas = _deltas(pieces)
    got = Collected()
    for d in deltas:
        got.add(d)
    assembler = ChatAssembler("id", 0, "m", False, reasoning_parser="qwen3")
    whole = assembler.final([got])
    assert whole.usage.completion_tokens_details.reasoning_tokens == spent
    streaming = ChatAssembler("id", 0, "m", False, reasoning_parser="qwen3")
    for d in deltas:
        streaming.chunk(0, d, with_usage=False)
    assert streaming.usage_chunk(deltas[-1:]).usage.completion_tokens_details.reasoning_tokens \
        == spent
    plain = ChatAssembler("id", 0, "m", False).final([got])
    assert "completion_tokens_details" not in msgspec.to_builtins(plain.usage)
