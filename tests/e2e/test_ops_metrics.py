"""/metrics, /health, /health/generate and /version on the shared session server:
scrapes before and after real requests, and the deltas they must show."""

from __future__ import annotations

import asyncio
import json
import time

import aiohttp
import pytest

from tests.support.metrics_text import Scrape, scrape
from tests.support.polling import wait_until

MODEL = "tiny-llama"
C = "/v1/completions"


async def _complete(server, body: dict) -> dict | bytes:
    async with aiohttp.ClientSession() as session:
        async with session.post(server.base_url + C, json={"model": MODEL, **body}) as resp:
            payload = await resp.read()
            return json.loads(payload) if not body.get("stream") else payload


async def test_scrape_deltas_after_real_requests(server):
    server.wait_all_blocks_free()  # earlier requests' counters are in the baseline
    before = scrape(server)
    results = await asyncio.gather(*[_complete(server, {
        "prompt": f"count {i}", "max_tokens": 6, "temperature": 0, "ignore_eos": True})
        for i in range(3)])
    streamed = await _complete(server, {"prompt": "stream me", "max_tokens": 5,
                                        "ignore_eos": True, "stream": True})
    assert streamed.endswith(b"data: [DONE]\n\n")
    rejected = await _complete(server, {"prompt": "x", "max_tokens": -3})
    assert "error" in rejected
    prompt = sum(r["usage"]["prompt_tokens"] for r in results)
    exact = {  # (family, labels): the delta four served requests and one 400 make
        ("candor_http_requests_total", (("route", C), ("status", "200"),
                                        ("finish_reason", "length"))): 4,
        ("candor_http_requests_total", (("route", C), ("status", "400"))): 1,
        ("candor_generation_tokens_total", ()): 3 * 6 + 5,
        ("candor_time_to_first_token_seconds_count", ()): 4,
        ("candor_e2e_request_latency_seconds_count", ()): 4,
        ("candor_inter_token_latency_seconds_count", ()): 3 * 5 + 4,
        ("candor_queue_time_seconds_count", ()): 4,
        ("candor_tokenizer_requests_total", (("outcome", "ok"),)): 4,
        # a 400 from the frontend's own validation never reaches a tokenizer worker
        ("candor_tokenizer_requests_total", (("outcome", "rejected"),)): 0,
    }
    at_least = {
        ("candor_prompt_tokens_total", ()): prompt + 1,
        ("candor_step_duration_seconds_count", (("phase", "prefill"),)): 1,
        ("candor_step_duration_seconds_count", (("phase", "decode"),)): 5,
        ("candor_scheduler_steps_total", ()): 6,
    }

    def observe() -> tuple[Scrape, dict]:
        now = scrape(server)
        return now, {key: now.total(key[0], **dict(key[1])) - before.total(key[0], **dict(key[1]))
                     for key in [*exact, *at_least]}

    def settled(seen: tuple[Scrape, dict]) -> bool:
        now, delta = seen
        return (all(delta[k] >= v for k, v in [*exact.items(), *at_least.items()])
                and now.value("candor_kv_blocks_used") == 0
                and now.value("candor_requests_running") == 0)

    # counters only grow; the scheduler's reach the scrape with its heartbeat (0.25 s)
    after, delta = wait_until(observe, "every counter to reach its delta, nothing running",
                              until=settled)
    assert {k: delta[k] for k in exact} == exact
    assert all(delta[k] >= v for k, v in at_least.items()), (delta, at_least)
    assert after.value("candor_kv_blocks_total") > 0
    assert after.value("candor_process_up", node="local", role="gpu_worker", index="0") == 1


STEP_PHASES = ("sched_intake", "sched_plan", "sched_postprocess", "sched_ipc",
               "worker_prepare", "worker_forward", "worker_sample", "worker_send")


async def test_step_loop_phases_are_exported_and_add_up_to_the_workers_busy_time(server):
    server.wait_all_blocks_free()
    before = scrape(server)

    def grew(s: Scrape) -> bool:
        return all(s.total("candor_step_phase_seconds_total", phase=p)
                   > before.total("candor_step_phase_seconds_total", phase=p)
                   for p in STEP_PHASES)

    await _complete(server, {"prompt": "where the time goes", "max_tokens": 8,
                             "ignore_eos": True})
    wait_until(lambda: scrape(server), "every step-loop phase counted", until=grew)
    stats = server.wait_all_blocks_free()
    phases = stats["step_phases_s"]
    assert set(STEP_PHASES) | {"worker_grammar"} <= set(phases)
    # prepare, forward, sample and grammar split each step the worker timed, exactly
    worker = sum(phases[f"worker_{p}"] for p in ("prepare", "forward", "sample", "grammar"))
    assert worker == pytest.approx(stats["worker_busy_s"], abs=1e-6)


async def test_every_metric_is_prefixed_documented_and_unit_named(server):
    await _complete(server, {"prompt": "hello", "max_tokens": 2})
    now = scrape(server)
    ours = {name: f for name, f in now.families.items() if name.startswith("candor_")}
    assert len(ours) >= 25, sorted(ours)
    # besides ours: vLLM's names (tests/e2e/test_metrics_compat.py) and process_* per role
    others = {n for n in now.families if not n.startswith(("candor_", "vllm:", "process_"))}
    assert not others, others
    for name, family in ours.items():
        assert len(family.documentation) > 20, name
        if family.type == "counter":
            assert any(s.name.endswith("_total") for s in family.samples), name
        if family.type == "histogram":
            assert name.endswith(("_seconds", "_tokens")), name


async def test_disconnect_is_counted_as_an_abort(server):
    server.wait_all_blocks_free()  # earlier requests' aborts are in the baseline
    before = scrape(server)
    async with aiohttp.ClientSession() as session:
        async with session.post(server.base_url + C, json={
                "model": MODEL, "prompt": "go on", "max_tokens": 500, "ignore_eos": True,
                "stream": True}) as resp:
            async for _ in resp.content:
                break
    after = wait_until(lambda: scrape(server), "a disconnect abort and a 499 counted",
                       until=lambda s: (
                           s.total("candor_aborts_total", cause="disconnect")
                           > before.total("candor_aborts_total", cause="disconnect")
                           and s.total("candor_http_requests_total", route=C, status="499")
                           > before.total("candor_http_requests_total", route=C,
                                          status="499")))
    assert (after.total("candor_aborts_total", cause="disconnect")
            - before.total("candor_aborts_total", cause="disconnect")) == 1
    assert (after.total("candor_http_requests_total", route=C, status="499")
            - before.total("candor_http_requests_total", route=C, status="499")) == 1
    server.wait_all_blocks_free()


def test_health_names_every_process_and_version(server):
    status, body = server.health()
    assert status == 200 and body["status"] == "ok"
    assert sorted(body["nodes"]["local"]) == sorted([
        "gpu_worker[0]", "scheduler[0]", "detokenizer[0]", "tokenizer_worker[0]",
        "api_frontend[0]"])
    status, payload = server.get("/version")
    assert status == 200 and json.loads(payload)["version"]


async def test_health_generate_is_served_ahead_of_queued_traffic(server):
    # a burst of long requests fills the queue; the probe must not wait for them
    async def long_one():
        return await _complete(server, {"prompt": "busy", "max_tokens": 300,
                                        "ignore_eos": True})

    server.wait_all_blocks_free()
    burst = [asyncio.create_task(long_one()) for _ in range(6)]
    await asyncio.to_thread(wait_until, server.engine_stats, "the burst admitted",
                            until=lambda s: s["running"] + s["waiting"] >= 6)
    started = time.monotonic()
    status, payload = await asyncio.to_thread(server.get, "/health/generate")
    probe_s = time.monotonic() - started
    done_early = sum(t.done() for t in burst)
    results = await asyncio.gather(*burst)
    assert status == 200, payload
    assert json.loads(payload)["tokens"] == 1
    assert all(r["usage"]["completion_tokens"] == 300 for r in results)
    assert done_early == 0, f"the probe ({probe_s:.2f}s) waited for the burst to finish"
    status, payload = server.get("/health/generate?timeout=abc")
    assert status == 400
