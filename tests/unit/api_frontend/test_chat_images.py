"""The frontend checks an image_url part's shape only: remote URLs are refused with a 400
naming the part (no allow-list exists yet), a non-data: URL or a missing url likewise; a
data: URL reaches the text-only refusal (no served model takes images yet)."""

from __future__ import annotations

import msgspec
import pytest

from api_frontend.endpoints.chat.translate import chat_to_generate
from api_frontend.errors import ApiError
from protocol.openai_api import ChatCompletionRequest


def _refusal(image_url) -> ApiError:
    body = {"model": "m", "messages": [
        {"role": "system", "content": "s"},
        {"role": "user", "content": [{"type": "text", "text": "what?"},
                                     {"type": "image_url", "image_url": image_url}]}]}
    req = msgspec.convert(body, ChatCompletionRequest)
    with pytest.raises(ApiError) as err:
        chat_to_generate(req, "r", "x", 0.0)
    assert err.value.status == 400
    return err.value


@pytest.mark.parametrize("url", ["https://example.com/a.png", "http://10.0.0.1/a.png"])
def test_remote_urls_are_refused_naming_the_part(url):
    err = _refusal({"url": url})
    assert err.param == "messages[1].content[1].image_url.url"
    assert err.code == "unsupported_image_url" and "data: URL" in err.message


@pytest.mark.parametrize("image_url, param", [
    ({"url": "file:///etc/passwd"}, "messages[1].content[1].image_url.url"),
    ({"detail": "low"}, "messages[1].content[1].image_url"),
    ("data:image/png;base64,AAAA", "messages[1].content[1].image_url"),
])
def test_malformed_image_urls_are_refused(image_url, param):
    err = _refusal(image_url)
    assert err.param == param and err.code == "invalid_value"


def test_a_data_url_meets_the_text_only_refusal():
    err = _refusal({"url": "data:image/png;base64,AAAA"})
    assert err.param == "messages[1].content[1].type" and err.code == "unsupported_content"
