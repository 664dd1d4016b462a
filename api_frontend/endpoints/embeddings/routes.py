"""POST /v1/embeddings on a pooling model (``--runner pooling``).

Each input becomes one ``PoolReq``: a tokenizer worker tokenizes it and checks it fits the
context, the model's scheduler batches it with other requests as a prefill whose one
output is the pooled hidden state, and the scheduler sends that vector (float32 bytes)
straight back here as ``Pooled``. A failure of any input fails the request with a 4xx
naming ``input[i]``; the other inputs are aborted (their KV blocks freed).
"""

from __future__ import annotations

import base64
import sys
import time
import uuid
from array import array

import msgspec
from aiohttp import web

from api_frontend.app_keys import API_KEY, MODELS_KEY
from api_frontend.endpoints.embeddings.fields import TABLE
from api_frontend.endpoints.spec import Endpoint, Route
from api_frontend.errors import RETRY_AFTER_S, ApiError
from api_frontend.generate import client_request_id
from api_frontend.json_body import decode_request
from api_frontend.pooled import collect
from api_frontend.limits import check_share
from cluster.pooling import PoolingConfig
from cluster.topology import RequestLimits
from protocol import ipc
from protocol.openai_api import (EmbeddingData, EmbeddingRequest, EmbeddingResponse,
                                 EmbeddingUsage)

ROUTE = "/v1/embeddings"
_JSON = msgspec.json.Encoder()


def _bad(param: str, message: str, code: str = "invalid_value") -> ApiError:
    return ApiError(400, f"`{param}` {message}", param, code)


def split_inputs(value, limits: RequestLimits) -> list[tuple[str, str | list[int]]]:
    """(the field to name in errors, the input) for each input of ``value``."""
    if isinstance(value, str):
        if not value:
            raise _bad("input", "must not be an empty string")
        return [("input", value)]
    if not value:
        raise _bad("input", "must not be an empty list")
    if all(isinstance(x, int) for x in value):
        return [("input", list(value))]  # one input given as token ids
    if len(value) > limits.max_embedding_inputs:
        raise ApiError(400, f"`input` has {len(value)} inputs; this deployment allows at most "
                       f"{limits.max_embedding_inputs} (max_embedding_inputs)", "input",
                       "limit_exceeded")
    out = []
    for i, item in enumerate(value):
        param = f"input[{i}]"
        if isinstance(item, int):
            raise _bad(param, "is a token id among other inputs: send token ids as one list "
                       "per input, or a list of strings")
        if not item:
            raise _bad(param, "must not be empty")
        out.append((param, item))
    return out


def _pooling_params(dimensions: int | None, pooling: PoolingConfig | None) -> ipc.PoolingParams:
    if dimensions is not None and pooling is not None:
        why = pooling.check_dimensions(dimensions)
        if why is not None:
            raise ApiError(400, f"`dimensions` {dimensions} cannot be served: {why}",
                           "dimensions", "unsupported_value")
    return ipc.PoolingParams(dimensions)


def _vector(data: bytes, encoding: str) -> list[float] | str:
    if encoding == "base64":
        return base64.b64encode(data).decode("ascii")
    values = array("f")
    values.frombytes(data)
    if sys.byteorder == "big":  # the bytes are little-endian float32
        values.byteswap()
    return values.tolist()


async def create(request: web.Request) -> web.Response:
    models, api = request.app[MODELS_KEY], request.app[API_KEY]
    if not models.serves("pooling"):
        raise ApiError(404, f"This deployment serves no embedding model: it serves "
                       f"{models.describe()}. Start an embedding model with --runner pooling "
                       "(or add one to the topology's models).", "model", "model_not_found")
    req, keys = decode_request(await request.read(), EmbeddingRequest)
    model, card = models.of_kind(req.model, "pooling", ROUTE)
    if model.pooling is not None and model.pooling.task == "classify":
        raise ApiError(400, f"The model {card.id!r} is a classifier (a cross-encoder): it "
                       "serves /v1/score, /v1/rerank and /classify, not /v1/embeddings",
                       "model", "wrong_model_task")
    report = TABLE.report(keys, req, api)
    if req.priority != 0 and not api.priority_scheduling:
        raise ApiError(400, "`priority` needs priority scheduling, which this deployment does "
                       "not run (start the server with --scheduling-policy priority)",
                       "priority", "unsupported_field")
    inputs = split_inputs(req.input, api.limits)
    pooling = _pooling_params(req.dimensions, model.pooling)
    engine = model.engine
    max_waiting = engine.stats.max_waiting if engine.stats is not None else 0
    check_share(len(inputs), api.limits, max_waiting, "input")
    full = engine.queue_full(len(inputs))
    if full is not None:
        raise ApiError(503, full, None, "queue_full", headers={"Retry-After": RETRY_AFTER_S})
    rid = f"embd-{uuid.uuid4().hex}"
    arrival = time.time()
    subs = [ipc.PoolReq(f"{rid}-{i}", engine.reply_to, value, pooling,
                        req.add_special_tokens, arrival, req.priority)
            for i, (_, value) in enumerate(inputs)]
    vectors, total = await collect(engine, subs, [param for param, _ in inputs])
    body = EmbeddingResponse(
        data=[EmbeddingData(i, _vector(v, req.encoding_format)) for i, v in enumerate(vectors)],
        model=card.id, usage=EmbeddingUsage(total, total), candor=report)
    headers = {"X-Request-Id": client_request_id(request) or rid,
               "x-candor-adjustments": _JSON.encode(report).decode()}
    return web.Response(body=_JSON.encode(body), content_type="application/json",
                        headers=headers)


ENDPOINT = Endpoint(fields=TABLE, path=ROUTE, runner="pooling", serves="embeddings",
                    routes=(Route("POST", ROUTE, create, EmbeddingRequest),), listed=(ROUTE,))
