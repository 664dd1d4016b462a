"""The frontend's image fetches (api_frontend/media_fetch.py) against a local aiohttp host:
only listed hosts, only http(s), redirects checked hop by hop, the byte limit met while
the body streams, the time limit, non-200 and non-image bodies refused with the reason;
``inline`` rewrites a request's URLs as data: URLs, fetching a URL once, naming the part
of the first failure; one slow fetch holds up no other."""

from __future__ import annotations

import asyncio
import base64
import io

import pytest
from PIL import Image

from api_frontend.errors import ApiError
from api_frontend.media_fetch import FetchError, MediaFetcher, refusal
from cluster.topology import RequestLimits
from tests.support.image_host import ImageHost


def _png() -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (9, 7), (200, 30, 60)).save(buf, format="PNG")
    return buf.getvalue()


PNG = _png()


@pytest.fixture(scope="module")
def host():
    with ImageHost(PNG, big_bytes=4096) as h:
        yield h


def _fetcher(**limits) -> MediaFetcher:
    return MediaFetcher(RequestLimits(**{"allowed_media_domains": ["127.0.0.1"],
                                         "max_image_bytes": 2048, **limits}))


async def _fails(fetcher: MediaFetcher, url: str) -> FetchError:
    try:
        with pytest.raises(FetchError) as err:
            await fetcher.fetch(url)
    finally:
        await fetcher.close()
    return err.value


@pytest.mark.parametrize("url, domains, says", [
    ("https://example.com/a.png", [], "fetches no remote images (host 'example.com'); start "
     "it with --allowed-media-domains"),
    ("https://Example.com:8443/a.png", ["example.com"], None),
    ("http://evil.example.com/a.png", ["example.com"], "host 'evil.example.com' is not in"),
    ("http://[::1]:9/a.png", ["::1"], None),
    ("ftp://example.com/a.png", ["example.com"], "only http and https"),
])
def test_the_allow_list_matches_hosts_exactly(url, domains, says):
    why = refusal(url, domains)
    assert (why is None) if says is None else (says in why), why


async def test_a_listed_png_comes_back_as_its_bytes(host):
    fetcher = _fetcher()
    try:
        assert await fetcher.fetch(host.url("/cat.png")) == ("image/png", PNG)
        assert await fetcher.fetch(host.url("/redirect-here")) == ("image/png", PNG)
    finally:
        await fetcher.close()


@pytest.mark.parametrize("path, code, says", [
    ("/missing.png", "image_fetch_failed", "HTTP 404"),
    ("/page.html", "invalid_image", "is not an image (Content-Type 'text/html')"),
    ("/big.png", "image_too_large", "is 4100 bytes (its Content-Length), more than this "
     "deployment's limit of 2048 bytes (--max-image-bytes)"),
    ("/big-chunked.png", "image_too_large", "larger than this deployment's limit of 2048 bytes "
     "(--max-image-bytes); the fetch stopped there"),
    ("/redirect-away", "unsupported_image_url", "redirects to http://localhost:"),
    ("/loop", "image_fetch_failed", "redirects more than 5 times (--media-max-redirects)"),
])
async def test_each_failure_says_why(host, path, code, says):
    err = await _fails(_fetcher(), host.url(path))
    assert err.code == code and says in str(err), str(err)


async def test_no_redirects_when_the_operator_allows_none(host):
    err = await _fails(_fetcher(media_max_redirects=0), host.url("/redirect-here"))
    assert "redirects more than 0 times" in str(err)


async def test_a_fetch_past_its_time_limit_is_refused(host):
    err = await _fails(_fetcher(media_fetch_timeout_s=0.2), host.url("/slow.png"))
    assert err.code == "image_fetch_timeout" and "longer than 0.2s (--media-fetch-timeout)" in str(err)


async def test_a_slow_fetch_holds_up_no_other(host):
    """A fetch waiting on a host that has not answered, and another that completes
    meanwhile on the same fetcher (same loop, same session)."""
    fetcher = _fetcher(media_fetch_timeout_s=60)
    try:
        slow = asyncio.ensure_future(fetcher.fetch(host.url("/slow.png")))
        assert await fetcher.fetch(host.url("/cat.png")) == ("image/png", PNG)
        assert not slow.done()
        host.release_slow()
        assert await slow == ("image/png", PNG)
    finally:
        await fetcher.close()


def _messages(*urls: str) -> list[dict]:
    return [{"role": "system", "content": "s"},
            {"role": "user", "content": [{"type": "text", "text": "x"}, *(
                {"type": "image_url", "image_url": {"url": u}} for u in urls)]}]


async def test_inline_rewrites_remote_urls_as_data_urls_fetching_each_once(host):
    fetcher = _fetcher()
    before = host.hits.get("/cat.png", 0)
    inline = "data:image/png;base64,AAAA"
    messages = _messages(host.url("/cat.png"), inline, host.url("/cat.png"))
    try:
        await fetcher.inline(messages)
    finally:
        await fetcher.close()
    urls = [p["image_url"]["url"] for p in messages[1]["content"][1:]]
    want = "data:image/png;base64," + base64.b64encode(PNG).decode()
    assert urls == [want, inline, want]
    assert host.hits["/cat.png"] == before + 1


async def test_inline_names_the_part_that_failed(host):
    fetcher = _fetcher()
    try:
        with pytest.raises(ApiError) as err:
            await fetcher.inline(_messages(host.url("/cat.png"), host.url("/page.html")))
    finally:
        await fetcher.close()
    assert err.value.status == 400 and err.value.param == "messages[1].content[2]"
    assert err.value.message.startswith("messages[1].content[2]: the URL http://127.0.0.1:")
    assert err.value.code == "invalid_image"
