"""/v1/responses' slice of the field table (prose: docs/fields/responses.yaml).

A Responses request runs on the chat pipeline (``translate.to_chat``). The chat fields it
takes under their chat names are not listed again here: ``PASSTHROUGH`` and the
``as chat`` row are derived from ``ResponsesRequest`` and the chat table, so a chat field
added to the request struct is passed on, published and documented with no other edit.
"""

from __future__ import annotations

from api_frontend.endpoints.chat.fields import TABLE as CHAT
from api_frontend.field_policy import UNKNOWN, FieldTable, Foreign, Row
from protocol.responses_api import ResponsesRequest

_NOT_USED = "accepted for compatibility; Candor does not use it"
OWN_ROWS: tuple[Row, ...] = (
    Row(("model",), "honoured"),
    Row(("input",), "honoured"),
    Row(("instructions",), "honoured"),
    Row(("max_output_tokens",), "honoured", clamps=True),
    Row(("temperature", "top_p"), "honoured"),
    Row(("tools",), "honoured"),
    Row(("tool_choice", "parallel_tool_calls"), "honoured"),
    Row(("text",), "honoured"),
    Row(("reasoning.effort", "reasoning.summary", "reasoning.generate_summary"), "ignored",
        reason="Candor has no reasoning-effort control and writes no summaries; thinking "
        "follows the chat template's switch (`chat_template_kwargs`) and the reasoning text "
        "is returned whole"),
    Row(("text.verbosity",), "ignored", reason="Candor has no verbosity control"),
    Row(("stream",), "honoured"),
    Row(("stream_options.include_obfuscation",), "ignored",
        reason="Candor never adds obfuscation padding to stream events"),
    Row(("store", "previous_response_id"), "honoured"),
    Row(("metadata",), "honoured"),
    Row(("truncation",), "honoured"),
    Row(("include",), "honoured"),
    Row(("user", "safety_identifier", "prompt_cache_key", "prompt_cache_retention",
         "prompt_cache_options", "service_tier", "max_tool_calls"), "ignored",
        reason=_NOT_USED + " (no per-user policy, one service tier, routing and caching "
        "follow the prompt prefix, no built-in tools to cap)"),
    Row(("priority",), "extension", only_with="priority_scheduling"),
    Row((UNKNOWN,), "ignored", reason="not a field Candor knows"),
)

# chat fields this API takes in its own shape, built into chat's by ``translate.to_chat``
BUILT_HERE = frozenset({"model", "tools", "tool_choice", "stream_options"})


def _as_chat(own: tuple[Row, ...]) -> tuple[str, ...]:
    """The request's chat fields that have no row of their own here and are not built
    here: extensions, checked and honoured by the chat pipeline exactly as on chat."""
    named = {f for row in own for f in row.fields} | BUILT_HERE
    return tuple(f for f in ResponsesRequest.__struct_fields__
                 if CHAT.tier(f) is not None and f not in named)


ROWS: tuple[Row, ...] = (*OWN_ROWS[:-2], Row(_as_chat(OWN_ROWS), "extension", key="as chat"),
                         *OWN_ROWS[-2:])

_NOT_BUILT = "not built on /v1/responses"
# OpenAI Responses fields Candor does not build: a 400 naming them (harmless values pass)
UNBUILT: tuple[Foreign, ...] = (
    Foreign("background", "rejected", _NOT_BUILT + ": a response runs while its request "
            "waits (stream it, or retry)", (False,)),
    Foreign("background_options", "rejected", _NOT_BUILT + " (no background responses)"),
    Foreign("conversation", "rejected", _NOT_BUILT + ": no conversation objects; continue "
            "with `previous_response_id`"),
    Foreign("prompt", "rejected", _NOT_BUILT + ": no stored prompt templates; send "
            "`instructions` and `input`"),
    Foreign("context_management", "rejected", _NOT_BUILT + ": no compaction"),
    Foreign("moderation", "rejected", _NOT_BUILT + ": no moderation models"),
    Foreign("top_logprobs", "rejected", _NOT_BUILT + ": no logprobs (use "
            "/v1/chat/completions)", (0,)),
)

TABLE = FieldTable("responses", ROWS, UNBUILT, shared_foreign=CHAT.own_foreign)

# what goes to the chat pipeline as it came: every chat field of the request but those
# built here and those ignored here (the report says so; chat never sees them)
PASSTHROUGH: tuple[str, ...] = tuple(
    f for f in ResponsesRequest.__struct_fields__
    if CHAT.tier(f) is not None and f not in BUILT_HERE
    and TABLE.tier(f) != "ignored")
