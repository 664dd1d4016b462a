"""The aiohttp application: the error middleware, every endpoint's routes
(``endpoints.registry``) and the routes around them (models, tokenize, capabilities,
LoRA adapters, OpenAPI).

The frontend never tokenizes or renders: it validates the body, hands a GenerateReq to
the tokenizer workers, and turns the deltas that come back into OpenAI responses.
/health, /metrics and the other operations routes live in api_frontend/ops.py.
"""

from __future__ import annotations

import asyncio
import logging

from aiohttp import web

from api_frontend import extra_routes, lora_routes
from api_frontend.app_keys import (API_KEY, BODY_TIMEOUT_KEY, ENGINE_KEY, LOG_REQUESTS_KEY,
                                   LORA_KEY, MEDIA_KEY, MODELS_KEY)
from api_frontend.capabilities import capabilities as capabilities_body
from api_frontend.endpoints.registry import ENDPOINTS
from api_frontend.endpoints.responses.peers import ResponsePeers
from api_frontend.endpoints.responses.routes import RESPONSES_KEY
from api_frontend.endpoints.responses.store import ResponseStore
from api_frontend.engine_client import EngineClient
from api_frontend.errors import API_ERROR, ApiError
from api_frontend.generate import REQUEST_ID_KEY
from api_frontend.json_body import check_json_body, json_response
from api_frontend.media_fetch import MediaFetcher
from api_frontend.openapi import build_openapi
from api_frontend.served_models import ServedModels
from cluster.topology import ApiSpec, LoraSpec
from protocol.openai_api import ModelList

log = logging.getLogger("api_frontend")
REQUEST_ID_HEADER = "X-Request-Id"
MAX_REQUEST_ID_CHARS = 256


async def _read_body(request: web.Request) -> bytes:
    """The whole body within the deployment's time limit: a client trickling bytes would
    otherwise hold a connection and a handler for ever. Read once, here; handlers get the
    cached bytes."""
    timeout = request.app[BODY_TIMEOUT_KEY]
    try:
        return await asyncio.wait_for(request.read(), timeout)
    except (asyncio.TimeoutError, TimeoutError):
        raise ApiError(408, f"the request body did not arrive within {timeout:g}s", None,
                       "request_timeout") from None


@web.middleware
async def error_middleware(request: web.Request, handler):
    rid = request.headers.get(REQUEST_ID_HEADER)
    if rid:
        request[REQUEST_ID_KEY] = rid[:MAX_REQUEST_ID_CHARS]
    try:
        if request.method == "POST" and request.can_read_body:
            check_json_body(request, await _read_body(request))
        response = await handler(request)
        if rid and not response.prepared:
            response.headers[REQUEST_ID_HEADER] = request[REQUEST_ID_KEY]
        return response
    except ApiError as err:
        response = err.response()
        if err.status == 408:  # the connection's framing is lost with the half-read body
            response.force_close()
        if rid:
            response.headers[REQUEST_ID_HEADER] = request[REQUEST_ID_KEY]
        return response
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
        log.exception("unhandled error on %s (X-Request-Id %s)", request.path, rid)
        return ApiError(500, "internal server error", None, "internal_error").response()


# route path -> the error body of an endpoint whose API has its own error shape
_ERROR_BODIES = {route.path: ep.error_body for ep in ENDPOINTS if ep.error_body is not None
                 for route in ep.routes}


async def _own_error_shape(request: web.Request, response: web.StreamResponse) -> None:
    """An error on such a route, wherever it was raised (the body, the API key, admission),
    in that API's shape: re-encoded as the response goes out."""
    err = response.get(API_ERROR)
    shape = _ERROR_BODIES.get(request.path)
    if err is not None and shape is not None:
        body = shape(err)
        response.body = body
        response.headers["Content-Length"] = str(len(body))


async def tokenize(request: web.Request) -> web.Response:
    return await extra_routes.tokenize(request, request.app[MODELS_KEY], request.app[API_KEY])


async def detokenize(request: web.Request) -> web.Response:
    return await extra_routes.detokenize(request, request.app[MODELS_KEY])


async def tokenizer_info(request: web.Request) -> web.Response:
    return await extra_routes.tokenizer_info(request.app[MODELS_KEY].primary.engine)


async def capabilities(request: web.Request) -> web.Response:
    return capabilities_body(request.app[MODELS_KEY], request.app[API_KEY],
                             request.app[ENGINE_KEY].stats, request.app[LORA_KEY])


async def list_models(request: web.Request) -> web.Response:
    return json_response(ModelList(request.app[MODELS_KEY].cards()))


async def load_lora_adapter(request: web.Request) -> web.Response:
    app = request.app
    return await lora_routes.load(request, app[ENGINE_KEY], app[MODELS_KEY], app[LORA_KEY])


async def unload_lora_adapter(request: web.Request) -> web.Response:
    return await lora_routes.unload(request, request.app[ENGINE_KEY], request.app[LORA_KEY])


async def get_model(request: web.Request) -> web.Response:
    return json_response(request.app[MODELS_KEY].find(request.match_info["model_id"])[1])


async def openapi(request: web.Request) -> web.Response:
    return json_response(build_openapi())


async def _close_media(app: web.Application) -> None:
    await app[MEDIA_KEY].close()


def build_app(engine: EngineClient, models: ServedModels, max_body_bytes: int,
              api: ApiSpec | None = None, body_read_timeout_s: float = 60.0,
              responses: ResponsePeers | None = None,
              lora: LoraSpec | None = None) -> web.Application:
    """``models``: what the routes serve, by name (each reaching its engines through
    ``engine``); ``responses``: where /v1/responses are stored and found (default: this
    process's store only, as with one frontend); ``lora``: the adapter settings (default:
    off)."""
    app = web.Application(middlewares=[error_middleware], client_max_size=max_body_bytes)
    app.on_response_prepare.append(_own_error_shape)
    app[BODY_TIMEOUT_KEY] = body_read_timeout_s
    app[ENGINE_KEY] = engine
    app[MODELS_KEY] = models
    app[LOG_REQUESTS_KEY] = False
    app[API_KEY] = api = api or ApiSpec()
    app[LORA_KEY] = lora or LoraSpec()
    app[MEDIA_KEY] = MediaFetcher(api.limits)
    app.on_cleanup.append(_close_media)
    app[RESPONSES_KEY] = responses or ResponsePeers(
        ResponseStore(api.responses_store), 0, [engine.reply_to], engine.reply_to, engine.ctx)
    app.router.add_get("/v1/models", list_models)
    app.router.add_get("/v1/models/{model_id:.+}", get_model)
    for endpoint in ENDPOINTS:
        for route in endpoint.routes:
            if route.method == "GET":  # add_get answers HEAD too
                app.router.add_get(route.path, route.handler)
            else:
                app.router.add_route(route.method, route.path, route.handler)
    app.router.add_post("/tokenize", tokenize)
    app.router.add_post("/detokenize", detokenize)
    app.router.add_get("/tokenizer_info", tokenizer_info)
    app.router.add_get("/v1/capabilities", capabilities)
    app.router.add_post("/v1/load_lora_adapter", load_lora_adapter)
    app.router.add_post("/v1/unload_lora_adapter", unload_lora_adapter)
    app.router.add_get("/openapi.json", openapi)
    return app
