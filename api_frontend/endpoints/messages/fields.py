"""/v1/messages' slice of the field table (prose: docs/fields/messages.yaml).

A Messages request runs on the chat pipeline (``translate.to_chat``): every field here is
built into its chat twin there, so the report's tiers are these, under Anthropic's names.
``/v1/messages/count_tokens`` takes the prompt's fields of the same table.
"""

from __future__ import annotations

from api_frontend.field_policy import UNKNOWN, FieldTable, Foreign, Row

# a field the table does not have, top-level or inside an object (``nested_unknown``)
UNKNOWN_REASON = "not a field Candor knows"

ROWS: tuple[Row, ...] = (
    Row(("model",), "honoured"),
    Row(("messages",), "honoured"),
    Row(("system",), "honoured"),
    Row(("max_tokens",), "honoured", clamps=True),
    Row(("stop_sequences",), "honoured"),
    Row(("temperature", "top_p", "top_k"), "honoured"),
    Row(("stream",), "honoured"),
    Row(("tools",), "honoured"),
    Row(("tool_choice",), "honoured"),
    Row(("thinking",), "honoured"),
    Row(("thinking.budget_tokens",), "ignored",
        reason="Candor does not cap reasoning apart from the reply: max_tokens bounds both"),
    Row(("thinking.display",), "ignored",
        reason="the reasoning text is always returned whole (nothing is summarized or signed)"),
    Row(("output_config.format",), "honoured"),
    Row(("output_config.effort",), "ignored", reason="Candor has no reasoning-effort control"),
    Row(("cache_control",), "honoured"),
    Row(("metadata.user_id",), "ignored",
        reason="accepted for compatibility; Candor does not use it (no per-user policy)"),
    Row(("service_tier", "speed", "inference_geo"), "ignored",
        reason="Candor has one service tier and one speed, and runs where it is deployed"),
    Row(("diagnostics", "user_profile_id", "workspace_id"), "ignored",
        reason="accepted for compatibility; Candor does not use it (no accounts or "
        "workspaces)"),
    Row(("strict",), "extension"),
    Row((UNKNOWN,), "ignored", reason=UNKNOWN_REASON),
)

_NOT_BUILT = "not built on /v1/messages"
# Anthropic fields Candor does not build: a 400 naming them (harmless values pass)
UNBUILT: tuple[Foreign, ...] = (
    Foreign("mcp_servers", "rejected", _NOT_BUILT + ": no MCP connector; give the tools as "
            "`tools`", ([],)),
    Foreign("container", "rejected", _NOT_BUILT + ": no code-execution containers"),
    Foreign("context_management", "rejected", _NOT_BUILT + ": no context editing"),
)

TABLE = FieldTable("messages", ROWS, UNBUILT)
