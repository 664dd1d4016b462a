"""The request-field table: every field's tier on an endpoint, and what follows from it.

Each endpoint declares its slice (``endpoints/<name>/fields.py``: a ``FieldTable`` of
``Row``s and the ``Foreign`` fields of other APIs it names; chat and completions share the
generation pipeline's rows, ``generation_fields``). The code reads a table for
``GET /v1/capabilities`` (``tiers``), the ``candor`` report and strict mode (``report``),
and the 400 for a foreign field that would change the output (``foreign_notes``);
``api_frontend.fields_doc`` joins the same rows with their prose (docs/fields/*.yaml) into
``docs/fields.md``. A tier is one of ``TIER_MEANINGS``; a deployment shifts it:
``--strict`` turns ignored and clamped into rejected, ``--max-tokens-policy clamp`` turns
``clamps`` rows into clamped, and an ``only_with`` row is rejected unless its flag is on.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal

import msgspec

from api_frontend.errors import ApiError
from cluster.topology import ApiSpec
from protocol.openai_api import CandorReport, FieldNote

Tier = Literal["honoured", "clamped", "ignored", "extension", "rejected"]

TIER_MEANINGS: dict[str, str] = {
    "honoured": "maps onto sampling/decoding",
    "clamped": "accepted, rewritten and reported",
    "ignored": "accepted, not acted on, reported",
    "extension": "not an OpenAI field, honoured",
    "rejected": "400 naming it",
}

UNKNOWN = "<unknown field>"  # the tier key every field not in the table falls under


class Row(msgspec.Struct, frozen=True):
    """Request fields that share a tier on one endpoint. ``reason``: why an ignored field
    is ignored (reported). ``clamps``: ``--max-tokens-policy clamp`` makes it clamped.
    ``only_with``: an ApiSpec flag; without it the field is rejected. A dotted field
    (``reasoning.effort``) is a key inside an object field. ``key``: the name its prose
    goes by in docs/fields/*.yaml when its fields are derived rather than written out."""

    fields: tuple[str, ...]
    tier: Tier
    reason: str = ""
    clamps: bool = False
    only_with: str = ""
    key: str = ""


class Foreign(msgspec.Struct, frozen=True):
    """A field of another API (vLLM, SGLang, OpenAI's own) that Candor does not implement.
    Rejected: a 400 ``unsupported_field`` unless the value is one of ``harmless`` (values
    that ask for what Candor does anyway, reported as ignored). Ignored: it cannot change
    the output."""

    field: str
    tier: Literal["rejected", "ignored"]
    reason: str
    harmless: tuple[Any, ...] = ()


def _strict(tier: Tier, api: ApiSpec) -> Tier:
    """A strict deployment rejects what it would otherwise ignore or clamp."""
    return "rejected" if api.strict and tier in ("ignored", "clamped") else tier


def _deployed(row: Row, api: ApiSpec) -> Tier:
    """``row``'s tier as this deployment's flags shift it."""
    tier = row.tier
    if row.clamps and api.max_tokens_policy == "clamp":
        tier = "clamped"
    if row.only_with and not getattr(api, row.only_with):
        tier = "rejected"
    return _strict(tier, api)


_VALUE = msgspec.json.Decoder()


def _value(req: msgspec.Struct, path: str) -> Any:
    """The request's value at a dotted field path (None where absent)."""
    value: Any = req
    for part in path.split("."):
        value = getattr(value, part, None)
        if value is None:
            return None
    return value


class FieldTable:
    """One endpoint's rows (every field it takes, and ``UNKNOWN`` for the rest) and the
    foreign fields it names: ``own_foreign`` its own, after those it shares
    (``shared_foreign``: another endpoint's, e.g. the vLLM / SGLang fields of the
    generation pipeline that /v1/responses names too). ``sampling_defaults``: whether the
    report lists the deployment's sampling defaults a request took."""

    def __init__(self, name: str, rows: tuple[Row, ...], own_foreign: tuple[Foreign, ...] = (),
                 *, shared_foreign: tuple[Foreign, ...] = (), sampling_defaults: bool = True) -> None:
        self.name = name
        self.rows = rows
        self.own_foreign = own_foreign
        self.foreign = shared_foreign + own_foreign
        self.sampling_defaults = sampling_defaults
        self._row = {f: row for row in rows for f in row.fields}
        dupes = sorted({f for row in rows for f in row.fields if self._row[f] is not row})
        if dupes or UNKNOWN not in self._row:
            raise ValueError(f"{name}: a field on two rows {dupes}, or no {UNKNOWN!r} row")
        # a field reaches the report only where its deployment accepted it (``only_with`` too)
        self._extensions = frozenset(f for row in rows if row.tier == "extension"
                                     for f in row.fields)
        self._ignored = tuple((f, row.reason) for row in rows if row.tier == "ignored"
                              for f in row.fields if f != UNKNOWN)
        self._unknown_reason = self._row[UNKNOWN].reason
        self._foreign = {f.field: f for f in self.foreign}

    def tier(self, field: str) -> Tier | None:
        """The field's tier in the table (None: not a field of this endpoint)."""
        row = self._row.get(field)
        return None if row is None else row.tier

    def tiers(self, api: ApiSpec) -> dict[str, Tier]:
        """The tier of every request field under ``api`` (``UNKNOWN`` for the rest), as
        GET /v1/capabilities publishes it."""
        out = {f: _deployed(row, api) for row in self.rows for f in row.fields}
        unknown = out.pop(UNKNOWN)
        out.update({f.field: _strict(f.tier, api) for f in self.foreign})
        out[UNKNOWN] = unknown
        return out

    def foreign_notes(self, raw: Mapping[str, Any] | list[str],
                      known: set[str]) -> list[FieldNote]:
        """400 for a foreign field that would change the output; notes for the harmless
        ones."""
        notes = []
        for key in raw:
            spec = self._foreign.get(key)
            if spec is None or key in known:
                continue
            if spec.tier == "rejected":
                value = _VALUE.decode(raw[key]) if isinstance(raw, dict) else None
                if not any(value == h and type(value) is type(h) for h in spec.harmless):
                    raise ApiError(400, f"`{key}` is not supported by Candor ({spec.reason}); "
                                   "remove it rather than have it ignored", key,
                                   "unsupported_field")
                notes.append(FieldNote(key, f"the value asks for Candor's own behaviour "
                                       f"({spec.reason})"))
            else:
                notes.append(FieldNote(key, spec.reason))
        return notes

    def report(self, raw_keys: Mapping[str, Any] | list[str], req: msgspec.Struct,
               api: ApiSpec) -> CandorReport:
        """The ``candor`` report for a request whose body had ``raw_keys``: the ignored
        fields it sent (a 400 in strict mode), the extensions it used, and the defaults it
        took."""
        known = set(req.__struct_fields__)
        ignored = [FieldNote(f, reason) for f, reason in self._ignored
                   if _value(req, f) is not None]
        ignored += self.foreign_notes(raw_keys, known)
        ignored += [FieldNote(k, self._unknown_reason) for k in raw_keys
                    if k not in known and k not in self._foreign]
        extensions = [k for k in raw_keys if k in self._extensions]
        strict = api.strict or req.strict
        if strict and ignored:
            note = ignored[0]
            raise ApiError(400, f"`{note.field}` would be ignored ({note.reason}); strict mode "
                           "turns ignored fields into errors", note.field, "ignored_field")
        defaults = [FieldNote(k, f"omitted; default from {api.sampling_defaults.source}", to=v)
                    for k, v in api.sampling_defaults.items().items()
                    if k not in raw_keys and self.sampling_defaults]
        return CandorReport(ignored=ignored, extensions=extensions, defaults=defaults,
                            strict=strict)


def nested_unknown(raw_keys: Mapping[str, msgspec.Raw], req: msgspec.Struct) -> list[str]:
    """The JSON paths of the fields inside the request's objects that its typed decode
    dropped (a struct keeps only the fields it declares), so they are reported as the
    unknown top-level fields are. A dict-typed field (a schema, a tool's input) is the
    client's own object and a null is an unset field: neither is named."""
    out: list[str] = []
    for key, raw in raw_keys.items():
        if key in req.__struct_fields__:
            _walk(_VALUE.decode(raw), getattr(req, key), key, out)
    return out


def _walk(raw: Any, value: Any, path: str, out: list[str]) -> None:
    if isinstance(value, msgspec.Struct) and isinstance(raw, dict):
        fields = value.__struct_fields__
        tag_field = value.__struct_config__.tag_field
        for key, item in raw.items():
            if item is None or key == tag_field:
                continue
            if key not in fields:
                out.append(f"{path}.{key}")
            else:
                _walk(item, getattr(value, key), f"{path}.{key}", out)
    elif isinstance(value, list) and isinstance(raw, list):
        for i, (raw_item, item) in enumerate(zip(raw, value)):
            _walk(raw_item, item, f"{path}[{i}]", out)
