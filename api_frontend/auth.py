"""API keys: ``Authorization: Bearer <key>`` (or Anthropic's ``x-api-key: <key>``) on every
route but the open ops probes.

Keys come from ``--api-key`` flags, ``CANDOR_API_KEY``/``VLLM_API_KEY`` (comma-separated)
and key files (one per line). The launcher resolves them once and hands them to the
frontends in ``KEYS_ENV`` (an environment variable: argv is world-readable in /proc, a
process's environment is not). Comparison is constant-time against every key, so the
time of a 401 says nothing about how close a guess was.
"""

from __future__ import annotations

import hmac
import os
from collections.abc import Iterable

from aiohttp import web

from api_frontend.errors import ApiError

KEYS_ENV = "CANDOR_API_KEYS"  # newline-separated, set by the launcher for the frontends
USER_ENVS = ("CANDOR_API_KEY", "VLLM_API_KEY")  # comma-separated, set by the operator
OPS_ROUTES = frozenset({"/health", "/live", "/metrics", "/version"})


def _clean(keys: Iterable[str]) -> list[str]:
    return list(dict.fromkeys(k.strip() for k in keys if k.strip()))


def read_key_file(path: str) -> list[str]:
    """One key per line; blank lines and ``#`` comments are skipped."""
    with open(os.path.expanduser(path), encoding="utf-8") as fh:
        return _clean(line for line in fh if not line.lstrip().startswith("#"))


def collect_keys(flags: Iterable[str], key_files: Iterable[str],
                 environ: dict[str, str]) -> list[str]:
    """Every configured key: flags (each may be comma-separated), the operator's
    environment variables, then key files."""
    keys: list[str] = []
    for value in [*flags, *(environ.get(name, "") for name in USER_ENVS)]:
        keys.extend(value.split(","))
    for path in key_files:
        keys.extend(read_key_file(path))
    return _clean(keys)


def keys_from_env(environ: dict[str, str]) -> list[str]:
    return _clean(environ.get(KEYS_ENV, "").split("\n"))


class ApiKeys:
    def __init__(self, keys: list[str], protect_ops: bool) -> None:
        self._keys = [k.encode() for k in keys]
        self.protect_ops = protect_ops

    @property
    def enabled(self) -> bool:
        return bool(self._keys)

    def needs_key(self, path: str) -> bool:
        return self.enabled and (self.protect_ops or path not in OPS_ROUTES)

    def accepts(self, header: str | None, api_key: str | None = None) -> bool:
        """``header``: Authorization (a Bearer token); ``api_key``: x-api-key, as Anthropic's
        clients send it (used when there is no Bearer token)."""
        scheme, _, token = (header or "").partition(" ")
        given = token.strip().encode() if scheme.lower() == "bearer" else b""
        if not given and api_key:
            given = api_key.strip().encode()
        ok = False
        for key in self._keys:  # no early exit: every key is compared every time
            ok |= hmac.compare_digest(given, key)
        return ok and bool(given)

    def middleware(self):
        @web.middleware
        async def require_api_key(request: web.Request, handler):
            if self.needs_key(request.path) and not self.accepts(
                    request.headers.get("Authorization"), request.headers.get("x-api-key")):
                return ApiError(
                    401, "Incorrect or missing API key: send 'Authorization: Bearer "
                    "<key>' (or 'x-api-key: <key>')", None, "invalid_api_key", type="authentication_error",
                    headers={"WWW-Authenticate": 'Bearer realm="candor"'}).response()
            return await handler(request)
        return require_api_key
