"""/classify's slice of the field table (prose: docs/fields/classify.yaml)."""

from __future__ import annotations

from api_frontend.field_policy import UNKNOWN, FieldTable, Foreign, Row

ROWS: tuple[Row, ...] = (
    Row(("model",), "honoured"),
    Row(("input",), "honoured"),
    Row(("user",), "ignored",
        reason="accepted for compatibility; Candor does not use it (no per-user policy)"),
    Row(("strict",), "extension"),
    Row(("priority",), "extension", only_with="priority_scheduling"),
    Row((UNKNOWN,), "ignored", reason="not a field Candor knows"),
)
FOREIGN: tuple[Foreign, ...] = (
    Foreign("truncate_prompt_tokens", "rejected", "inputs are never truncated: one longer "
            "than the context is a 400 naming it"),
    Foreign("activation", "rejected", "probabilities are the softmax of the head's logits (one label: the sigmoid of its logit)", (True,)),
    Foreign("request_id", "ignored", "send the X-Request-Id header instead; it is echoed"),
)
TABLE = FieldTable("classify", ROWS, FOREIGN, sampling_defaults=False)
