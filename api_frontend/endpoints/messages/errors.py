"""Anthropic's error shape, ``{"type": "error", "error": {"type", "message"}}``, for every
error on the /v1/messages routes (the app re-encodes them, wherever they were raised)."""

from __future__ import annotations

import msgspec

from api_frontend.errors import ApiError
from protocol.anthropic_api import ErrorBody, ErrorDetail

# Anthropic's error types by status (https://docs.anthropic.com/en/api/errors)
_TYPES = {400: "invalid_request_error", 401: "authentication_error",
          403: "permission_error", 404: "not_found_error", 413: "request_too_large",
          429: "rate_limit_error", 500: "api_error", 503: "overloaded_error",
          529: "overloaded_error"}
_ENCODER = msgspec.json.Encoder()


def error_detail(err: ApiError) -> ErrorDetail:
    """The shape has no ``param``: the field is named in the message where it is not yet."""
    kind = _TYPES.get(err.status, "invalid_request_error" if err.status < 500 else "api_error")
    message = err.message
    if err.param and err.param not in message:
        message = f"{err.param}: {message}"
    return ErrorDetail(kind, message)


def error_body(err: ApiError) -> bytes:
    return _ENCODER.encode(ErrorBody(error_detail(err)))
