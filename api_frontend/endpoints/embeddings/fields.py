"""/v1/embeddings' slice of the field table (prose: docs/fields/embeddings.yaml)."""

from __future__ import annotations

from api_frontend.field_policy import UNKNOWN, FieldTable, Foreign, Row

ROWS: tuple[Row, ...] = (
    Row(("model",), "honoured"),
    Row(("input",), "honoured"),
    Row(("encoding_format",), "honoured"),
    Row(("dimensions",), "honoured"),
    Row(("user",), "ignored",
        reason="accepted for compatibility; Candor does not use it (no per-user policy)"),
    Row(("add_special_tokens",), "extension"),
    Row(("strict",), "extension"),
    Row(("priority",), "extension", only_with="priority_scheduling"),
    Row((UNKNOWN,), "ignored", reason="not a field Candor knows"),
)

_NO_EMBED = "not built on /v1/embeddings"
FOREIGN: tuple[Foreign, ...] = (
    Foreign("truncate_prompt_tokens", "rejected", "inputs are never truncated: one longer "
            "than the context is a 400 naming it"),
    Foreign("normalize", "rejected", _NO_EMBED + ": the model's own files say whether "
            "vectors are normalised"),
    Foreign("embed_dtype", "rejected", _NO_EMBED + ": vectors are float32", ("float32",)),
    Foreign("endianness", "rejected", _NO_EMBED + ": base64 is little-endian float32",
            ("little",)),
    Foreign("messages", "rejected", "chat-form embedding inputs are not built; send `input`"),
    Foreign("request_id", "ignored", "send the X-Request-Id header instead; it is echoed"),
    Foreign("cache_salt", "ignored", "embeddings never use the prefix cache"),
)

# embeddings take no sampling: a deployment's sampling defaults are not theirs
TABLE = FieldTable("embeddings", ROWS, FOREIGN, sampling_defaults=False)
