"""aiohttp's connection handler with Candor's error shape where the app cannot answer.

Requests aiohttp's own parser refuses (an over-long request line or header, a malformed
request) never reach the app's middlewares: aiohttp answers them itself in text/plain and
logs a traceback. A client that disconnects while its stream is being written surfaces
there too (a generation route logs that one line itself). This handler answers the
former in OpenAI's error shape, in one log line, with no traceback.
"""

from __future__ import annotations

import logging
from http import HTTPStatus

from aiohttp import web
from aiohttp.web_protocol import RequestHandler

from api_frontend.errors import ApiError

log = logging.getLogger("api_frontend")


class JsonErrorRequestHandler(RequestHandler):
    def handle_error(self, request, status: int = 500, exc: BaseException | None = None,
                     message: str | None = None) -> web.StreamResponse:
        if isinstance(exc, ConnectionError):  # generation routes already logged it
            log.debug("client %s went away during %s %s: %s", request.remote, request.method,
                      request.path, exc.__class__.__name__)
            raise ConnectionError("the client went away")
        if request.writer.output_size > 0:  # a response already started: cannot answer
            log.warning("error after the response started on %s: %r", request.path, exc)
            raise ConnectionError("response already started")
        if status >= 500:
            log.error("unhandled error on %s", request.path, exc_info=exc)
            err = ApiError(status, "internal server error", None, "internal_error")
        else:
            reason = (message or HTTPStatus(status).phrase).strip()
            log.info("refused a malformed HTTP request from %s: %s", request.remote,
                     reason.splitlines()[0][:200])
            err = ApiError(status, f"Malformed HTTP request: {reason[:300]}", None,
                           "bad_http_request")
        response = err.response()
        response.force_close()
        return response


class _Server(web.Server):
    def __call__(self) -> RequestHandler:
        return JsonErrorRequestHandler(self, loop=self._loop, **self._kwargs)


class JsonErrorAppRunner(web.AppRunner):
    """An AppRunner whose connections use ``JsonErrorRequestHandler``."""

    async def _make_server(self) -> web.Server:
        server = await super()._make_server()
        server.__class__ = _Server  # same state; only the protocol class it builds differs
        return server
