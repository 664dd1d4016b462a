"""docs/fields.md is generated from the field table; these fail when it is stale or cites
a test that does not exist."""

import re
from pathlib import Path

from api_frontend import fields_doc

TESTS = Path(__file__).resolve().parent


def test_checked_in_page_matches_the_table():
    assert fields_doc.PATH.read_text() == fields_doc.render(), (
        f"docs/fields.md is stale: run `{fields_doc.COMMAND}`")


def test_every_cited_test_exists():
    defined = set()
    for path in TESTS.glob("test_*.py"):
        defined.update(re.findall(r"def (test_\w+)", path.read_text()))
    cited = set(re.findall(r"`(test_\w+)`", fields_doc.render()))
    assert cited and not cited - defined, sorted(cited - defined)


def test_every_request_field_has_a_row():
    """A field the request structs accept but the table lacks is missing from
    /v1/capabilities, from docs/fields.md and from the report's extensions (cache_salt was)."""
    from api_frontend import field_policy
    from cluster.topology import ApiSpec
    from protocol.openai_api import ChatCompletionRequest, CompletionRequest, EmbeddingRequest
    for kind, request in (("chat", ChatCompletionRequest), ("completions", CompletionRequest),
                          ("embeddings", EmbeddingRequest)):
        tiers = field_policy.tiers(kind, ApiSpec())
        missing = [f for f in request.__struct_fields__ if f not in tiers]
        assert not missing, f"{kind}: {missing} have no row in api_frontend/field_policy.py"


def test_every_lora_route_field_has_a_row():
    from api_frontend.field_policy import LORA_ROUTE_FIELDS
    from protocol.openai_api import LoadLoraAdapterRequest, UnloadLoraAdapterRequest
    for route, request in (("/v1/load_lora_adapter", LoadLoraAdapterRequest),
                           ("/v1/unload_lora_adapter", UnloadLoraAdapterRequest)):
        rows = {f.field for f in LORA_ROUTE_FIELDS if f.route == route}
        assert rows == set(request.__struct_fields__), route
