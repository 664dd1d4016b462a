"""/v1/completions' slice of the field table: the generation pipeline's rows and the
fields only completions takes (prose: docs/fields/generation.yaml)."""

from __future__ import annotations

from api_frontend.field_policy import FieldTable, Row
from api_frontend.generation_fields import FOREIGN, GENERATION_ROWS

ROWS: tuple[Row, ...] = (
    Row(("logprobs", "echo"), "honoured"),
    Row(("prompt",), "honoured"),
    Row(("suffix",), "ignored", reason="accepted for compatibility; insertion "
        "(fill-in-the-middle) is not implemented"),
    Row(("response_format",), "extension"),  # as vLLM; chat's is an OpenAI field
)

TABLE = FieldTable("completions", GENERATION_ROWS + ROWS, FOREIGN)
