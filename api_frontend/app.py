"""The aiohttp application: routes, validation, SSE, and the error middleware.

The frontend never tokenizes or renders: it validates the body, hands a GenerateReq to
the tokenizer workers, and turns the deltas that come back into OpenAI responses.
/health, /metrics and the other operations routes live in api_frontend/ops.py.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid

import msgspec
from aiohttp import web

from api_frontend.engine_client import EngineClient
from api_frontend.errors import ApiError, from_decode_error
from api_frontend.responses import (DONE_FRAME, ChatAssembler, Collected,
                                   CompletionAssembler, sse)
from api_frontend.translate import chat_to_generate, completion_to_generate, ignored_fields
from protocol import ipc
from protocol.openai_api import (ChatCompletionRequest, CompletionRequest, ModelCard,
                                 ModelList)

log = logging.getLogger("api_frontend")
_JSON = msgspec.json.Encoder()
_RAW_OBJECT = msgspec.json.Decoder(dict[str, msgspec.Raw])
_DECODERS = {ChatCompletionRequest: msgspec.json.Decoder(ChatCompletionRequest),
             CompletionRequest: msgspec.json.Decoder(CompletionRequest)}

ENGINE_KEY = web.AppKey("engine", EngineClient)
MODEL_KEY = web.AppKey("model", ModelCard)
RETRY_AFTER_S = "1"  # seconds, on every 503 caused by a full waiting queue


def json_response(obj, status: int = 200, headers: dict[str, str] | None = None) -> web.Response:
    return web.Response(status=status, body=_JSON.encode(obj), content_type="application/json",
                        headers=headers)


@web.middleware
async def error_middleware(request: web.Request, handler):
    try:
        return await handler(request)
    except ApiError as err:
        return err.response()
    except web.HTTPRequestEntityTooLarge as exc:
        return ApiError(413, f"request body too large: {exc.text}", None,
                        "request_too_large").response()
    except web.HTTPMethodNotAllowed as exc:
        return ApiError(405, f"method {request.method} is not allowed on {request.path}; "
                        f"allowed: {', '.join(sorted(exc.allowed_methods))}", None,
                        "method_not_allowed").response()
    except web.HTTPNotFound:
        return ApiError(404, f"no route {request.method} {request.path}", None,
                        "route_not_found").response()
    except web.HTTPException as exc:
        return ApiError(exc.status, exc.reason, None, None).response()
    except (asyncio.CancelledError, ConnectionResetError):
        raise
    except Exception:
        log.exception("unhandled error on %s", request.path)
        return ApiError(500, "internal server error", None, "internal_error").response()


def _decode(body: bytes, kind: type) -> tuple[msgspec.Struct, list[str]]:
    try:
        keys = list(_RAW_OBJECT.decode(body))
        return _DECODERS[kind].decode(body), keys
    except msgspec.MsgspecError as err:
        raise from_decode_error(err) from None


def _check_model(request: web.Request, name: str) -> ModelCard:
    card = request.app[MODEL_KEY]
    if name != card.id:
        raise ApiError(404, f"The model {name!r} does not exist on this deployment. "
                       f"Served models: [{card.id!r}]", "model", "model_not_found")
    return card


async def _next(queue: asyncio.Queue) -> ipc.TextDelta:
    msg = await queue.get()
    if isinstance(msg, ipc.RequestError):
        headers = {"Retry-After": RETRY_AFTER_S} if msg.status == 503 else None
        raise ApiError(msg.status, msg.message, msg.param, msg.code, msg.type, headers)
    return msg


async def _generate(request: web.Request, kind: type) -> web.StreamResponse:
    engine = request.app[ENGINE_KEY]
    full = engine.queue_full()  # shed load before parsing or tokenizing anything
    if full is not None:
        raise ApiError(503, full, None, "queue_full", headers={"Retry-After": RETRY_AFTER_S})
    parsed, keys = _decode(await request.read(), kind)
    card = _check_model(request, parsed.model)
    is_chat = kind is ChatCompletionRequest
    rid = f"{'chatcmpl' if is_chat else 'cmpl'}-{uuid.uuid4().hex}"
    arrival = time.time()
    gen = (chat_to_generate if is_chat else completion_to_generate)(
        parsed, rid, engine.reply_to, arrival)
    headers = {"x-request-id": rid}
    ignored = ignored_fields(keys, parsed)
    if ignored:
        headers["x-candor-ignored-fields"] = ",".join(ignored)
    assembler = (ChatAssembler if is_chat else CompletionAssembler)(
        rid, int(arrival), card.id, parsed.return_token_ids)

    queue = await engine.submit(gen)
    finished = False
    try:
        first = await _next(queue)  # errors before any output become plain HTTP errors
        if not parsed.stream:
            got = Collected()
            got.add(first)
            while got.last.finish_reason is None:
                got.add(await _next(queue))
            finished = True
            return json_response(assembler.final(got), headers=headers)
        response = await _stream(request, parsed, assembler, first, queue, headers)
        finished = True
        return response
    finally:
        if finished:
            engine.release(rid)
        else:  # client went away, or an error: stop generating and free the KV blocks
            await engine.abort(rid, "disconnect")


async def _stream(request: web.Request, parsed, assembler, first: ipc.TextDelta,
                  queue: asyncio.Queue, headers: dict[str, str]) -> web.StreamResponse:
    opts = parsed.stream_options
    include_usage = bool(opts and opts.include_usage)
    continuous = bool(opts and opts.continuous_usage_stats)
    response = web.StreamResponse(headers={**headers, "Content-Type": "text/event-stream",
                                           "Cache-Control": "no-cache"})
    await response.prepare(request)
    if isinstance(assembler, ChatAssembler):
        await response.write(sse(assembler.role_chunk()))
    delta = first
    while True:
        if delta.text or delta.finish_reason is not None or (
                assembler.with_ids and delta.token_ids):
            await response.write(sse(assembler.chunk(delta, continuous)))
        if delta.finish_reason is not None:
            break
        try:
            delta = await _next(queue)
        except ApiError as err:  # after the first frame: an error frame, then [DONE]
            await response.write(b"data: " + err.encode() + b"\n\n")
            await response.write(DONE_FRAME)
            return response
    if include_usage:
        await response.write(sse(assembler.usage_chunk(delta)))
    await response.write(DONE_FRAME)
    await response.write_eof()
    return response


async def chat_completions(request: web.Request) -> web.StreamResponse:
    return await _generate(request, ChatCompletionRequest)


async def completions(request: web.Request) -> web.StreamResponse:
    return await _generate(request, CompletionRequest)


async def list_models(request: web.Request) -> web.Response:
    return json_response(ModelList([request.app[MODEL_KEY]]))


async def get_model(request: web.Request) -> web.Response:
    return json_response(_check_model(request, request.match_info["model_id"]))


def build_app(engine: EngineClient, card: ModelCard, max_body_bytes: int) -> web.Application:
    app = web.Application(middlewares=[error_middleware], client_max_size=max_body_bytes)
    app[ENGINE_KEY] = engine
    app[MODEL_KEY] = card
    app.router.add_get("/v1/models", list_models)
    app.router.add_get("/v1/models/{model_id:.+}", get_model)
    app.router.add_post("/v1/completions", completions)
    app.router.add_post("/v1/chat/completions", chat_completions)
    return app
