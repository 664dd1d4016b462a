"""Other architectures through all five processes: greedy tokens equal HF transformers'.

Every architecture of ``tests/support/model_zoo.py`` is served once: three prompts (the longest
near the advertised context, far past any sliding window) and one chat turn, each
compared token for token with HF ``generate``. ``test_model_registry.py`` checks the
same switches one by one at the runner level.
"""

from __future__ import annotations

import asyncio
import json

import aiohttp
import pytest
import torch

from tests.support import model_zoo
from tests.support.polling import wait_until
from tests.support.server import CandorServer

MAX_NEW = 20


def _prompts(n_long: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(11)
    return [[0] + torch.randint(6, model_zoo.VOCAB, (n - 1,), generator=g).tolist()
            for n in (5, 30, n_long)]


async def _complete(session, url: str, body: dict) -> tuple[int, dict]:
    async with session.post(url, json=body) as resp:
        return resp.status, json.loads(await resp.text())


def _served(tmp_path_factory, tiny_model_dir, arch: str):
    path = model_zoo.build(arch, tmp_path_factory.mktemp(arch) / "model", tiny_model_dir)
    srv = CandorServer(path, "--served-model-name", arch).start()
    return path, srv


@pytest.fixture(scope="module", params=sorted(model_zoo.ARCHS))
def arch_server(request, tmp_path_factory, tiny_model_dir):
    path, srv = _served(tmp_path_factory, tiny_model_dir, request.param)
    try:
        yield request.param, path, srv
    finally:
        assert srv.stop() == 0


async def test_greedy_matches_hf_past_the_window(arch_server):
    """Prompts shorter and longer than the 24-token window, the longest plus its output
    near the advertised context; then one chat turn."""
    arch, path, srv = arch_server
    status, body = srv.get("/v1/models")
    advertised = json.loads(body)["data"][0]["max_model_len"]
    config = json.loads((path / "config.json").read_text())
    assert advertised == config["max_position_embeddings"]  # the context, not the window
    # longrope: past the original context HF's generate re-encodes the whole sequence with
    # the long factors, which a paged cache cannot (Candor switches factors from that
    # position on, as vLLM does), so token parity is checked inside the original context
    longest = config.get("original_max_position_embeddings") or advertised
    prompts = _prompts(n_long=longest - MAX_NEW - 1)
    hf = model_zoo.hf_model(path)
    async with aiohttp.ClientSession() as session:
        results = await asyncio.gather(*[
            _complete(session, srv.base_url + "/v1/completions",
                      {"model": arch, "prompt": p, "max_tokens": MAX_NEW, "temperature": 0,
                       "return_token_ids": True}) for p in prompts])
        for p, (status, result) in zip(prompts, results):
            assert status == 200, result
            assert result["choices"][0]["token_ids"] == model_zoo.hf_greedy(hf, p, MAX_NEW), len(p)
        messages = [{"role": "user", "content": "Name three colours, then count to five."}]
        status, result = await _complete(session, srv.base_url + "/v1/chat/completions",
                                         {"model": arch, "messages": messages, "max_tokens": MAX_NEW,
                                          "temperature": 0, "return_token_ids": True})
    assert status == 200, result
    ids = result["prompt_token_ids"]
    assert result["choices"][0]["token_ids"] == model_zoo.hf_greedy(hf, ids, MAX_NEW)
    srv.wait_all_blocks_free()


def test_unsupported_config_is_refused_before_any_process_starts(tmp_path, tiny_model_dir):
    """One line naming the field and value, exit non-zero, and no role ever started
    (a started role would log its own start-up lines)."""
    import shutil
    import subprocess

    model = tmp_path / "model"
    shutil.copytree(tiny_model_dir, model)
    cfg = json.loads((model / "config.json").read_text())
    cfg["hidden_act"] = "relu2"
    (model / "config.json").write_text(json.dumps(cfg))
    srv = CandorServer(model)
    proc = subprocess.run(srv.cmd, env=srv.env, capture_output=True, text=True, timeout=60)
    assert proc.returncode != 0
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert "hidden_act='relu2'" in lines[0] and "not supported" in lines[0]


def test_version_names_the_resolved_device_and_dtype(server):
    """--dtype auto (the default) on CPU computes in float32, and /version says so."""
    version = wait_until(lambda: json.loads(server.get("/version")[1]),
                         "/version to name the worker's dtype",
                         until=lambda v: v.get("dtype"), interval=0.1)
    assert version["device"] == "cpu" and version["dtype"] == "float32", version
