"""/v1/rerank's and /v2/rerank's slice of the field table (prose: docs/fields/rerank.yaml)."""

from __future__ import annotations

from api_frontend.endpoints.score.fields import FOREIGN as SCORE_FOREIGN
from api_frontend.field_policy import UNKNOWN, FieldTable, Foreign, Row

ROWS: tuple[Row, ...] = (
    Row(("model",), "honoured"),
    Row(("query",), "honoured"),
    Row(("documents",), "honoured"),
    Row(("top_n",), "honoured"),
    Row(("return_documents",), "honoured"),
    Row(("user",), "ignored",
        reason="accepted for compatibility; Candor does not use it (no per-user policy)"),
    Row(("strict",), "extension"),
    Row(("priority",), "extension", only_with="priority_scheduling"),
    Row((UNKNOWN,), "ignored", reason="not a field Candor knows"),
)
FOREIGN: tuple[Foreign, ...] = tuple(f for f in SCORE_FOREIGN if f.field not in ("queries", "documents")) + (
    Foreign("max_chunks_per_doc", "rejected", "documents are never split: one longer than "
            "the context is a 400 naming it"),
    Foreign("rank_fields", "rejected", "documents are strings; structured documents are not built"),
)
TABLE = FieldTable("rerank", ROWS, FOREIGN, sampling_defaults=False)
