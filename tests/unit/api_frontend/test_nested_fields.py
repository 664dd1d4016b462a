"""Unknown fields inside a request's objects (``field_policy.nested_unknown``): a typed
decode drops them without a word, so they are named by their JSON path, to be reported as
ignored like an unknown top-level field (strict: a 400)."""

from __future__ import annotations

import msgspec

from api_frontend.field_policy import nested_unknown
from api_frontend.json_body import decode_request
from protocol.anthropic_api import MessagesRequest

BASE = {"model": "m", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]}


def _unknown(body: dict) -> list[str]:
    req, keys = decode_request(msgspec.json.encode(body), MessagesRequest)
    return nested_unknown(keys, req)


def test_a_request_of_known_fields_has_none():
    assert _unknown({**BASE, "metadata": {"user_id": "u"}, "thinking": {
        "type": "enabled", "budget_tokens": 10}, "tool_choice": {"type": "auto"}}) == []


def test_unknown_fields_are_named_by_path_in_objects_lists_and_tagged_blocks():
    body = {**BASE, "metadata": {"user_id": "u", "tenant": "t"},
            "thinking": {"type": "adaptive", "depth": 3},
            "output_config": {"format": {"type": "json_schema", "schema": {"x": 1},
                                         "name": "n"}},
            "tools": [{"name": "a", "input_schema": {"type": "object"}},
                      {"name": "b", "input_schema": {}, "color": "red"}],
            "messages": [{"role": "user", "content": [{"type": "text", "text": "hi",
                                                       "lang": "en"}], "name": "bob"}]}
    assert sorted(_unknown(body)) == [
        "messages[0].content[0].lang", "messages[0].name", "metadata.tenant",
        "output_config.format.name", "thinking.depth", "tools[1].color"]


def test_free_form_objects_and_nulls_are_not_unknown_fields():
    """A tool's input_schema, a tool_use block's input are the client's own objects; a
    null is an unset field (an SDK's model_dump() sends ``caller: None``)."""
    body = {**BASE, "tools": [{"name": "a", "input_schema": {"anything": {"goes": 1}}}],
            "messages": [{"role": "assistant", "content": [
                {"type": "tool_use", "id": "t", "name": "a", "input": {"free": 1},
                 "caller": None}]}]}
    assert _unknown(body) == []
