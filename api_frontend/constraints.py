"""Which constraint a request asks for: OpenAI's ``response_format`` or vLLM's
``guided_*`` / ``structured_outputs`` fields, as one ``GuidedSpec`` (at most one per
request; two are a 400 naming the second). The tokenizer worker compiles it."""

from __future__ import annotations

import json
from typing import Any

from api_frontend.errors import ApiError
from protocol.ipc import GuidedSpec

_STRUCTURED_KEYS = {"json": "json_schema", "regex": "regex", "choice": "choice",
                    "grammar": "grammar", "json_object": "json_object"}


def _schema_text(value: Any, field: str) -> str:
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError:
            raise ApiError(400, f"`{field}` must be a JSON schema (an object, or a string "
                           "holding one)", field, "invalid_value") from None
    if not isinstance(value, dict):
        raise ApiError(400, f"`{field}` must be a JSON schema object", field, "invalid_value")
    return json.dumps(value, ensure_ascii=False)


def _choices(value: Any, field: str) -> str:
    if not isinstance(value, list) or not value or not all(isinstance(c, str) for c in value):
        raise ApiError(400, f"`{field}` must be a non-empty list of strings", field,
                       "invalid_value")
    return json.dumps(value, ensure_ascii=False)


def _text(value: Any, field: str) -> str:
    if not isinstance(value, str) or not value:
        raise ApiError(400, f"`{field}` must be a non-empty string", field, "invalid_value")
    return value


def _response_format(rf: dict[str, Any]) -> GuidedSpec | None:
    kind = rf.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return GuidedSpec("json_object", "", "response_format")
    if kind == "json_schema":
        js = rf.get("json_schema")
        if not isinstance(js, dict) or "schema" not in js:
            raise ApiError(400, "`response_format.json_schema.schema` is required for "
                           "type json_schema", "response_format.json_schema.schema",
                           "invalid_value")
        field = "response_format.json_schema.schema"
        return GuidedSpec("json_schema", _schema_text(js["schema"], field), field)
    raise ApiError(400, f"`response_format.type` must be text, json_object or json_schema, "
                   f"got {kind!r}", "response_format.type", "invalid_value")


def _structured(so: dict[str, Any]) -> GuidedSpec | None:
    unknown = sorted(k for k in so if k not in _STRUCTURED_KEYS)
    if unknown:
        key = f"structured_outputs.{unknown[0]}"
        raise ApiError(400, f"`{key}` is not supported by Candor (structured_outputs takes "
                       f"one of {sorted(_STRUCTURED_KEYS)})", key, "unsupported_field")
    given = [k for k in so if so[k] is not None and so[k] is not False]
    if len(given) > 1:
        raise ApiError(400, f"`structured_outputs` takes one constraint, got {given}",
                       "structured_outputs", "invalid_value")
    if not given:
        return None
    key = given[0]
    field = f"structured_outputs.{key}"
    value = so[key]
    if key == "json":
        return GuidedSpec("json_schema", _schema_text(value, field), field)
    if key == "json_object":
        return GuidedSpec("json_object", "", field)
    if key == "choice":
        return GuidedSpec("choice", _choices(value, field), field)
    return GuidedSpec(_STRUCTURED_KEYS[key], _text(value, field), field)


# vLLM's guided_* fields: the grammar kind each one is, and how its value is read
_GUIDED_FIELDS = {"guided_json": ("json_schema", _schema_text),
                  "guided_regex": ("regex", _text),
                  "guided_choice": ("choice", _choices),
                  "guided_grammar": ("grammar", _text)}


def guided_spec(req) -> GuidedSpec | None:
    """The request's one constraint, or None."""
    found: list[GuidedSpec] = []
    if req.response_format is not None:
        found.append(_response_format(req.response_format))
    for field, (kind, read) in _GUIDED_FIELDS.items():
        value = getattr(req, field)
        if value is not None:
            found.append(GuidedSpec(kind, read(value, field), field))
    if req.structured_outputs is not None:
        found.append(_structured(req.structured_outputs))
    found = [f for f in found if f is not None]
    if len(found) > 1:
        raise ApiError(400, f"`{found[1].field}` and `{found[0].field}` both constrain the "
                       "output; send one", found[1].field, "invalid_value")
    return found[0] if found else None
