"""Engine-side hardening through the real processes: stop strings that cannot stall the
detokenizer, /health/generate probes ahead of queued traffic (and coalesced), and prompt
logprobs that are complete and identical whether or not the prefix cache had the prompt."""

from __future__ import annotations

import asyncio
import time

import aiohttp
import pytest

from tests.support.metrics_text import scrape
from tests.support.polling import wait_until
from tests.support.server import CandorServer, free_port

MODEL = "tiny-llama"


async def _post(session, server, path: str, body: dict) -> tuple[int, dict]:
    async with session.post(server.base_url + path, json={"model": MODEL, **body}) as resp:
        return resp.status, await resp.json()


# ---------------------------------------------------------------- stop strings


@pytest.fixture(scope="module")
def many_stops_server(tiny_model_dir, tmp_path_factory):
    """A deployment whose stop-string limit is far above the default."""
    port = free_port()
    topo = tmp_path_factory.mktemp("topo") / "t.yaml"
    topo.write_text(f"""
model: {{path: {tiny_model_dir}, served_model_name: {MODEL}, max_model_len: 1024}}
http: {{port: {port}, max_body_mb: 64}}
api: {{limits: {{max_stop_strings: 200000, max_stop_string_chars: 1024}}}}
""")
    srv = CandorServer.from_topology(topo, port).start()
    yield srv
    assert srv.stop() == 0


async def _timed_small_request(session, server) -> float:
    started = time.monotonic()
    status, body = await _post(session, server, "/v1/completions", {
        "prompt": "The quick brown fox", "max_tokens": 120, "temperature": 0,
        "ignore_eos": True})
    assert status == 200, body
    assert body["usage"]["completion_tokens"] == 120
    return time.monotonic() - started


async def test_many_stop_strings_do_not_delay_another_client(many_stops_server):
    server = many_stops_server
    # 100k stop strings that never occur: before, each token cost a scan of all of them
    stops = [f"~{i:06d} never appears here" for i in range(100_000)]
    async with aiohttp.ClientSession() as session:
        baseline = min([await _timed_small_request(session, server) for _ in range(2)])
        async with session.post(server.base_url + "/v1/completions", json={
                "model": MODEL, "prompt": "Once upon a time", "max_tokens": 900,
                "temperature": 0, "ignore_eos": True, "stream": True,
                "stop": stops}) as big:
            assert big.status == 200, await big.text()
            first = await big.content.readline()  # the big request is generating now
            assert first.startswith(b"data: ")
            loaded = await _timed_small_request(session, server)
            frames = [line async for line in big.content if line.strip()]
        assert frames[-1].strip() == b"data: [DONE]"
    print(f"small request alone {baseline:.3f}s, beside 100k stop strings {loaded:.3f}s")
    assert loaded < 3 * baseline + 0.5, (baseline, loaded)


# ---------------------------------------------------------------- health probes


@pytest.fixture(scope="module")
def one_seq_server(tiny_model_dir):
    srv = CandorServer(tiny_model_dir, "--served-model-name", MODEL, "--max-model-len", "1024",
                       "--max-num-seqs", "1").start()
    yield srv
    assert srv.stop() == 0


async def test_probe_is_answered_while_queued_requests_wait(one_seq_server):
    server = one_seq_server
    async with aiohttp.ClientSession() as session:
        long = [asyncio.create_task(_post(session, server, "/v1/completions", {
            "prompt": f"long request {i}", "max_tokens": 900, "temperature": 0,
            "ignore_eos": True})) for i in range(4)]
        await asyncio.to_thread(wait_until, server.engine_stats,
                                "three requests queued behind the running one",
                                until=lambda s: s["waiting"] >= 3, timeout=30)
        async with session.get(server.base_url + "/health/generate?timeout=60") as resp:
            assert resp.status == 200, await resp.text()
            assert (await resp.json())["tokens"] == 1
        still_waiting = sum(not t.done() for t in long)
        results = await asyncio.gather(*long)
    assert all(status == 200 for status, _ in results)
    # served behind at most the request running when it arrived (or, on a slow machine,
    # the one that started while the probe was still on its way to the scheduler)
    assert still_waiting >= 2, still_waiting


async def test_concurrent_probes_share_one_engine_request(one_seq_server):
    server = one_seq_server
    server.wait_all_blocks_free()
    before = scrape(server).value("candor_queue_time_seconds_count")
    async with aiohttp.ClientSession() as session:
        async def probe() -> int:
            async with session.get(server.base_url + "/health/generate") as resp:
                return resp.status

        statuses = await asyncio.gather(*[probe() for _ in range(50)])
    assert statuses == [200] * 50
    submitted = scrape(server).value("candor_queue_time_seconds_count") - before
    assert 1 <= submitted <= 2, submitted
