"""Determinism by default, through the real processes: a greedy or seeded request returns
bitwise identical tokens and logprobs (top_logprobs and prompt logprobs included) alone or
inside random concurrent batches, on a prefix-cache hit or miss, under another
``--max-num-batched-tokens``, preempted under a tiny KV cache or not, on either of two
data-parallel replicas, and after a restart. Responses are compared as parsed JSON, whose
floats round-trip exactly: equality, never a tolerance."""

from __future__ import annotations

import asyncio
import random

import aiohttp
import pytest

from tests.support.metrics_text import scrape
from tests.support.server import CandorServer

MODEL = "tiny-llama"
WORDS = ("the quick brown fox jumps over a lazy dog while seven wizards quietly "
         "judge boxing matches near the old harbour at dawn").split()


def _text(rng: random.Random, words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(words))


_rng = random.Random(2026)
# Long enough for several full KV blocks (prefix-cache hits) and several 64-token chunks.
PROBES: dict[str, tuple[str, dict]] = {
    "greedy": ("/v1/completions", {"prompt": _text(_rng, 60), "max_tokens": 24, "temperature": 0,
                                   "logprobs": 5}),
    "seeded": ("/v1/completions", {"prompt": _text(_rng, 70), "max_tokens": 24, "temperature": 1.0,
                                   "top_p": 0.9, "seed": 4242, "logprobs": 5}),
    "echo": ("/v1/completions", {"prompt": _text(_rng, 50), "max_tokens": 6, "temperature": 0,
                                 "echo": True, "logprobs": 3, "prompt_logprobs": 2}),
    "chat": ("/v1/chat/completions", {"messages": [{"role": "user", "content": _text(_rng, 55)}],
                                      "max_tokens": 20, "temperature": 0.8, "seed": 9,
                                      "logprobs": True, "top_logprobs": 5}),
}


async def _post(session: aiohttp.ClientSession, srv: CandorServer, path: str, body: dict) -> dict:
    async with session.post(srv.base_url + path, json={"model": MODEL, "ignore_eos": True, **body}) as resp:
        payload = await resp.json()
        assert resp.status == 200, payload
        return payload


async def _probe(session, srv, name: str, delay: float = 0.0) -> dict:
    """What must not change: the choice (text, token ids, logprobs, prompt logprobs)."""
    await asyncio.sleep(delay)
    path, body = PROBES[name]
    payload = await _post(session, srv, path, {**body, "return_token_ids": True})
    assert payload["candor"].get("deterministic") is True, payload["candor"]
    choice = payload["choices"][0]
    return {"choice": choice, "cached": (payload["usage"].get("prompt_tokens_details") or {}).get("cached_tokens", 0)}


def _noise(rng: random.Random, count: int, long: bool = False) -> list[tuple[str, dict, float]]:
    """Random traffic: short and long prompts, greedy, seeded and unseeded sampling, some
    with logprobs or several choices, arriving over a few hundred ms."""
    out = []
    for _ in range(count):
        body = {"prompt": _text(rng, rng.randint(60, 140) if long else rng.randint(1, 120)),
                "max_tokens": rng.randint(30, 60) if long else rng.randint(1, 40),
                "temperature": rng.choice([0, 0.7, 1.0])}
        if rng.random() < 0.3:
            body["seed"] = rng.randrange(1000)
        if rng.random() < 0.3:
            body["logprobs"] = rng.randint(0, 8)
        if rng.random() < 0.1:
            body["n"] = 2
        out.append(("/v1/completions", body, rng.uniform(0, 0.4)))
    return out


async def _batch(srv, rng: random.Random, count: int, long: bool = False) -> dict[str, dict]:
    """Every probe, once, inside ``count`` random concurrent requests."""
    async with aiohttp.ClientSession() as session:
        async def noise(path, body, delay):
            await asyncio.sleep(delay)
            await _post(session, srv, path, body)
        probes = {name: asyncio.ensure_future(_probe(session, srv, name, rng.uniform(0, 0.3)))
                  for name in PROBES}
        await asyncio.gather(*(noise(*n) for n in _noise(rng, count, long)), *probes.values())
        return {name: task.result() for name, task in probes.items()}


async def _alone(srv) -> dict[str, dict]:
    async with aiohttp.ClientSession() as session:
        return {name: await _probe(session, srv, name) for name in PROBES}


def _assert_same(got: dict[str, dict], want: dict[str, dict], where: str) -> None:
    for name in PROBES:
        assert got[name]["choice"] == want[name]["choice"], f"{name} {where}: choice differs"


@pytest.fixture(scope="module")
async def baseline(server) -> dict[str, dict]:
    """Each probe alone on the shared default server (first time: a prefix-cache miss)."""
    return await _alone(server)


async def test_alone_and_in_random_batches_bitwise(server, baseline):
    assert baseline["echo"]["choice"]["prompt_logprobs"] and baseline["greedy"]["choice"]["logprobs"]["top_logprobs"]
    again = await _alone(server)  # the prompts' full blocks are cached now
    assert again["greedy"]["cached"] > 0 and again["chat"]["cached"] > 0
    _assert_same(again, baseline, "alone on a prefix-cache hit")
    rng = random.Random(7)
    for trial, count in enumerate((14, 27, 40)):
        _assert_same(await _batch(server, rng, count), baseline, f"in a batch of {count} (trial {trial})")
    server.wait_all_blocks_free()


async def test_capabilities_say_which_mode_answers(server):
    async with aiohttp.ClientSession() as session:
        async with session.get(server.base_url + "/v1/capabilities") as resp:
            caps = await resp.json()
        async with session.post(server.base_url + "/v1/responses", json={
                "model": MODEL, "input": "hi", "max_output_tokens": 4, "temperature": 0}) as resp:
            body = await resp.json()
            assert resp.status == 200, body
    assert body["candor"]["deterministic"] is True
    assert caps["deterministic"]["enabled"] is True
    assert caps["deterministic"]["note"].startswith("on")
    assert "bitwise" in caps["deterministic"]["scope"]


async def test_other_step_budget_preemption_and_restart(tiny_model_dir, baseline, tmp_path):
    """64-token steps (other prefill chunks) and 40 KV blocks (640 tokens: long concurrent
    requests preempt each other); then the same server again after a restart."""
    flags = ("--served-model-name", MODEL, "--max-model-len", "1024", "--max-num-batched-tokens", "64",
             "--num-kv-blocks", "40")
    srv = CandorServer(tiny_model_dir, *flags).start(log_path=tmp_path / "log")
    try:
        _assert_same(await _alone(srv), baseline, "under 64-token steps")
        rng = random.Random(11)
        _assert_same(await _batch(srv, rng, 16, long=True), baseline, "under preemption")
        stats = srv.wait_all_blocks_free()
        assert stats["preemptions"] > 0, "the tiny KV cache never preempted: the test proves nothing"
    finally:
        assert srv.stop() == 0
    srv = CandorServer(tiny_model_dir, *flags).start(log_path=tmp_path / "log2")
    try:
        _assert_same(await _alone(srv), baseline, "after a restart")
    finally:
        assert srv.stop() == 0


async def test_every_data_parallel_replica(tiny_model_dir, baseline, tmp_path):
    srv = CandorServer(tiny_model_dir, "--served-model-name", MODEL, "--max-model-len", "1024",
                       "--data-parallel-size", "2", "--data-parallel-routing", "round_robin"
                       ).start(log_path=tmp_path / "log")
    try:
        for _ in range(2):  # round robin: each probe lands on each replica once
            _assert_same(await _alone(srv), baseline, "on a data-parallel replica")
        _assert_same(await _batch(srv, random.Random(3), 20), baseline, "in a batch over two replicas")
        routed = scrape(srv)
        assert all(routed.total("candor_router_requests_total", replica=r) > 0 for r in ("0", "1"))
        srv.wait_all_blocks_free()
    finally:
        assert srv.stop() == 0
