"""A local image host for the media-fetch tests: an aiohttp server on 127.0.0.1 (its own
thread and loop, so a test's server processes and the test itself can reach it) serving a
PNG and the ways a fetch goes wrong: a 404, an HTML page, a body past a byte limit (with and
without Content-Length), an endpoint that answers only after it is released, redirects to
itself and to a host that is not listed (``localhost`` beside ``127.0.0.1``)."""

from __future__ import annotations

import asyncio
import threading

from aiohttp import web


class ImageHost:
    def __init__(self, png: bytes, big_bytes: int = 4096) -> None:
        self.png = png
        self.big_bytes = big_bytes
        self.hits: dict[str, int] = {}
        self._loop = asyncio.new_event_loop()
        self._release: asyncio.Event | None = None
        self._runner: web.AppRunner | None = None
        self.port = 0

    # ------------------------------------------------------------------ routes

    async def _png(self, request: web.Request) -> web.Response:
        return web.Response(body=self.png, content_type="image/png")

    async def _html(self, request: web.Request) -> web.Response:
        return web.Response(text="<html>not an image</html>", content_type="text/html")

    async def _big(self, request: web.Request) -> web.Response:
        return web.Response(body=b"\x89PNG" + b"\0" * self.big_bytes, content_type="image/png")

    async def _big_chunked(self, request: web.Request) -> web.StreamResponse:
        """No Content-Length: the limit can only be met while the body streams."""
        resp = web.StreamResponse(headers={"Content-Type": "image/png"})
        resp.enable_chunked_encoding()
        await resp.prepare(request)
        for _ in range(self.big_bytes // 1024 + 2):
            await resp.write(b"\0" * 1024)
        await resp.write_eof()
        return resp

    async def _slow(self, request: web.Request) -> web.Response:
        """Answers once the test releases it (or the client gives up)."""
        await self._release.wait()
        return await self._png(request)

    async def _redirect_here(self, request: web.Request) -> web.Response:
        raise web.HTTPFound("/cat.png")

    async def _redirect_away(self, request: web.Request) -> web.Response:
        raise web.HTTPFound(f"http://localhost:{self.port}/cat.png")

    async def _loop_redirect(self, request: web.Request) -> web.Response:
        raise web.HTTPFound("/loop")

    @web.middleware
    async def _count(self, request: web.Request, handler):
        self.hits[request.path] = self.hits.get(request.path, 0) + 1
        return await handler(request)

    # ------------------------------------------------------------------ life

    def url(self, path: str) -> str:
        return f"http://127.0.0.1:{self.port}{path}"

    def release_slow(self) -> None:
        self._loop.call_soon_threadsafe(self._release.set)

    def __enter__(self) -> "ImageHost":
        ready = threading.Event()

        async def start() -> None:
            self._release = asyncio.Event()
            app = web.Application(middlewares=[self._count])
            app.router.add_get("/cat.png", self._png)
            app.router.add_get("/page.html", self._html)
            app.router.add_get("/big.png", self._big)
            app.router.add_get("/big-chunked.png", self._big_chunked)
            app.router.add_get("/slow.png", self._slow)
            app.router.add_get("/redirect-here", self._redirect_here)
            app.router.add_get("/redirect-away", self._redirect_away)
            app.router.add_get("/loop", self._loop_redirect)
            self._runner = web.AppRunner(app, shutdown_timeout=0.5)
            await self._runner.setup()
            site = web.TCPSite(self._runner, "127.0.0.1", 0)
            await site.start()
            self.port = site._server.sockets[0].getsockname()[1]

        def run() -> None:
            asyncio.set_event_loop(self._loop)
            self._loop.run_until_complete(start())
            ready.set()
            self._loop.run_forever()

        self._thread = threading.Thread(target=run, daemon=True)
        self._thread.start()
        assert ready.wait(30), "the image host did not start"
        return self

    def __exit__(self, *exc) -> None:
        async def stop() -> None:
            self._release.set()
            await self._runner.cleanup()

        asyncio.run_coroutine_threadsafe(stop(), self._loop).result(30)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(30)
