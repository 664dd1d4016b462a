"""The official openai SDK, sync and async, streaming and not, against the real server."""

from __future__ import annotations

import openai
import pytest

MODEL = "tiny-llama"


@pytest.fixture
def client(server):
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0)


@pytest.fixture
def aclient(server):
    return openai.AsyncOpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0)


def test_models_list_and_retrieve(client):
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL]
    assert models.data[0].model_extra["max_model_len"] == 1024
    assert client.models.retrieve(MODEL).id == MODEL
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("no-such-model")


def test_sync_completion(client):
    out = client.completions.create(model=MODEL, prompt="Hello there", max_tokens=8, temperature=0)
    assert out.object == "text_completion"
    assert out.choices[0].finish_reason in ("stop", "length")
    assert out.usage.completion_tokens <= 8 and out.usage.prompt_tokens > 0
    assert out.usage.total_tokens == out.usage.prompt_tokens + out.usage.completion_tokens


def test_sync_chat_and_stream_agree(client):
    messages = [{"role": "user", "content": "Say something."}]
    full = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=12,
                                          temperature=0)
    assert full.choices[0].message.role == "assistant"
    chunks = list(client.chat.completions.create(model=MODEL, messages=messages, max_tokens=12,
                                                 temperature=0, stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks)
    assert streamed == full.choices[0].message.content
    assert chunks[-1].choices[0].finish_reason == full.choices[0].finish_reason


async def test_async_completion_stream_and_usage(aclient):
    stream = await aclient.completions.create(model=MODEL, prompt="Count:", max_tokens=10,
                                              temperature=0, stream=True,
                                              stream_options={"include_usage": True})
    chunks = [c async for c in stream]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 10
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    full = await aclient.completions.create(model=MODEL, prompt="Count:", max_tokens=10,
                                            temperature=0)
    assert text == full.choices[0].text


async def test_async_chat(aclient):
    out = await aclient.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": [{"type": "text", "text": "Hi"}]}],
        max_completion_tokens=5, temperature=0.7, top_p=0.9, seed=3)
    assert out.object == "chat.completion"
    assert out.usage.completion_tokens <= 5


def test_sdk_error_classes(client):
    with pytest.raises(openai.NotFoundError) as nf:
        client.completions.create(model="gpt-4", prompt="x", max_tokens=1)
    assert nf.value.body["param"] == "model" or nf.value.body.get("code") == "model_not_found"
    with pytest.raises(openai.BadRequestError) as bad:
        client.completions.create(model=MODEL, prompt="x", max_tokens=4000)
    assert "max_tokens" in bad.value.message
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}],
                                       temperature=3)
