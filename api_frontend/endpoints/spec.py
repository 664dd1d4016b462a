"""What an endpoint declares: its routes and where the rest of the server finds it.

``endpoints.registry.ENDPOINTS`` lists every endpoint; the app adds their routes,
``/v1/capabilities`` publishes their field tiers, ``/openapi.json`` their request bodies
and ``docs/fields.md`` their field tables, all from these declarations.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from aiohttp import web

from api_frontend.errors import ApiError
from api_frontend.field_policy import FieldTable

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


@dataclass(frozen=True)
class Route:
    method: str  # GET, POST, DELETE
    path: str
    handler: Handler
    body: type | None = None  # the struct a POST body decodes into (for /openapi.json)


@dataclass(frozen=True)
class Endpoint:
    """``fields``: its slice of the field table (``fields.name`` is its column in
    docs/fields.md); ``path``: where /v1/capabilities publishes its tiers; ``runner``: the
    models that serve it (generate, pooling); ``serves``: its name in /v1/capabilities
    ``serves``; ``listed``: the paths /v1/capabilities ``endpoints`` lists;
    ``error_body``: the body of an error on its routes, where its API has its own error
    shape (None: OpenAI's)."""

    fields: FieldTable
    path: str
    runner: str
    serves: str
    routes: tuple[Route, ...]
    listed: tuple[str, ...]
    error_body: Callable[[ApiError], bytes] | None = None
