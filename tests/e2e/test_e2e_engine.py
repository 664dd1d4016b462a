"""Engine behaviour through the real five-process server: prefix-cache hits, preemption
under a tiny KV cache, and backpressure (503 + Retry-After). Greedy tokens must equal HF
transformers whether a request hit the cache, was preempted, or neither."""

from __future__ import annotations

import asyncio
import time

import aiohttp
import pytest
import torch

from tests.support.server import CandorServer

MODEL = "tiny-llama"
_TEXT = ("Prefix caching shares the KV blocks of a common prompt head between requests, "
         "so only the new tail is computed. ")


def _hf_greedy(model, ids: list[int], n: int) -> list[int]:
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                             max_new_tokens=n, do_sample=False)
    return out[0, len(ids):].tolist()


async def _complete(session, server, body: dict) -> tuple[int, dict, dict]:
    async with session.post(server.base_url + "/v1/completions",
                            json={"model": MODEL, "temperature": 0, **body}) as resp:
        return resp.status, dict(resp.headers), await resp.json()


@pytest.fixture(scope="module")
def tight_server(tiny_model_dir):
    """12 KV blocks of 16 tokens, 4 running, 4 waiting at most."""
    srv = CandorServer(tiny_model_dir, "--served-model-name", MODEL, "--max-model-len", "1024",
                       "--num-kv-blocks", "12", "--max-num-seqs", "4",
                       "--max-waiting-requests", "4", "--max-num-batched-tokens", "64").start()
    yield srv
    assert srv.stop() == 0


async def test_prefix_cache_hit_reports_cached_tokens_and_matches_hf(server, hf_model):
    model, tok = hf_model
    hits_before = server.wait_all_blocks_free()["prefix_hit_blocks"]
    head = _TEXT * 4
    first, second = head + "First tail.", head + "A different second tail."
    async with aiohttp.ClientSession() as session:
        s1, _, r1 = await _complete(session, server, {"prompt": first, "max_tokens": 12,
                                                      "return_token_ids": True})
        s2, _, r2 = await _complete(session, server, {"prompt": second, "max_tokens": 12,
                                                      "return_token_ids": True})
        s3, _, r3 = await _complete(session, server, {"prompt": second, "max_tokens": 12,
                                                      "return_token_ids": True,
                                                      "cache_salt": "other-tenant"})
    assert s1 == s2 == s3 == 200
    ids2 = tok(second)["input_ids"]
    common = next(i for i, (a, b) in enumerate(zip(tok(first)["input_ids"], ids2)) if a != b)
    cached = r2["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert cached > 0 and cached % 16 == 0 and cached <= common   # whole blocks of the head
    assert r3["usage"]["prompt_tokens_details"]["cached_tokens"] == 0  # other salt: no sharing
    assert "cache_salt" in r3["candor"]["extensions"]  # the client can tell it was used
    for prompt, r in [(first, r1), (second, r2), (second, r3)]:
        ids = tok(prompt)["input_ids"]
        assert r["choices"][0]["token_ids"] == _hf_greedy(model, ids, 12)
    server.wait_all_blocks_free(
        what=f"at least {cached // 16} prefix-cache block hits",
        until=lambda s: s["prefix_hit_blocks"] - hits_before >= cached // 16)


async def test_burst_sharing_a_prefix_being_computed_keeps_hf_tokens(server, hf_model):
    """Eight requests with one long new head arrive together: those admitted while the
    head's blocks are still being filled share them (in the same step or from the step in
    flight) instead of computing them, and every greedy continuation still equals HF's."""
    model, tok = hf_model
    server.wait_all_blocks_free()
    head = "A burst shares this freshly written head. " + _TEXT * 3
    prompts = [head + f"Tail number {i}." for i in range(8)]
    async with aiohttp.ClientSession() as session:
        results = await asyncio.gather(*[
            _complete(session, server, {"prompt": p, "max_tokens": 8, "ignore_eos": True,
                                        "return_token_ids": True}) for p in prompts])
    cached = []
    for prompt, (status, _, body) in zip(prompts, results):
        assert status == 200, body
        assert body["choices"][0]["token_ids"] == _hf_greedy(model, tok(prompt)["input_ids"], 8)
        cached.append(body["usage"]["prompt_tokens_details"]["cached_tokens"])
    assert sorted(cached)[1] > 0, cached  # all but the one that computed the head
    server.wait_all_blocks_free()


async def test_preempted_requests_keep_greedy_tokens_identical_to_hf(tight_server, hf_model):
    model, tok = hf_model
    preempted_before = tight_server.wait_all_blocks_free()["preemptions"]
    prompts = [f"Request {i}: " + _TEXT[: 60 + 25 * i] for i in range(4)]
    async with aiohttp.ClientSession() as session:
        results = await asyncio.gather(*[
            _complete(session, tight_server, {"prompt": p, "max_tokens": 40, "ignore_eos": True,
                                              "return_token_ids": True}) for p in prompts])
    for prompt, (status, _, body) in zip(prompts, results):
        assert status == 200, body
        ids = tok(prompt)["input_ids"]
        got = body["choices"][0]["token_ids"]
        assert len(got) == 40
        assert got == _hf_greedy(model, ids, 40)[:len(got)], prompt
    tight_server.wait_all_blocks_free(
        what="a preemption (the KV cache was meant to be too small for all four)",
        until=lambda s: s["preemptions"] > preempted_before)


async def test_penalized_requests_keep_hf_tokens_through_cache_hits_and_preemption(
        tight_server, hf_model):
    """Penalties read the whole history: a request that took a prefix-cache hit, was
    preempted and recomputed (from its own cached blocks) still gets HF's penalized
    greedy tokens."""
    from tests.e2e.test_e2e_sampling import _hf_penalized_greedy

    model, tok = hf_model
    before = tight_server.wait_all_blocks_free()
    prompts = [_TEXT + f" Request {i} shares this head." for i in range(4)]
    penalties = {"presence_penalty": 1.0, "frequency_penalty": 0.5, "repetition_penalty": 1.3}
    async with aiohttp.ClientSession() as session:
        status, _, body = await _complete(session, tight_server, {  # caches the head
            "prompt": _TEXT, "max_tokens": 1})
        assert status == 200, body
        results = await asyncio.gather(*[
            _complete(session, tight_server, {"prompt": p, "max_tokens": 40, "ignore_eos": True,
                                              "return_token_ids": True, **penalties})
            for p in prompts])
    for prompt, (status, _, body) in zip(prompts, results):
        assert status == 200, body
        assert body["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
        want = _hf_penalized_greedy(model, tok(prompt)["input_ids"], 40, 1.0, 0.5, 1.3)
        assert body["choices"][0]["token_ids"] == want, prompt
    tight_server.wait_all_blocks_free(
        what="a preemption (the KV cache was meant to be too small for all four)",
        until=lambda s: s["preemptions"] > before["preemptions"])


async def test_full_waiting_queue_answers_503_with_retry_after(tight_server):
    async def one(session, i):
        return await _complete(session, tight_server, {"prompt": f"Load {i} " + _TEXT,
                                                       "max_tokens": 24, "ignore_eos": True})

    async with aiohttp.ClientSession() as session:
        results = await asyncio.gather(*[one(session, i) for i in range(24)])
    rejected = [(h, b) for s, h, b in results if s == 503]
    served = [b for s, _, b in results if s == 200]
    assert len(rejected) + len(served) == 24
    # the frontend counts its unanswered submissions as waiting (conservative), so at
    # least the bound is admitted and the overflow is shed
    assert rejected and len(served) >= 4
    for headers, body in rejected:
        assert headers["Retry-After"] == "1"
        assert set(body["error"]) == {"message", "type", "param", "code"}
        assert body["error"]["code"] == "queue_full"
        assert body["error"]["type"] == "service_unavailable_error"
    assert all(b["usage"]["completion_tokens"] == 24 for b in served)
    tight_server.wait_all_blocks_free()


async def test_worker_idle_time_counts_only_gaps_with_work_queued(tight_server):
    """``worker_idle_s`` sums the worker's gaps between sending a result and receiving the
    next plan, counting a gap only when work was queued during it (a stalled pipeline, not
    an idle server); ``worker_busy_s`` sums the time inside steps."""
    rest = tight_server.wait_all_blocks_free()
    assert rest["max_waiting"] == 4
    # A deliberate quiet spell: the worker's last result came before this heartbeat and its
    # next plan comes after the request below, so its gap is longer than ``quiet_s``.
    await asyncio.sleep(max(0.0, 0.5 - (time.time() - rest["time"])))
    quiet_s = time.time() - rest["time"]
    async with aiohttp.ClientSession() as session:
        status, _, body = await _complete(session, tight_server, {
            "prompt": "one step", "max_tokens": 1})
        assert status == 200, body
        one = tight_server.wait_all_blocks_free(
            what="the one-step request's busy time",
            until=lambda s: s["worker_busy_s"] > rest["worker_busy_s"])
        # the quiet gap is not counted (a lookahead step's few-ms gap behind it may be)
        assert one["worker_idle_s"] - rest["worker_idle_s"] < quiet_s, (quiet_s, rest, one)
        status, _, body = await _complete(session, tight_server, {
            "prompt": "several steps", "max_tokens": 8, "ignore_eos": True})
        assert status == 200, body
    several = tight_server.wait_all_blocks_free(
        what="the eight-step request's busy time",
        until=lambda s: s["worker_busy_s"] > one["worker_busy_s"])
    # after each of its first seven results the request was still running: those gaps count
    assert several["worker_idle_s"] > one["worker_idle_s"], (one, several)
