"""/v1/score's slice of the field table (prose: docs/fields/score.yaml)."""

from __future__ import annotations

from api_frontend.field_policy import UNKNOWN, FieldTable, Foreign, Row

_USER = "accepted for compatibility; Candor does not use it (no per-user policy)"
ROWS: tuple[Row, ...] = (
    Row(("model",), "honoured"),
    Row(("text_1",), "honoured"),
    Row(("text_2",), "honoured"),
    Row(("user",), "ignored", reason=_USER),
    Row(("strict",), "extension"),
    Row(("priority",), "extension", only_with="priority_scheduling"),
    Row((UNKNOWN,), "ignored", reason="not a field Candor knows"),
)
# vLLM's score fields Candor does not build: each would change the scores
FOREIGN: tuple[Foreign, ...] = (
    Foreign("truncate_prompt_tokens", "rejected", "inputs are never truncated: a pair longer "
            "than the context is a 400 naming it"),
    Foreign("activation", "rejected", "the score is the sigmoid of a one-logit head (or the "
            "cosine of two embeddings)", (True,)),
    Foreign("queries", "rejected", "send `text_1`"),
    Foreign("documents", "rejected", "send `text_2` (or use /v1/rerank)"),
    Foreign("request_id", "ignored", "send the X-Request-Id header instead; it is echoed"),
)
TABLE = FieldTable("score", ROWS, FOREIGN, sampling_defaults=False)
