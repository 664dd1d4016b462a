"""The aiohttp application: routes, validation, SSE, and the error middleware.

The frontend never tokenizes or renders: it validates the body, hands a GenerateReq to
the tokenizer workers, and turns the deltas that come back into OpenAI responses.
/health, /metrics and the other operations routes live in api_frontend/ops.py.
"""

from __future__ import annotations

import asyncio
import logging

import msgspec
from aiohttp import web

from api_frontend import extra_routes
from api_frontend.engine_client import EngineClient
from api_frontend.errors import ApiError, check_served_model, from_decode_error
from api_frontend.generate import run_generation
from api_frontend.openapi import build_openapi
from protocol.openai_api import (ChatCompletionRequest, CompletionRequest, ModelCard,
                                 ModelList)
from protocol.topology import ApiSpec

log = logging.getLogger("api_frontend")
_JSON = msgspec.json.Encoder()
_RAW_OBJECT = msgspec.json.Decoder(dict[str, msgspec.Raw])
_DECODERS = {ChatCompletionRequest: msgspec.json.Decoder(ChatCompletionRequest),
             CompletionRequest: msgspec.json.Decoder(CompletionRequest)}

ENGINE_KEY = web.AppKey("engine", EngineClient)
MODEL_KEY = web.AppKey("model", ModelCard)
API_KEY = web.AppKey("api", ApiSpec)


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
    check_served_model(card, name)
    return card


async def _generate(request: web.Request, kind: type) -> web.StreamResponse:
    # admission (topology health, queue bound) is ops_middleware's, before this runs
    parsed, keys = _decode(await request.read(), kind)
    card = _check_model(request, parsed.model)
    return await run_generation(request, request.app[ENGINE_KEY], card, request.app[API_KEY],
                                parsed, keys)


async def _render(request: web.Request, kind: type) -> web.Response:
    parsed, keys = _decode(await request.read(), kind)
    card = _check_model(request, parsed.model)
    return await extra_routes.render(request, request.app[ENGINE_KEY], card,
                                     request.app[API_KEY], parsed, keys)


async def chat_completions(request: web.Request) -> web.StreamResponse:
    return await _generate(request, ChatCompletionRequest)


async def completions(request: web.Request) -> web.StreamResponse:
    return await _generate(request, CompletionRequest)


async def chat_render(request: web.Request) -> web.Response:
    return await _render(request, ChatCompletionRequest)


async def completions_render(request: web.Request) -> web.Response:
    return await _render(request, CompletionRequest)


async def tokenize(request: web.Request) -> web.Response:
    return await extra_routes.tokenize(request, request.app[ENGINE_KEY], request.app[MODEL_KEY],
                                       request.app[API_KEY])


async def detokenize(request: web.Request) -> web.Response:
    return await extra_routes.detokenize(request, request.app[ENGINE_KEY], request.app[MODEL_KEY])


async def tokenizer_info(request: web.Request) -> web.Response:
    return await extra_routes.tokenizer_info(request.app[ENGINE_KEY])


async def capabilities(request: web.Request) -> web.Response:
    return extra_routes.capabilities(request.app[MODEL_KEY], request.app[API_KEY])


async def embeddings(request: web.Request) -> web.Response:
    return extra_routes.embeddings(request.app[MODEL_KEY])


async def list_models(request: web.Request) -> web.Response:
    return json_response(ModelList([request.app[MODEL_KEY]]))


async def get_model(request: web.Request) -> web.Response:
    return json_response(_check_model(request, request.match_info["model_id"]))


async def openapi(request: web.Request) -> web.Response:
    return json_response(build_openapi())


def build_app(engine: EngineClient, card: ModelCard, max_body_bytes: int,
              api: ApiSpec | None = None) -> web.Application:
    app = web.Application(middlewares=[error_middleware], client_max_size=max_body_bytes)
    app[ENGINE_KEY] = engine
    app[MODEL_KEY] = card
    app[API_KEY] = api or ApiSpec()
    app.router.add_get("/v1/models", list_models)
    app.router.add_get("/v1/models/{model_id:.+}", get_model)
    app.router.add_post("/v1/completions", completions)
    app.router.add_post("/v1/chat/completions", chat_completions)
    app.router.add_post("/v1/chat/completions/render", chat_render)
    app.router.add_post("/v1/completions/render", completions_render)
    app.router.add_post("/tokenize", tokenize)
    app.router.add_post("/detokenize", detokenize)
    app.router.add_get("/tokenizer_info", tokenizer_info)
    app.router.add_get("/v1/capabilities", capabilities)
    app.router.add_post("/v1/embeddings", embeddings)
    app.router.add_get("/openapi.json", openapi)
    return app
