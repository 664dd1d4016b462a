"""POST /classify (vLLM's shape): each input's label (the most probable) and the softmax
of a classification model's logits over its labels (config.json ``id2label``); a head
with one label (a cross-encoder) gives the sigmoid of its logit, as vLLM does (a softmax
over one label is 1.0 whatever the input)."""

from __future__ import annotations

import time
import uuid

import msgspec
from aiohttp import web

from api_frontend.app_keys import API_KEY
from api_frontend.endpoints.classify.fields import TABLE
from api_frontend.endpoints.score.pool import need_classifier, pooling_model, run_pooled, sigmoid, softmax
from api_frontend.endpoints.spec import Endpoint, Route
from api_frontend.errors import ApiError
from api_frontend.generate import client_request_id
from api_frontend.json_body import decode_request
from protocol.score_api import ClassifyData, ClassifyRequest, ClassifyResponse, ScoreUsage

ROUTE = "/classify"
_JSON = msgspec.json.Encoder()


async def create(request: web.Request) -> web.Response:
    api = request.app[API_KEY]
    req, keys = decode_request(await request.read(), ClassifyRequest)
    model, card = pooling_model(request, req.model, ROUTE)
    report = TABLE.report(keys, req, api)
    need_classifier(model, ROUTE, single_logit=False)
    if isinstance(req.input, str):
        inputs = [("input", req.input, None)]
    elif not req.input:
        raise ApiError(400, "`input` must not be an empty list", "input", "invalid_value")
    else:
        inputs = [(f"input[{i}]", text, None) for i, text in enumerate(req.input)]
    pooled = await run_pooled(request, model, inputs, req.priority, "classify")
    labels = model.pooling.labels
    data = []
    for i, logits in enumerate(pooled.outputs):
        probs = [sigmoid(logits[0])] if len(logits) == 1 else softmax(logits)
        best = max(range(len(probs)), key=probs.__getitem__)
        data.append(ClassifyData(i, labels[best] if best < len(labels) else f"LABEL_{best}",
                                 probs, len(probs)))
    rid = f"classify-{uuid.uuid4().hex}"
    body = ClassifyResponse(id=rid, created=int(time.time()), model=card.id, data=data,
                            usage=ScoreUsage(pooled.tokens, pooled.tokens), candor=report)
    headers = {"X-Request-Id": client_request_id(request) or rid,
               "x-candor-adjustments": _JSON.encode(report).decode()}
    return web.Response(body=_JSON.encode(body), content_type="application/json", headers=headers)


ENDPOINT = Endpoint(fields=TABLE, path=ROUTE, runner="pooling", serves="classify",
                    routes=(Route("POST", ROUTE, create, ClassifyRequest),), listed=(ROUTE,))
