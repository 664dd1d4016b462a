"""POST /v1/score (vLLM's shape): ``text_1`` and ``text_2``, each a string or a list;
one string against a list scores it with every item, two lists of one length pair item
by item. A cross-encoder scores each pair (sigmoid of its logit); an embedding model the
cosine of the two embeddings (see ``pool.py``)."""

from __future__ import annotations

import time
import uuid

import msgspec
from aiohttp import web

from api_frontend.app_keys import API_KEY
from api_frontend.endpoints.score.fields import TABLE
from api_frontend.endpoints.score.pool import pooling_model, score_pairs
from api_frontend.endpoints.spec import Endpoint, Route
from api_frontend.errors import ApiError
from api_frontend.generate import client_request_id
from api_frontend.json_body import decode_request
from protocol.score_api import ScoreData, ScoreRequest, ScoreResponse, ScoreUsage

ROUTE = "/v1/score"
_JSON = msgspec.json.Encoder()


def _named(field: str, value: str | list[str]) -> list[tuple[str, str]]:
    if isinstance(value, str):
        return [(field, value)]
    if not value:
        raise ApiError(400, f"`{field}` must not be an empty list", field, "invalid_value")
    return [(f"{field}[{i}]", v) for i, v in enumerate(value)]


def pairs(text_1: str | list[str], text_2: str | list[str]
          ) -> tuple[list[tuple[str, str]], list[tuple[str, str]]]:
    """(queries, documents), one of each per pair, each named for errors."""
    first, second = _named("text_1", text_1), _named("text_2", text_2)
    if len(first) == 1:
        first = first * len(second)
    elif len(second) == 1:
        second = second * len(first)
    elif len(first) != len(second):
        raise ApiError(400, f"`text_1` has {len(first)} items and `text_2` {len(second)}: "
                       "send one string against a list, or two lists of one length",
                       "text_2", "invalid_value")
    return first, second


async def create(request: web.Request) -> web.Response:
    api = request.app[API_KEY]
    req, keys = decode_request(await request.read(), ScoreRequest)
    model, card = pooling_model(request, req.model, ROUTE)
    report = TABLE.report(keys, req, api)
    queries, documents = pairs(req.text_1, req.text_2)
    scores, tokens = await score_pairs(request, model, queries, documents, req.priority, "score")
    rid = f"score-{uuid.uuid4().hex}"
    body = ScoreResponse(id=rid, created=int(time.time()), model=card.id,
                         data=[ScoreData(i, s) for i, s in enumerate(scores)],
                         usage=ScoreUsage(tokens, tokens), candor=report)
    headers = {"X-Request-Id": client_request_id(request) or rid,
               "x-candor-adjustments": _JSON.encode(report).decode()}
    return web.Response(body=_JSON.encode(body), content_type="application/json", headers=headers)


ENDPOINT = Endpoint(fields=TABLE, path=ROUTE, runner="pooling", serves="score",
                    routes=(Route("POST", ROUTE, create, ScoreRequest),), listed=(ROUTE,))
