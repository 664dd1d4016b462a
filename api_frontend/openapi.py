"""GET /openapi.json: the HTTP surface as an OpenAPI 3.1 document, generated from the same
msgspec structs that decode the requests, so the published schema cannot drift from what
the server accepts. Clients generate SDKs from it; the fuzz tests generate requests."""

from __future__ import annotations

import re
from typing import Any

import msgspec

from api_frontend.endpoints.registry import ENDPOINTS
from protocol.openai_api import (DetokenizeRequest, ErrorBody, LoadLoraAdapterRequest,
                                 TokenizeRequest, UnloadLoraAdapterRequest)
from protocol.version import VERSION

_REF = "#/components/schemas/{name}"

# POST route -> the struct its body decodes into: every endpoint's, then the routes around them
REQUEST_BODIES: dict[str, type] = {
    **{r.path: r.body for ep in ENDPOINTS for r in ep.routes if r.body is not None},
    "/tokenize": TokenizeRequest,
    "/detokenize": DetokenizeRequest,
    # 404 unless the deployment allows runtime LoRA updates (api_frontend/lora_routes.py)
    "/v1/load_lora_adapter": LoadLoraAdapterRequest,
    "/v1/unload_lora_adapter": UnloadLoraAdapterRequest,
}
GET_ROUTES = ("/v1/models", "/v1/models/{model_id}", "/v1/capabilities", "/health",
              "/health/generate", "/metrics", "/version",
              *(r.path for ep in ENDPOINTS for r in ep.routes if r.method == "GET"))
DELETE_ROUTES = tuple(r.path for ep in ENDPOINTS for r in ep.routes if r.method == "DELETE")


def _error_responses() -> dict[str, Any]:
    err = {"description": "OpenAI error shape",
           "content": {"application/json": {"schema": {"$ref": _REF.format(name="ErrorBody")}}}}
    return {str(code): err for code in (400, 401, 404, 413, 415, 503)}


def build_openapi() -> dict[str, Any]:
    bodies = list(dict.fromkeys(REQUEST_BODIES.values()))
    refs, components = msgspec.json.schema_components([*bodies, ErrorBody], ref_template=_REF)
    ref_of = dict(zip(bodies, refs))
    paths: dict[str, Any] = {}
    for route, struct in REQUEST_BODIES.items():
        paths[route] = {"post": {
            "requestBody": {"required": True,
                            "content": {"application/json": {"schema": ref_of[struct]}}},
            "responses": {"200": {"description": "OK"}, **_error_responses()}}}
    for method, routes in (("get", GET_ROUTES), ("delete", DELETE_ROUTES)):
        for route in routes:
            op: dict[str, Any] = {"responses": {"200": {"description": "OK"},
                                                **_error_responses()}}
            params = re.findall(r"\{(\w+)\}", route)
            if params:
                op["parameters"] = [{"name": name, "in": "path", "required": True,
                                     "schema": {"type": "string"}} for name in params]
            paths.setdefault(route, {})[method] = op
    return {"openapi": "3.1.0",
            "info": {"title": "Candor", "version": VERSION},
            "paths": paths,
            "components": {"schemas": components}}
