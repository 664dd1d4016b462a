"""The frontend checks an image_url part's shape only: remote URLs are refused with a 400
naming the part and its host unless the operator lists the host (--allowed-media-domains;
then the URL passes on, to be fetched before submission: test_media_fetch.py), a URL of
another scheme or a missing url likewise; a
data: URL reaches the text-only refusal for a text model, and passes on to the tokenizer
worker for a model that takes images, up to the deployment's count per prompt."""

from __future__ import annotations

import msgspec
import pytest

from api_frontend.endpoints.chat.translate import chat_to_generate
from api_frontend.errors import ApiError
from cluster.topology import ApiSpec, RequestLimits
from protocol.openai_api import ChatCompletionRequest


def _body(*parts) -> ChatCompletionRequest:
    body = {"model": "m", "messages": [
        {"role": "system", "content": "s"},
        {"role": "user", "content": [{"type": "text", "text": "what?"}, *parts]}]}
    return msgspec.convert(body, ChatCompletionRequest)


def _refusal(image_url, vision: bool = False) -> ApiError:
    req = _body({"type": "image_url", "image_url": image_url})
    with pytest.raises(ApiError) as err:
        chat_to_generate(req, "r", "x", 0.0, vision=vision)
    assert err.value.status == 400
    return err.value


@pytest.mark.parametrize("vision", [False, True])
@pytest.mark.parametrize("url", ["https://example.com/a.png", "http://10.0.0.1/a.png"])
def test_remote_urls_are_refused_naming_the_part(url, vision):
    err = _refusal({"url": url}, vision)
    assert err.param == "messages[1].content[1].image_url.url"
    assert err.code == "unsupported_image_url" and "data: URL" in err.message


def test_a_listed_host_passes_on_and_others_name_the_flag():
    api = ApiSpec(limits=RequestLimits(allowed_media_domains=["images.example.com"]))
    part = {"type": "image_url", "image_url": {"url": "https://images.example.com/a.png"}}
    tr = chat_to_generate(_body(part), "r", "x", 0.0, api=api, vision=True)
    assert tr.gen.messages[1]["content"][1] == part  # fetched later, by Flight.start
    with pytest.raises(ApiError) as err:
        chat_to_generate(_body({"type": "image_url", "image_url": {"url": "http://10.0.0.1/a"}}),
                         "r", "x", 0.0, api=api, vision=True)
    assert err.value.param == "messages[1].content[1].image_url.url"
    assert "host '10.0.0.1' is not in this deployment's --allowed-media-domains" in err.value.message


@pytest.mark.parametrize("url, root, says", [
    ("file:///etc/passwd", "", "reads no local files; start it with --allowed-local-media-path"),
    ("file://other.example/srv/a.png", "/srv", "names host 'other.example'"),
])
def test_file_urls_are_refused_without_the_flag_or_naming_a_host(url, root, says):
    api = ApiSpec(limits=RequestLimits(allowed_local_media_path=root))
    with pytest.raises(ApiError) as err:
        chat_to_generate(_body({"type": "image_url", "image_url": {"url": url}}), "r", "x", 0.0,
                         api=api, vision=True)
    assert (err.value.param, err.value.code) == ("messages[1].content[1].image_url.url",
                                                 "unsupported_image_url")
    assert says in err.value.message


def test_a_file_url_under_the_flag_passes_on():
    api = ApiSpec(limits=RequestLimits(allowed_local_media_path="/srv/images"))
    part = {"type": "image_url", "image_url": {"url": "file:///srv/images/a.png"}}
    tr = chat_to_generate(_body(part), "r", "x", 0.0, api=api, vision=True)
    assert tr.gen.messages[1]["content"][1] == part  # read later, by the frontend's inline


@pytest.mark.parametrize("image_url, param", [
    ({"url": "ftp://example.com/a.png"}, "messages[1].content[1].image_url.url"),
    ({"detail": "low"}, "messages[1].content[1].image_url"),
    ("data:image/png;base64,AAAA", "messages[1].content[1].image_url"),
])
def test_malformed_image_urls_are_refused(image_url, param):
    err = _refusal(image_url)
    assert err.param == param and err.code == "invalid_value"


def test_a_data_url_meets_the_text_only_refusal():
    err = _refusal({"url": "data:image/png;base64,AAAA"})
    assert err.param == "messages[1].content[1].type" and err.code == "unsupported_content"


DATA = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}


def test_a_data_url_passes_on_for_a_model_that_takes_images():
    """(The tokenizer worker decodes it: tests/unit/tokenizer_worker/test_prepare_images.py.)"""
    tr = chat_to_generate(_body(DATA, DATA), "r", "x", 0.0, vision=True)
    assert tr.gen.messages[1]["content"][1:] == [DATA, DATA]


def test_images_past_the_limit_per_prompt_are_a_400_naming_the_limit():
    api = ApiSpec(limits=RequestLimits(max_images_per_prompt=1))
    with pytest.raises(ApiError) as err:
        chat_to_generate(_body(DATA, DATA), "r", "x", 0.0, api=api, vision=True)
    assert err.value.status == 400 and err.value.code == "limit_exceeded"
    assert err.value.param == "messages[1].content[2]"
    assert "at most 1 per prompt (--limit-mm-per-prompt" in err.value.message
    chat_to_generate(_body(DATA), "r", "x", 0.0, api=api, vision=True)


def test_other_parts_are_still_refused_for_a_model_that_takes_images():
    req = _body({"type": "input_audio", "input_audio": {"data": "AAAA", "format": "wav"}})
    with pytest.raises(ApiError) as err:
        chat_to_generate(req, "r", "x", 0.0, vision=True)
    assert err.value.param == "messages[1].content[1].type"
    assert "only 'text' and 'image_url'" in err.value.message
