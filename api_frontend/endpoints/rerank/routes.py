"""POST /v1/rerank (Jina's shape) and /v2/rerank (Cohere's), as vLLM serves both: a
``query`` and ``documents``; results sorted by ``relevance_score``, highest first, cut
to ``top_n``, each with its document's index (and text unless ``return_documents`` is
false). Scores as /v1/score computes them (``score/pool.py``)."""

from __future__ import annotations

import uuid

import msgspec
from aiohttp import web

from api_frontend.app_keys import API_KEY
from api_frontend.endpoints.rerank.fields import TABLE
from api_frontend.endpoints.score.pool import pooling_model, score_pairs
from api_frontend.endpoints.spec import Endpoint, Route
from api_frontend.errors import ApiError
from api_frontend.generate import client_request_id
from api_frontend.json_body import decode_request
from protocol.score_api import (RerankDocument, RerankRequest, RerankResponse, RerankResult,
                                RerankUsage)

ROUTES = ("/v1/rerank", "/v2/rerank")
_JSON = msgspec.json.Encoder()


async def create(request: web.Request) -> web.Response:
    api = request.app[API_KEY]
    req, keys = decode_request(await request.read(), RerankRequest)
    model, card = pooling_model(request, req.model, request.path)
    report = TABLE.report(keys, req, api)
    if not req.documents:
        raise ApiError(400, "`documents` must not be an empty list", "documents", "invalid_value")
    if not req.query:
        raise ApiError(400, "`query` must not be empty", "query", "invalid_value")
    documents = [(f"documents[{i}]", d) for i, d in enumerate(req.documents)]
    scores, tokens = await score_pairs(request, model, [("query", req.query)] * len(documents),
                                       documents, req.priority, "rerank")
    ranked = sorted(range(len(scores)), key=lambda i: (-scores[i], i))[:req.top_n]
    results = [RerankResult(i, scores[i], RerankDocument(req.documents[i])
                            if req.return_documents else None) for i in ranked]
    rid = f"rerank-{uuid.uuid4().hex}"
    body = RerankResponse(id=rid, model=card.id, usage=RerankUsage(tokens), results=results,
                          candor=report)
    headers = {"X-Request-Id": client_request_id(request) or rid,
               "x-candor-adjustments": _JSON.encode(report).decode()}
    return web.Response(body=_JSON.encode(body), content_type="application/json", headers=headers)


ENDPOINT = Endpoint(fields=TABLE, path=ROUTES[0], runner="pooling", serves="rerank",
                    routes=tuple(Route("POST", path, create, RerankRequest) for path in ROUTES),
                    listed=ROUTES)
