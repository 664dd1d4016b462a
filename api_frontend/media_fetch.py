"""http(s) image URLs, fetched behind the operator's allow-list (``--allowed-media-domains``,
``limits.allowed_media_domains``; empty, the default: none are) and handed on as the
``data:`` URL of the bytes fetched.

Why the frontend fetches, and not the tokenizer worker that decodes images: the frontend is
the process built around an event loop for network I/O, so a fetch is one more await among
its other requests; the tokenizer worker serves its backlog one request at a time, so a
slow host there would stall every request queued behind it (or need a second loop, parked
requests and abort plumbing). A fetch also lives and dies with its client's request: a
client that goes away cancels its handler and, with it, its fetches. The scheduler and GPU
workers never see a URL. What comes back goes on as a ``data:`` URL, so decoding, the pixel
limit and the image processor stay in the tokenizer worker alone, and an image sent by URL
is, from there on, the same bytes as the same image sent inline: the same tokens.

Each fetch is bounded: the body's bytes by ``max_image_bytes`` while it streams (a
Content-Length past it is refused unread), the wall time by ``media_fetch_timeout_s``
(redirects included), the redirects by ``media_max_redirects``, each to an ``http``/
``https`` URL on a listed host. Every refusal is a 400 naming the part (``messages[i].
content[j]``) and saying why; hosts are matched exactly, as vLLM does (no wildcards: a
listed name is a host the operator trusts, DNS included). ``inline`` also reads
``file://`` URLs, through ``local_media`` (behind ``--allowed-local-media-path``), into
the same ``data:`` URLs.
"""

from __future__ import annotations

import asyncio
import base64
from typing import Any

import aiohttp
from yarl import URL

from api_frontend import local_media
from api_frontend.errors import ApiError
from api_frontend.media_errors import FetchError, shown
from cluster.topology import RequestLimits

REDIRECTS = (301, 302, 303, 307, 308)
_CHUNK = 1 << 16


def is_remote(url: str) -> bool:
    return url[:8].lower().startswith(("http://", "https://"))


def refusal(url: str, domains: list[str]) -> str | None:
    """Why ``url`` may not be fetched under the allow-list ``domains``; None: it may."""
    try:
        parsed = URL(url)
    except (ValueError, TypeError):
        return "it is not a valid URL"
    if parsed.scheme not in ("http", "https"):
        return f"its scheme is {parsed.scheme!r}; only http and https URLs are fetched"
    host = (parsed.host or "").lower().rstrip(".")
    if not host:
        return "it names no host"
    if host not in domains:
        shown_host = f"[{host}]" if ":" in host else host
        if not domains:
            return (f"this deployment fetches no remote images (host {shown_host!r}); start "
                    "it with --allowed-media-domains naming the host, or send the image "
                    "inline as a data: URL (data:image/png;base64,...)")
        # (the list itself is the operator's: not told to clients)
        return f"host {shown_host!r} is not in this deployment's --allowed-media-domains"
    return None


class MediaFetcher:
    """One frontend's image fetches: the limits they run under and the HTTP client session
    (made on first use, inside the serving loop; ``close`` at shutdown)."""

    def __init__(self, limits: RequestLimits) -> None:
        self.domains = list(limits.allowed_media_domains)
        self.max_bytes = limits.max_image_bytes
        self.timeout_s = limits.media_fetch_timeout_s
        self.max_redirects = limits.media_max_redirects
        self.local_root = limits.allowed_local_media_path
        self._session: aiohttp.ClientSession | None = None

    def _client(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            self._session = aiohttp.ClientSession(
                timeout=aiohttp.ClientTimeout(total=None), trust_env=False,
                headers={"User-Agent": "candor-media-fetch", "Accept": "image/*"})
        return self._session

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def fetch(self, url: str) -> tuple[str, bytes]:
        """(media type, bytes) of the image at ``url``; a FetchError says why not."""
        why = refusal(url, self.domains)
        if why is not None:
            raise FetchError(f"the image URL {shown(url)} is not fetched: {why}",
                             "unsupported_image_url")
        try:
            async with asyncio.timeout(self.timeout_s):
                return await self._follow(url)
        except TimeoutError:
            raise FetchError(f"fetching the image at {shown(url)} took longer than "
                             f"{self.timeout_s:g}s (--media-fetch-timeout)",
                             "image_fetch_timeout") from None
        except (aiohttp.ClientError, OSError, ValueError) as exc:
            raise FetchError(f"the image at {shown(url)} could not be fetched "
                             f"({type(exc).__name__}: {exc})", "image_fetch_failed") from None

    async def _follow(self, url: str) -> tuple[str, bytes]:
        hops = 0
        while True:
            async with self._client().get(url, allow_redirects=False) as resp:
                if resp.status in REDIRECTS:
                    location = resp.headers.get("Location")
                    if not location:
                        raise FetchError(f"the image at {shown(url)} answered HTTP "
                                         f"{resp.status} with no Location", "image_fetch_failed")
                    hops += 1
                    if hops > self.max_redirects:
                        raise FetchError(f"the image at {shown(url)} redirects more than "
                                         f"{self.max_redirects} times (--media-max-redirects)",
                                         "image_fetch_failed")
                    target = str(resp.url.join(URL(location)))
                    why = refusal(target, self.domains)
                    if why is not None:
                        raise FetchError(f"the image at {shown(url)} redirects to "
                                         f"{shown(target)}, which is not fetched: {why}",
                                         "unsupported_image_url")
                    url = target
                    continue
                if resp.status != 200:
                    raise FetchError(f"the image at {shown(url)} could not be fetched: HTTP "
                                     f"{resp.status} {resp.reason or ''}".rstrip(),
                                     "image_fetch_failed")
                media = resp.content_type.lower()
                if not media.startswith("image/"):
                    raise FetchError(f"the URL {shown(url)} is not an image (Content-Type "
                                     f"{media!r})", "invalid_image")
                return media, await self._body(resp, url)

    async def _body(self, resp: aiohttp.ClientResponse, url: str) -> bytes:
        """The body, refused as soon as it is known to be past ``max_bytes``."""
        limit = f"this deployment's limit of {self.max_bytes} bytes (--max-image-bytes)"
        size = resp.content_length
        if size is not None and size > self.max_bytes:
            raise FetchError(f"the image at {shown(url)} is {size} bytes (its Content-Length), "
                             f"more than {limit}", "image_too_large")
        data = bytearray()
        async for chunk in resp.content.iter_chunked(_CHUNK):
            data += chunk
            if len(data) > self.max_bytes:
                raise FetchError(f"the image at {shown(url)} is larger than {limit}; the fetch "
                                 "stopped there", "image_too_large")
        return bytes(data)

    async def read(self, url: str) -> tuple[str, bytes]:
        """(media type, bytes) of an http(s) URL (fetched) or a file:// one (read in a
        thread, off the loop); a FetchError says why not."""
        if not local_media.is_local(url):
            return await self.fetch(url)
        why = local_media.refusal(url, self.local_root)
        if why is not None:
            raise FetchError(f"the image URL {shown(url)} is not read: {why}",
                             "unsupported_image_url")
        return await asyncio.to_thread(local_media.read, url, self.local_root, self.max_bytes)

    async def inline(self, messages: list[dict[str, Any]] | None) -> None:
        """Each http(s) or file:// ``image_url`` part of chat ``messages`` rewritten in
        place as the ``data:`` URL of what it points to, the request's reads run together
        (a URL twice is read once). The first to fail is a 400 naming its part
        (``messages[i].content[j]``), and the others are cancelled."""
        wanted: dict[str, list[tuple[str, dict[str, Any]]]] = {}
        for i, message in enumerate(messages or []):
            content = message.get("content")
            for j, part in enumerate(content if isinstance(content, list) else []):
                if not isinstance(part, dict) or part.get("type") != "image_url":
                    continue
                image_url = part.get("image_url")
                url = image_url.get("url") if isinstance(image_url, dict) else None
                if isinstance(url, str) and (is_remote(url) or local_media.is_local(url)):
                    wanted.setdefault(url, []).append((f"messages[{i}].content[{j}]", image_url))
        if not wanted:
            return

        async def one(url: str) -> None:
            try:
                media, data = await self.read(url)
            except FetchError as err:
                where = wanted[url][0][0]
                raise ApiError(400, f"{where}: {err}", where, err.code) from None
            inline = f"data:{media};base64,{base64.b64encode(data).decode('ascii')}"
            for _, image_url in wanted[url]:
                image_url["url"] = inline

        try:
            async with asyncio.TaskGroup() as group:
                for url in wanted:
                    group.create_task(one(url))
        except BaseExceptionGroup as failed:
            errors = [e for e in failed.exceptions if isinstance(e, ApiError)]
            if not errors:
                raise
            raise errors[0] from None
