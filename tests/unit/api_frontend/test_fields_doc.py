"""docs/fields.md is generated from the field tables and their prose; these fail when it is
stale, cites a test that does not exist, or a row and its prose do not match one to one."""

import re
from pathlib import Path

import msgspec.inspect
import pytest

from api_frontend import fields_doc
from api_frontend.field_policy import UNKNOWN, FieldTable, Row

TESTS = Path(__file__).resolve().parents[2]


def test_checked_in_page_matches_the_table():
    assert fields_doc.PATH.read_text() == fields_doc.render(), (
        f"docs/fields.md is stale: run `{fields_doc.COMMAND}`")


def test_every_cited_test_exists():
    defined = set()
    for path in TESTS.rglob("test_*.py"):
        defined.update(re.findall(r"def (test_\w+)", path.read_text()))
    cited = set(re.findall(r"`(test_\w+)`", fields_doc.render()))
    assert cited and not cited - defined, sorted(cited - defined)


def test_every_request_field_has_a_row():
    """A field the request structs accept but the table lacks is missing from
    /v1/capabilities, from docs/fields.md and from the report's extensions (cache_salt was)."""
    from cluster.topology import ApiSpec
    from protocol.anthropic_api import CountTokensRequest, MessagesRequest
    from protocol.openai_api import ChatCompletionRequest, CompletionRequest, EmbeddingRequest
    from protocol.responses_api import ResponsesRequest
    from protocol.score_api import ClassifyRequest, RerankRequest, ScoreRequest
    tables = fields_doc.tables()
    for kind, request in (("chat", ChatCompletionRequest), ("completions", CompletionRequest),
                          ("embeddings", EmbeddingRequest), ("responses", ResponsesRequest),
                          ("messages", MessagesRequest), ("messages", CountTokensRequest),
                          ("score", ScoreRequest), ("rerank", RerankRequest),
                          ("classify", ClassifyRequest)):
        tiers = tables[kind].tiers(ApiSpec())
        # a Responses object field may be tiered by its keys (``reasoning.effort``)
        missing = [f for f in request.__struct_fields__
                   if f not in tiers and not any(t.startswith(f + ".") for t in tiers)]
        assert not missing, f"{kind}: {missing} have no row in its endpoint's fields.py"


def test_every_lora_route_field_has_a_row():
    from protocol.openai_api import LoadLoraAdapterRequest, UnloadLoraAdapterRequest
    documented = fields_doc.route_fields()
    for route, request in (("/v1/load_lora_adapter", LoadLoraAdapterRequest),
                           ("/v1/unload_lora_adapter", UnloadLoraAdapterRequest)):
        rows = {f["field"] for f in documented if f["route"] == route}
        assert rows == set(request.__struct_fields__), route


def test_a_row_without_prose_or_prose_without_a_row_is_an_error():
    table = FieldTable("t", (Row(("a",), "honoured"), Row((UNKNOWN,), "ignored")))
    section = {"rows": [{"fields": ["a"], "candor": "x"}, {"label": "behaviour", "candor": "y"},
                        {"fields": [UNKNOWN], "candor": "z"}]}
    assert len(fields_doc._joined("s", section, [table])) == 3
    with pytest.raises(fields_doc.DocDrift, match=r"rows \['a'\] have no prose"):
        fields_doc._joined("s", {"rows": section["rows"][1:]}, [table])
    with pytest.raises(fields_doc.DocDrift, match="'b', which no table"):
        fields_doc._joined("s", {"rows": [*section["rows"], {"fields": ["b"]}]}, [table])


def test_responses_pass_through_is_derived_and_checked_by_chat():
    """What /v1/responses hands the chat pipeline as it came: every chat field of the
    request struct (so a new one needs no list edited), each declared exactly as chat
    declares it, so chat's checks are the ones it gets."""
    from api_frontend.endpoints.chat.fields import TABLE as CHAT
    from api_frontend.endpoints.responses.fields import BUILT_HERE, PASSTHROUGH, TABLE
    from protocol.openai_api import ChatCompletionRequest
    from protocol.responses_api import ResponsesRequest
    chat_fields = {f.name: f for f in msgspec.inspect.type_info(ChatCompletionRequest).fields}
    for field in msgspec.inspect.type_info(ResponsesRequest).fields:
        passed = field.name in PASSTHROUGH
        shared = CHAT.tier(field.name) is not None
        assert passed == (shared and field.name not in BUILT_HERE
                          and TABLE.tier(field.name) != "ignored"), field.name
        if passed:
            twin = chat_fields[field.name]
            assert (field.type, field.default) == (twin.type, twin.default), field.name
    assert {"seed", "guided_json", "temperature", "stream", "priority"} <= set(PASSTHROUGH)
    assert not {"model", "tools", "user", "input"} & set(PASSTHROUGH)
