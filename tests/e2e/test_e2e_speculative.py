"""Speculative decoding never changes an answer, through the real processes: one server
with ``--speculative-config`` ngram and one without answer greedy and seeded requests
with bitwise the same choices (text, token ids, logprobs, top_logprobs), alone and in a
concurrent batch, streamed, with stop strings, n > 1 and penalties; the server with it
on counts drafts in vLLM's spec_decode metrics and in the response's ``candor`` report."""

from __future__ import annotations

import asyncio
import json
import time

import aiohttp
import pytest

from tests.support.metrics_text import scrape
from tests.support.server import CandorServer

MODEL = "tiny-llama"
SPEC = json.dumps({"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1,
                   "prompt_lookup_max": 4})
# repeated phrases: the prompt-lookup drafter finds n-gram matches to propose
COPY = ("Repeat exactly: the quick brown fox jumps over the lazy dog. the quick brown fox "
        "jumps over the lazy dog. the quick brown fox jumps over the lazy dog. the quick")
PROBES: dict[str, tuple[str, dict]] = {
    "greedy": ("/v1/completions", {"prompt": COPY, "max_tokens": 200, "temperature": 0,
                                   "logprobs": 5}),
    "seeded": ("/v1/completions", {"prompt": COPY, "max_tokens": 32, "temperature": 0.9,
                                   "top_p": 0.9, "seed": 77, "logprobs": 3}),
    "penalties": ("/v1/completions", {"prompt": COPY, "max_tokens": 32, "temperature": 0,
                                      "frequency_penalty": 0.7, "presence_penalty": 0.4,
                                      "repetition_penalty": 1.2, "logprobs": 2}),
    "n3": ("/v1/completions", {"prompt": COPY, "max_tokens": 24, "temperature": 1.0,
                               "seed": 5, "n": 3, "logprobs": 2}),
    "stop": ("/v1/completions", {"prompt": COPY, "max_tokens": 32, "temperature": 0,
                                 "stop": ["fox"], "ignore_eos": False}),
    "chat": ("/v1/chat/completions", {"messages": [{"role": "user", "content": COPY}],
                                      "max_tokens": 32, "temperature": 0.7, "seed": 3,
                                      "logprobs": True, "top_logprobs": 4}),
}


async def _post(session, srv: CandorServer, name: str, stream: bool = False):
    path, body = PROBES[name]
    req = {"model": MODEL, "ignore_eos": True, "return_token_ids": True, **body}
    if stream:
        req["stream"] = True
        chunks = []
        async with session.post(srv.base_url + path, json=req) as resp:
            assert resp.status == 200, await resp.text()
            async for line in resp.content:
                line = line.strip()
                if line.startswith(b"data: ") and line != b"data: [DONE]":
                    chunk = json.loads(line[6:])
                    chunk.pop("candor", None)
                    chunk.pop("id", None)
                    chunk.pop("created", None)
                    chunks.append(chunk)
        return chunks
    async with session.post(srv.base_url + path, json=req) as resp:
        payload = await resp.json()
        assert resp.status == 200, payload
        return payload


def _choices(payload: dict) -> list:
    return payload["choices"]


@pytest.fixture(scope="module")
def servers(tiny_model_dir, tmp_path_factory):
    logs = tmp_path_factory.mktemp("spec")
    flags = ("--served-model-name", MODEL, "--max-model-len", "1024")
    off = CandorServer(tiny_model_dir, *flags).start(log_path=logs / "off")
    try:
        on = CandorServer(tiny_model_dir, *flags, "--speculative-config", SPEC).start(
            log_path=logs / "on")
    except BaseException:
        off.stop()
        raise
    try:
        yield off, on
    finally:
        assert on.stop() == 0 and off.stop() == 0


async def _all(srv: CandorServer, concurrent: bool, stream: bool = False) -> dict:
    async with aiohttp.ClientSession() as session:
        if concurrent:
            got = await asyncio.gather(*(_post(session, srv, n, stream) for n in PROBES))
            return dict(zip(PROBES, got))
        return {n: await _post(session, srv, n, stream) for n in PROBES}


async def test_on_equals_off_alone_and_batched(servers):
    off, on = servers
    want = await _all(off, concurrent=False)
    assert want["greedy"]["choices"][0]["logprobs"]["top_logprobs"]
    for concurrent in (False, True):
        got = await _all(on, concurrent)
        for name in PROBES:
            assert _choices(got[name]) == _choices(want[name]), \
                f"{name} (concurrent={concurrent}): speculation changed the answer"
    counted = [got[n]["candor"].get("speculative") for n in PROBES]  # greedy: 200 tokens
    assert any(c and c["drafted"] > 0 for c in counted), counted
    assert all(c is None or 0 <= c["accepted"] <= c["drafted"] for c in counted), counted
    assert all("speculative" not in want[n]["candor"] for n in PROBES)
    on.wait_all_blocks_free()


async def test_on_equals_off_streamed(servers):
    off, on = servers
    want = await _all(off, concurrent=False, stream=True)
    got = await _all(on, concurrent=True, stream=True)
    for name in PROBES:
        text = lambda chunks: "".join(c["choices"][0].get("text") or
                                      (c["choices"][0].get("delta") or {}).get("content") or ""
                                      for c in chunks if c["choices"])
        assert text(got[name]) == text(want[name]), f"{name} streamed: text differs"
        ids = lambda chunks: [t for c in chunks for ch in c["choices"]
                              for t in (ch.get("token_ids") or [])]
        assert ids(got[name]) == ids(want[name]), f"{name} streamed: token ids differ"
        lps = lambda chunks: [ch.get("logprobs") for c in chunks for ch in c["choices"]
                              if ch.get("logprobs")]
        flat = lambda chunks: [e for lp in lps(chunks) for e in (lp.get("content") or
                               list(zip(lp.get("tokens") or [], lp.get("token_logprobs") or [],
                                        [json.dumps(t, sort_keys=True) for t in
                                         lp.get("top_logprobs") or []])))]
        assert flat(got[name]) == flat(want[name]), f"{name} streamed: logprobs differ"


def test_metrics_count_drafts_with_vllm_names(servers):
    off, on = servers
    deadline = time.monotonic() + 30
    while True:  # the counters follow the scheduler's heartbeat
        s = scrape(on)
        drafts = s.total("vllm:spec_decode_num_drafts_total")
        if drafts > 0 or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert drafts > 0, "no drafts counted after the speculative requests (30 s)"
    tokens = s.total("vllm:spec_decode_num_draft_tokens_total")
    accepted = s.total("vllm:spec_decode_num_accepted_tokens_total")
    per_pos = s.total("vllm:spec_decode_num_accepted_tokens_per_pos_total")
    assert drafts <= tokens <= 4 * drafts and 0 <= accepted <= tokens
    assert per_pos == accepted
    if accepted:
        assert s.total("vllm:spec_decode_num_accepted_tokens_per_pos_total", position="0") > 0
    assert scrape(off).total("vllm:spec_decode_num_drafts_total") == 0
