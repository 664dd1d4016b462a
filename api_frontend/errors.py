"""One error path: every failure leaves the frontend as OpenAI's error body."""

from __future__ import annotations

import re

import msgspec
from aiohttp import web

from protocol.ipc import RequestError
from protocol.openai_api import ErrorBody, ErrorDetail

_TYPES = {400: "invalid_request_error", 401: "authentication_error",
          404: "not_found_error", 405: "invalid_request_error",
          413: "invalid_request_error", 503: "service_unavailable_error",
          500: "internal_error"}

_ENCODER = msgspec.json.Encoder()

# on the response ApiError.response() builds: an endpoint with its own error shape
# (``Endpoint.error_body``) re-encodes it (api_frontend.app)
API_ERROR = web.ResponseKey("api_error", object)

RETRY_AFTER_S = "1"  # seconds, on a 503 the engine answered (queue full, lost process)


class ApiError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None,
                 code: str | None = None, type: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.type = type or _TYPES.get(status, "invalid_request_error")
        self.headers = headers or {}

    def body(self) -> ErrorBody:
        return ErrorBody(ErrorDetail(self.message, self.type, self.param, self.code))

    def encode(self) -> bytes:
        return _ENCODER.encode(self.body())

    @classmethod
    def from_engine(cls, msg: RequestError) -> "ApiError":
        """A failure a worker reported for one request; 503s tell the client when to retry."""
        headers = {"Retry-After": RETRY_AFTER_S} if msg.status == 503 else None
        return cls(msg.status, msg.message, msg.param, msg.code, msg.type, headers)

    def response(self) -> web.Response:
        response = web.Response(status=self.status, body=self.encode(),
                                content_type="application/json", headers=self.headers)
        response[API_ERROR] = self
        return response


_AT_PATH = re.compile(r" - at `\$\.?(?P<path>[^`]*)`$")
_MISSING = re.compile(r"(missing required|contains unknown) field `(?P<field>[^`]+)`")


def from_decode_error(err: msgspec.MsgspecError) -> ApiError:
    """Turn msgspec's message ("Expected `int`, got `str` - at `$.max_tokens`") into a
    400 whose ``param`` is the offending field's JSON path."""
    text = str(err)
    if isinstance(err, msgspec.DecodeError) and not isinstance(err, msgspec.ValidationError):
        return ApiError(400, f"The request body is not valid JSON: {text}", None,
                        "invalid_json")
    param = None
    match = _AT_PATH.search(text)
    if match:
        # msgspec writes a dict value's path as `field[...]`; the field is what to name
        param = match.group("path").replace("[...]", "") or None
    missing = _MISSING.search(text)
    if missing:
        field = missing.group("field")
        param = f"{param}.{field}" if param else field
    return ApiError(400, f"Invalid request: {text}", param, "invalid_value")
