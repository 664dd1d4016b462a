"""`candor serve --strict`: every ignored field is a 400 naming it, for every request."""

from __future__ import annotations


import aiohttp
import pytest

from tests.support.server import CandorServer

MODEL = "tiny-llama"


@pytest.fixture(scope="module")
def strict_server(tiny_model_dir):
    srv = CandorServer(tiny_model_dir, "--served-model-name", MODEL, "--max-model-len", "512",
                       "--strict").start()
    yield srv
    assert srv.stop() == 0


async def _post(server, path: str, body: dict):
    async with aiohttp.ClientSession() as session:
        async with session.post(server.base_url + path, json=body) as resp:
            return resp.status, await resp.json()


@pytest.mark.parametrize("path, extra, param", [
    ("/v1/completions", {"user": "alice"}, "user"),
    ("/v1/completions", {"suffix": "!"}, "suffix"),
    ("/v1/completions", {"frobnicate": 1}, "frobnicate"),
    ("/v1/chat/completions", {"chat_template_kwargs": {"enable_thinking": False}},
     "chat_template_kwargs"),
])
async def test_strict_server_rejects_ignored_fields(strict_server, path, extra, param):
    body = ({"prompt": "x"} if path == "/v1/completions"
            else {"messages": [{"role": "user", "content": "x"}]})
    status, out = await _post(strict_server, path, {"model": MODEL, "max_tokens": 1, **body,
                                                    **extra})
    assert status == 400 and out["error"]["param"] == param, out


async def test_strict_server_serves_clean_requests_and_publishes_it(strict_server):
    status, out = await _post(strict_server, "/v1/completions",
                              {"model": MODEL, "prompt": "x", "max_tokens": 2, "top_k": 3})
    assert status == 200 and out["candor"]["strict"] is True
    async with aiohttp.ClientSession() as session:
        async with session.get(strict_server.base_url + "/v1/capabilities") as resp:
            caps = await resp.json()
    assert caps["policy"]["strict"] is True
    assert caps["fields"]["/v1/completions"]["user"] == "rejected"
