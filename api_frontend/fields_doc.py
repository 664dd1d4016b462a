"""Renders ``docs/fields.md`` from the field table (``field_policy``) and the request
limits (``RequestLimits``), so the page cannot drift from what the server does.

``python -m api_frontend.fields_doc`` rewrites the file; ``tests/test_fields_doc.py``
fails when the checked-in page differs from ``render()``.
"""

from __future__ import annotations

import sys
from pathlib import Path

import msgspec

from api_frontend.field_policy import (EMBEDDINGS_FOREIGN, EMBEDDINGS_ROWS, FOREIGN,
                                      LORA_ROUTE_FIELDS, RESPONSES_ROWS, RESPONSES_UNBUILT, ROWS,
                                      TIER_MEANINGS, UNKNOWN, Foreign, RouteField, Row)
from cluster.topology import RequestLimits

PATH = Path(__file__).resolve().parent.parent / "docs" / "fields.md"
COMMAND = "python -m api_frontend.fields_doc"

_INTRO = """\
Tiers: {tiers}. A deployment shifts them: `--strict` (or `"strict": true` in a request) turns
ignored and clamped into 400. The live table for a deployment is `GET /v1/capabilities`. Every
response carries the report as the `candor` body field (first frame of a stream) and the
`x-candor-adjustments` header (JSON).

Tests are in `tests/`; `S` = test_e2e_sampling.py, `L` = test_e2e_logprobs.py,
`C` = test_e2e_contract.py, `P` = test_e2e_policy.py, `X` = test_e2e_strict.py,
`H` = test_e2e_http.py, `U` = test_sampler_processors.py, `A` = test_e2e_hardening_api.py,
`T` = test_e2e_tools.py, `G` = test_e2e_structured.py, `TP` = test_tool_parsers.py,
`K` = test_e2e_composition.py, `D` = test_e2e_determinism.py, `LR` = test_e2e_lora.py.

`null` for any optional field means absent (SDKs send explicit nulls): it is dropped before
decoding and never reported (A `test_null_means_absent_on_both_endpoints`). Every integer is
bounded to int64 at decode and token ids to 0..2³¹-1, so an out-of-range number is a 400
naming the field (A `test_integers_past_int64_are_400_and_release_the_request`).
"""

_FOREIGN_INTRO = """\
## vLLM and SGLang fields Candor does not implement

A field that would change the output is rejected: 400 `unsupported_field` naming it (never
ignored); a value that asks for Candor's own behaviour (e.g. `use_beam_search: false`) is
ignored and reported. A field that cannot change the tokens here is ignored and reported.
Tests: A `test_fields_that_would_change_output_are_rejected`,
A `test_harmless_foreign_fields_are_reported_ignored`,
A `test_capabilities_publish_limits_and_foreign_field_tiers`.
"""

_RESPONSES_INTRO = """\
## `/v1/responses`

OpenAI's Responses API on the same pipeline as chat (api_frontend/endpoints/responses): the
conversation is rendered by the chat template, tools, grammars and the reasoning parser are
chat's, and the report is the `candor` field of the response object (the `response.created`
event's and the final one) and the `x-candor-adjustments` header. `GET /v1/responses/{id}`,
`DELETE /v1/responses/{id}` and `GET /v1/responses/{id}/input_items` (newest first; `order`,
`limit`, `after`, `before`) read the store from any frontend. `R` = test_e2e_responses.py.
"""

_EMBEDDINGS_INTRO = """\
## `/v1/embeddings`

Served by a pooling model (`--runner pooling`, vLLM's flag; `--task embed`; `runner: pooling`
in a topology, where it may sit beside a generation model behind the same frontends, routed
by `model`). Each input is a prefill whose output is the pooled hidden state, batched by the
model's scheduler with other requests. The report is the response's `candor` field and the
`x-candor-adjustments` header. `E` = test_e2e_embeddings.py, `PR` = test_pooling_runner.py,
`MM` = test_multi_model.py.
"""

_LORA_INTRO = """\
## LoRA adapter routes

With `--enable-lora`, a request runs on an adapter when its `model` names one (the rows above).
`POST /v1/load_lora_adapter` and `POST /v1/unload_lora_adapter` take vLLM's bodies, need the
API key, and answer 404 unless runtime loading is allowed (`--allow-runtime-lora-updating` or
`VLLM_ALLOW_RUNTIME_LORA_UPDATING=True`); an unknown field is a 400. `LR` = test_e2e_lora.py.
"""

_OUTRO = """\
## Endpoints, limits, HTTP

Endpoints: `/v1/chat/completions/render` and `/v1/completions/render` (prompt, ids, template
source + sha256; C `test_render_tokenize_detokenize_agree_with_generation`), `/tokenize`,
`/detokenize`, `/v1/capabilities` (C `test_capabilities_publish_every_tier`), `/v1/embeddings`
on a deployment without an embedding model → 404 naming what is served
(C `test_embeddings_404_says_what_is_served`), 413 for bodies over
`--max-body-mb` (P `test_body_too_large_is_413`), a failure after the stream started is one
`data:` error frame then `[DONE]` (P `test_failure_after_stream_started_is_an_error_frame_then_done`).

Request limits (`ApiSpec.limits`: {limits}) are set in the topology YAML's `api.limits`
(`candor serve`: `--max-logprobs`, `--max-n`, `--max-prompts`, `--max-request-share`),
published under `limits` in `/v1/capabilities`, and checked before any work: 400
`limit_exceeded` naming the field and the limit. A request's n × prompts sequences count
against the engine's waiting queue as that many (503 `queue_full` when they do not fit now,
400 when they exceed the per-request share).

HTTP: a POST body sent with a Content-Type other than JSON → 415 `unsupported_media_type`;
JSON nested too deeply → 400 `invalid_json`; an over-long request line or header (aiohttp's
parser) → 400 in the error shape; a client that goes away is one log line naming its
`X-Request-Id`, which every response echoes (A `test_wrong_content_type_is_415_in_error_shape`,
A `test_over_long_request_line_and_header_are_error_shaped`,
A `test_request_id_is_echoed_and_disconnects_log_one_line`).
"""


def _code(value: object) -> str:
    return f"`{msgspec.json.encode(value).decode()}`"


def _row(row: Row) -> str:
    label = row.label or ", ".join(f"`{f}`" for f in row.fields)
    cells = (label, row.chat or "—", row.completions or "—", row.candor, row.vllm,
             row.sglang, row.tests)
    return "| " + " | ".join(cells) + " |"


def _endpoint_row(row: Row, kind: str = "responses") -> str:
    label = row.label or ", ".join(f"`{f}`" for f in row.fields)
    return "| " + " | ".join((label, row.tier(kind) or "—", row.candor, row.vllm,
                              row.tests)) + " |"


def _route_field(spec: RouteField) -> str:
    return f"| `{spec.route}` | `{spec.field}` | {spec.candor} | {spec.vllm} | {spec.tests} |"


def _foreign(spec: Foreign) -> str:
    what = spec.tier
    if spec.harmless:
        what += f" (ignored and reported when {' or '.join(map(_code, spec.harmless))})"
    return f"| `{spec.field}` | {what} | {spec.reason} |"


def render() -> str:
    """The whole text of ``docs/fields.md``."""
    tiers = ", ".join(f"**{t}** ({meaning})" for t, meaning in TIER_MEANINGS.items())
    limits = ", ".join(f"`{name}` {value}" for name, value in
                       msgspec.structs.asdict(RequestLimits()).items())
    unknown = f"`{UNKNOWN}`"
    lines = [
        "# Request fields: what Candor does with each one",
        "",
        f"<!-- Generated from api_frontend/field_policy.py by `{COMMAND}`; edit the table "
        "there, not this file. -->",
        "",
        _INTRO.format(tiers=tiers),
        f"The chat / completions columns give each field's tier on that endpoint (— : not a "
        f"field there); {unknown} is every field the table does not name.",
        "",
        "| field | chat | completions | Candor | vLLM | SGLang | test |",
        "|---|---|---|---|---|---|---|",
        *map(_row, ROWS),
        "",
        _FOREIGN_INTRO,
        "| field | tier (both endpoints) | why |",
        "|---|---|---|",
        *map(_foreign, FOREIGN),
        "",
        _RESPONSES_INTRO,
        "| field | tier | Candor | vLLM | test |",
        "|---|---|---|---|---|",
        *map(_endpoint_row, RESPONSES_ROWS),
        "",
        "OpenAI Responses fields Candor does not build (the vLLM / SGLang fields above are "
        "rejected or ignored here too):",
        "",
        "| field | tier | why |",
        "|---|---|---|",
        *map(_foreign, RESPONSES_UNBUILT),
        "",
        _EMBEDDINGS_INTRO,
        "| field | tier | Candor | vLLM | test |",
        "|---|---|---|---|---|",
        *(_endpoint_row(row, "embeddings") for row in EMBEDDINGS_ROWS),
        "",
        "Fields of vLLM's embeddings API Candor does not build:",
        "",
        "| field | tier | why |",
        "|---|---|---|",
        *map(_foreign, EMBEDDINGS_FOREIGN),
        "",
        _LORA_INTRO,
        "| route | field | Candor | vLLM | test |",
        "|---|---|---|---|---|",
        *map(_route_field, LORA_ROUTE_FIELDS),
        "",
        _OUTRO.format(limits=limits),
    ]
    return "\n".join(lines)


def main() -> None:
    PATH.write_text(render())
    print(f"wrote {PATH}", file=sys.stderr)


if __name__ == "__main__":
    main()
