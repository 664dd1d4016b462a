"""/v1/chat/completions' slice of the field table: the generation pipeline's rows and the
fields only chat takes (prose: docs/fields/generation.yaml)."""

from __future__ import annotations

from api_frontend.field_policy import FieldTable, Row
from api_frontend.generation_fields import FOREIGN, GENERATION_ROWS

ROWS: tuple[Row, ...] = (
    Row(("max_completion_tokens",), "honoured", clamps=True),
    Row(("logprobs", "top_logprobs"), "honoured"),
    Row(("messages",), "honoured"),
    Row(("tools",), "honoured"),
    Row(("tool_choice",), "honoured"),
    Row(("parallel_tool_calls",), "honoured"),
    Row(("response_format",), "honoured"),
    Row(("add_generation_prompt", "continue_final_message"), "extension"),
    Row(("chat_template_kwargs",), "extension"),
    Row(("chat_template",), "extension", only_with="allow_request_chat_template"),
    Row(("echo",), "extension"),
)

TABLE = FieldTable("chat", GENERATION_ROWS + ROWS, FOREIGN)
