"""CORS for browser clients (vLLM's ``--allowed-origins`` and friends): answers
preflights itself and adds the headers to every response, so a web UI on another origin
can call the API. Outermost middleware: a preflight never needs an API key, and a 401 still
carries the headers the browser needs to read it. No origins configured: no CORS headers,
and OPTIONS falls through to the routes (405)."""

from __future__ import annotations

from aiohttp import web

from cluster.topology import CorsSpec

_PREFLIGHT_MAX_AGE_S = "600"


def _origin_allowed(spec: CorsSpec, origin: str) -> bool:
    return "*" in spec.allowed_origins or origin in spec.allowed_origins


def _allow_origin(spec: CorsSpec, origin: str) -> str:
    # a credentialed response may not use the wildcard; echo the origin instead
    return "*" if "*" in spec.allowed_origins and not spec.allow_credentials else origin


def cors_middleware(spec: CorsSpec):
    @web.middleware
    async def cors(request: web.Request, handler):
        origin = request.headers.get("Origin")
        if origin is None or not _origin_allowed(spec, origin):
            return await handler(request)
        headers = {"Access-Control-Allow-Origin": _allow_origin(spec, origin), "Vary": "Origin"}
        if spec.allow_credentials:
            headers["Access-Control-Allow-Credentials"] = "true"
        wanted = request.headers.get("Access-Control-Request-Method")
        if request.method == "OPTIONS" and wanted is not None:
            asked = request.headers.get("Access-Control-Request-Headers", "")
            allow_headers = asked if "*" in spec.allowed_headers else ", ".join(
                spec.allowed_headers)
            methods = ("GET, POST, PUT, DELETE, PATCH, OPTIONS"
                       if "*" in spec.allowed_methods else ", ".join(spec.allowed_methods))
            headers.update({"Access-Control-Allow-Methods": methods,
                            "Access-Control-Max-Age": _PREFLIGHT_MAX_AGE_S})
            if allow_headers:
                headers["Access-Control-Allow-Headers"] = allow_headers
            return web.Response(status=204, headers=headers)
        response = await handler(request)
        if "*" in spec.allowed_headers or spec.allowed_headers:
            headers["Access-Control-Expose-Headers"] = "x-candor-adjustments, X-Request-Id"
        response.headers.update(headers)
        return response
    return cors
