"""JSON bodies in and out of the HTTP routes: a typed decode whose failure is a 400
naming the field, the request decode that treats ``null`` as absent, and JSON responses."""

from __future__ import annotations

from functools import cache
from typing import TypeVar

import msgspec
from aiohttp import web

from api_frontend.errors import ApiError, from_decode_error

T = TypeVar("T")
_ENCODER = msgspec.json.Encoder()
_RAW_OBJECT = dict[str, msgspec.Raw]  # a body's top-level fields, values undecoded
_NULL = b"null"


def _too_deep() -> ApiError:
    return ApiError(400, "The request body nests JSON too deeply", None, "invalid_json")


@cache
def _decoder(kind: type) -> msgspec.json.Decoder:
    return msgspec.json.Decoder(kind)


def decode(body: bytes, kind: type[T]) -> T:
    """``body`` as a ``kind``; a 400 naming the offending field when it is not one."""
    try:
        return _decoder(kind).decode(body)
    except msgspec.MsgspecError as err:
        raise from_decode_error(err) from None
    except RecursionError:
        raise _too_deep() from None


def decode_request(body: bytes, kind: type[T]) -> tuple[T, dict[str, msgspec.Raw]]:
    """The typed request and its top-level fields as sent. A field sent as ``null`` is
    absent (SDKs send explicit nulls for unset options), so it is dropped before the
    typed decode and never reported."""
    fields = decode(body, _RAW_OBJECT)
    sent = {k: v for k, v in fields.items() if bytes(v) != _NULL}
    if len(sent) != len(fields):
        body = _ENCODER.encode(sent)
    return decode(body, kind), sent


def _is_json(content_type: str) -> bool:
    return content_type == "application/json" or content_type.endswith("+json")


def check_json_body(request: web.Request, body: bytes) -> None:
    """A POST body must be JSON (415 otherwise) and nest no deeper than the decoder can
    follow; msgspec reports the latter as RecursionError, which is the client's fault."""
    if body and "Content-Type" in request.headers and not _is_json(request.content_type):
        raise ApiError(415, f"Content-Type {request.content_type!r} is not supported; send "
                       "the body as application/json", None, "unsupported_media_type")
    try:
        _decoder(_RAW_OBJECT).decode(body)
    except RecursionError:
        raise _too_deep() from None
    except msgspec.MsgspecError:
        pass  # the route's own decode names what is wrong


def json_response(obj, status: int = 200, headers: dict[str, str] | None = None) -> web.Response:
    return web.Response(status=status, body=_ENCODER.encode(obj), content_type="application/json",
                        headers=headers)
