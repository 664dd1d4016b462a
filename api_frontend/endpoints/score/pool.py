"""What the scoring routes (/v1/score, /v1/rerank, /v2/rerank, /classify) share: finding
the pooling model, running inputs (single texts or text pairs) through it as ``PoolReq``s
and turning its outputs into scores.

A cross-encoder (``PoolingConfig.task`` classify) scores a (query, document) pair as
one input, the two texts tokenized together as its tokenizer pairs them (token type 1
for the document where the model has token types); the score of a one-logit head is
``sigmoid(logit)`` (sentence-transformers' CrossEncoder and vLLM do the same). An
embedding model scores a pair by the cosine of the two texts' embeddings (vLLM's rule).
A failure of any input fails the request with a 4xx naming it; the others are aborted.
"""

from __future__ import annotations

import math
import time
import uuid
from array import array
from dataclasses import dataclass

from aiohttp import web

from api_frontend.app_keys import API_KEY, MODELS_KEY
from api_frontend.errors import RETRY_AFTER_S, ApiError
from api_frontend.limits import check_share
from api_frontend.pooled import collect
from protocol import ipc


@dataclass
class Pooled:
    outputs: list[list[float]]  # each input's vector or logits
    tokens: int


def pooling_model(request: web.Request, name: str, route: str):
    """(served model, card) for ``name`` on a scoring ``route``; a 404 naming what this
    deployment serves when it has no pooling model."""
    models = request.app[MODELS_KEY]
    if not models.serves("pooling"):
        raise ApiError(404, f"{route} needs a cross-encoder (a *ForSequenceClassification "
                       "checkpoint) or an embedding model served with --runner pooling; this "
                       f"deployment serves {models.describe()}.", "model", "model_not_found")
    return models.of_kind(name, "pooling", route)


def need_classifier(model, route: str, single_logit: bool) -> None:
    pooling = model.pooling
    if pooling is None or pooling.task != "classify":
        raise ApiError(400, f"{route} needs a classification model (a *ForSequenceClassification "
                       "checkpoint); this one is an embedding model", "model", "wrong_model_task")
    if single_logit and pooling.dimension != 1:
        raise ApiError(400, f"{route} scores with a one-logit cross-encoder; this model has "
                       f"{pooling.dimension} labels: use /classify", "model", "wrong_model_task")


def _floats(data: bytes) -> list[float]:
    values = array("f")
    values.frombytes(data)
    return values.tolist()


async def run_pooled(request: web.Request, model, inputs: list[tuple[str, str, str | None]],
                     priority: int, prefix: str) -> Pooled:
    """Every (param, text, pair text) through ``model``; outputs in input order."""
    api = request.app[API_KEY]
    if len(inputs) > api.limits.max_embedding_inputs:
        raise ApiError(400, f"the request has {len(inputs)} inputs; this deployment allows at "
                       f"most {api.limits.max_embedding_inputs} (max_embedding_inputs)",
                       inputs[-1][0].split("[")[0], "limit_exceeded")
    if priority != 0 and not api.priority_scheduling:
        raise ApiError(400, "`priority` needs priority scheduling, which this deployment does "
                       "not run (start the server with --scheduling-policy priority)",
                       "priority", "unsupported_field")
    for param, text, pair in inputs:
        if not text or pair == "":
            raise ApiError(400, f"`{param}` must not be empty", param, "invalid_value")
    engine = model.engine
    max_waiting = engine.stats.max_waiting if engine.stats is not None else 0
    check_share(len(inputs), api.limits, max_waiting, inputs[0][0].split("[")[0])
    full = engine.queue_full(len(inputs))
    if full is not None:
        raise ApiError(503, full, None, "queue_full", headers={"Retry-After": RETRY_AFTER_S})
    rid = f"{prefix}-{uuid.uuid4().hex}"
    arrival = time.time()
    subs = [ipc.PoolReq(f"{rid}-{i}", engine.reply_to, text, ipc.PoolingParams(), True, arrival,
                        priority, pair=pair) for i, (_, text, pair) in enumerate(inputs)]
    outputs, tokens = await collect(engine, subs, [param for param, _, _ in inputs])
    return Pooled([_floats(data) for data in outputs], tokens)


def sigmoid(x: float) -> float:
    return 1.0 / (1.0 + math.exp(-x)) if x >= 0 else math.exp(x) / (1.0 + math.exp(x))


def softmax(xs: list[float]) -> list[float]:
    top = max(xs)
    exps = [math.exp(x - top) for x in xs]
    total = sum(exps)
    return [e / total for e in exps]


def cosine(a: list[float], b: list[float]) -> float:
    dot = sum(x * y for x, y in zip(a, b))
    na, nb = math.sqrt(sum(x * x for x in a)), math.sqrt(sum(y * y for y in b))
    return dot / (na * nb) if na and nb else 0.0


async def score_pairs(request: web.Request, model, queries: list[tuple[str, str]],
                      documents: list[tuple[str, str]], priority: int, prefix: str
                      ) -> tuple[list[float], int]:
    """One score per (queries[i], documents[i]) (each a (param, text)): a cross-encoder's
    sigmoid of its logit, or an embedding model's cosine."""
    pooling = model.pooling
    if pooling is not None and pooling.task == "classify":
        need_classifier(model, request.path, single_logit=True)
        inputs = [(dp, q, d) for (_, q), (dp, d) in zip(queries, documents)]
        pooled = await run_pooled(request, model, inputs, priority, prefix)
        return [sigmoid(out[0]) for out in pooled.outputs], pooled.tokens
    texts: dict[str, str] = {}  # each distinct text embedded once, named by its first use
    for param, text in queries + documents:
        texts.setdefault(text, param)
    order = list(texts)
    pooled = await run_pooled(request, model, [(texts[t], t, None) for t in order],
                              priority, prefix)
    vectors = dict(zip(order, pooled.outputs))
    return ([cosine(vectors[q], vectors[d]) for (_, q), (_, d) in zip(queries, documents)],
            pooled.tokens)
