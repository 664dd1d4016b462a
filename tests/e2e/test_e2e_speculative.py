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
SCHEMA = {"type": "object", "properties": {
    "ok": {"type": "boolean"}, "n": {"type": "integer", "minimum": 0, "maximum": 99},
    "tag": {"enum": ["red", "green", "blue"]}},
    "required": ["ok", "n", "tag"], "additionalProperties": False}
WEATHER = {"type": "object", "properties": {
    "city": {"type": "string", "enum": ["Paris", "Rome"]},
    "days": {"type": "integer", "minimum": 1, "maximum": 9}},
    "required": ["city", "days"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "parameters": {
             "type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}},
             "required": ["zone"], "additionalProperties": False}}}]
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
    # constrained: drafts checked against the grammar, its forced tokens drafted for free
    "json_schema": ("/v1/chat/completions", {
        "messages": [{"role": "user", "content": COPY}], "max_tokens": 64, "temperature": 0,
        "ignore_eos": False, "logprobs": True, "top_logprobs": 2,
        "response_format": {"type": "json_schema", "json_schema": {"name": "e",
                                                                   "schema": SCHEMA}}}),
    "tools_required": ("/v1/chat/completions", {
        "messages": [{"role": "user", "content": COPY}], "max_tokens": 96, "temperature": 0.8,
        "seed": 12, "ignore_eos": False, "logprobs": True, "top_logprobs": 2,
        "tools": TOOLS, "tool_choice": "required"}),
}
CONSTRAINED = ("json_schema", "tools_required")


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
    """The choices, tool call ids aside (random per response)."""
    for choice in payload["choices"]:
        for call in (choice.get("message") or {}).get("tool_calls") or []:
            call.pop("id", None)
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
    for name in CONSTRAINED:  # forced tokens, drafted and kept
        spec = got[name]["candor"].get("speculative")
        assert spec and spec["accepted"] > 0, (name, got[name]["candor"])
    args = json.loads(want["json_schema"]["choices"][0]["message"]["content"])
    assert set(args) == {"ok", "n", "tag"}, args
    assert want["tools_required"]["choices"][0]["message"]["tool_calls"], want["tools_required"]
    assert all(c is None or 0 <= c["accepted"] <= c["drafted"] for c in counted), counted
    assert all("speculative" not in want[n]["candor"] for n in PROBES)
    on.wait_all_blocks_free()


def _per_choice(chunks: list[dict]) -> dict[int, dict]:
    """A stream's choices, each one's text, token ids and logprobs in order (the
    choices of n > 1 interleave however their tokens came)."""
    out: dict[int, dict] = {}
    for chunk in chunks:
        for ch in chunk["choices"]:
            got = out.setdefault(ch["index"], {"text": "", "ids": [], "logprobs": []})
            got["text"] += ch.get("text") or (ch.get("delta") or {}).get("content") or ""
            got["ids"] += ch.get("token_ids") or []
            if ch.get("logprobs"):
                got["logprobs"].append(ch["logprobs"])
            if ch.get("finish_reason"):
                got["finish_reason"] = ch["finish_reason"]
    for got in out.values():  # completions' logprobs split by chunk: flatten them
        lps = got.pop("logprobs")
        got["logprobs"] = [e for lp in lps for e in (lp.get("content") or list(zip(
            lp.get("tokens") or [], lp.get("token_logprobs") or [],
            [json.dumps(t, sort_keys=True) for t in lp.get("top_logprobs") or []])))]
    return out


async def test_on_equals_off_streamed(servers):
    off, on = servers
    want = await _all(off, concurrent=False, stream=True)
    got = await _all(on, concurrent=True, stream=True)
    assert _per_choice(want["greedy"])[0]["logprobs"]
    for name in PROBES:
        assert _per_choice(got[name]) == _per_choice(want[name]), f"{name} streamed: differs"


async def _frames(session, srv: CandorServer, path: str, body: dict) -> list[dict]:
    """Every decoded SSE frame of one streamed request, in order."""
    frames = []
    async with session.post(srv.base_url + path, json={"model": MODEL, **body,
                                                        "stream": True}) as resp:
        assert resp.status == 200, await resp.text()
        async for line in resp.content:
            line = line.strip()
            if line.startswith(b"data: ") and line != b"data: [DONE]":
                frames.append(json.loads(line[6:]))
    return frames


def _counts_frame(frames: list[dict]) -> dict:
    """The one frame after the first that carries a ``candor`` field: it must be the
    stream's last, and hold the speculative counts only."""
    later = [i for i, f in enumerate(frames) if "candor" in f and i > 0]
    assert later == [len(frames) - 1], f"candor on frames {later} of {len(frames)}"
    last = frames[-1]["candor"]
    assert set(last) == {"speculative"}, last
    return last["speculative"]


async def test_streamed_responses_carry_the_counts_on_their_last_frame(servers):
    """As a whole body does: the usage chunk with include_usage, else the chunk that
    finishes the last choice (n > 1: whichever choice finishes last)."""
    off, on = servers
    # (the tiny model drafts only late in a long answer: 200 tokens)
    copy = {"prompt": COPY, "max_tokens": 200, "temperature": 0, "ignore_eos": True}
    chat = {"messages": [{"role": "user", "content": COPY}], "max_tokens": 200,
            "temperature": 0.5, "seed": 1, "n": 2, "ignore_eos": True}
    async with aiohttp.ClientSession() as session:
        plain = await _frames(session, on, "/v1/completions", copy)
        usage = await _frames(session, on, "/v1/completions",
                              {**copy, "stream_options": {"include_usage": True}})
        several = await _frames(session, on, "/v1/chat/completions", chat)
        unspeculated = await _frames(session, off, "/v1/completions", copy)
    for frames in (plain, usage, several):
        counts = _counts_frame(frames)
        assert 0 <= counts["accepted"] <= counts["drafted"] and counts["drafted"] > 0, counts
        assert counts["exact"] is True, counts
        assert frames[0]["candor"]["deterministic"] is True
    assert plain[-1]["choices"][0]["finish_reason"] == "length"
    assert usage[-1]["choices"] == [] and usage[-1]["usage"]["completion_tokens"] == 200
    assert [c["finish_reason"] for c in several[-1]["choices"]] == ["length"]
    assert all("candor" not in f for f in unspeculated[1:])  # nothing drafted: nothing said


async def test_a_stop_string_that_ends_a_speculating_request_keeps_its_counts(servers):
    """A stop string ends the request in the detokenizer, not the engine: the counts so
    far still reach the response (whole and streamed), and the answer is off's."""
    off, on = servers
    body = {"model": MODEL, "prompt": COPY, "max_tokens": 200, "temperature": 0,
            "ignore_eos": True}
    async with aiohttp.ClientSession() as session:
        async with session.post(on.base_url + "/v1/completions", json=body) as resp:
            text = (await resp.json())["choices"][0]["text"]
        # a stop string that first occurs late, after the tiny model began to draft
        stop = next(text[i:i + 8] for i in range(len(text) - 30, 0, -1)
                    if text.find(text[i:i + 8]) == i and text[i:i + 8].strip())
        body["stop"] = [stop]
        got = {}
        for name, srv in (("off", off), ("on", on)):
            async with session.post(srv.base_url + "/v1/completions", json=body) as resp:
                got[name] = await resp.json()
        frames = await _frames(session, on, "/v1/completions",
                               {k: v for k, v in body.items() if k != "model"})
    assert got["on"]["choices"] == got["off"]["choices"]
    assert got["on"]["choices"][0]["finish_reason"] == "stop", got["on"]["choices"]
    assert got["on"]["candor"]["speculative"]["drafted"] > 0, got["on"]["candor"]
    assert _counts_frame(frames) == got["on"]["candor"]["speculative"]


@pytest.fixture(scope="module")
def loose(tiny_model_dir, tmp_path_factory):
    """Speculation with the deterministic mode off: drafts may change answers."""
    srv = CandorServer(tiny_model_dir, "--served-model-name", MODEL, "--max-model-len", "1024",
                       "--no-deterministic", "--speculative-config", SPEC).start(
        log_path=tmp_path_factory.mktemp("spec-loose") / "log")
    try:
        yield srv
    finally:
        assert srv.stop() == 0


async def test_without_batch_invariant_kernels_each_response_says_drafts_may_change_it(loose):
    """Candor cannot promise on == off there (an M = 1 + k verify row may round unlike
    an M = 1 decode row): the report says so on every response that drafted, whole or
    streamed, and /v1/capabilities names the mode."""
    copy = {"model": MODEL, "prompt": COPY, "max_tokens": 200, "temperature": 0,
            "ignore_eos": True}
    async with aiohttp.ClientSession() as session:
        async with session.post(loose.base_url + "/v1/completions", json=copy) as resp:
            whole = await resp.json()
            assert resp.status == 200, whole
        frames = await _frames(session, loose, "/v1/completions", copy)
    assert whole["candor"]["deterministic"] is False
    assert whole["candor"]["speculative"]["exact"] is False, whole["candor"]
    assert whole["candor"]["speculative"]["drafted"] > 0
    assert _counts_frame(frames)["exact"] is False
    status, caps = loose.get("/v1/capabilities")
    assert status == 200 and json.loads(caps)["deterministic"]["enabled"] is False


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


PARAGRAPH = ("The library opens at nine in the morning and closes at six in the evening. "
             "Visitors may borrow up to five books at a time, and each loan lasts three weeks. "
             "Books returned late are charged ten cents a day.")
COPY_CHAT = {"messages": [{"role": "user", "content": "Repeat this paragraph verbatim, "
                           f"word for word:\n\n{PARAGRAPH}"}],
             "max_tokens": 64, "temperature": 0, "logprobs": True, "top_logprobs": 3}


@pytest.fixture(scope="module")
def smollm2_pair(tmp_path_factory):
    from launcher.default_model import SERVED_NAME, default_gguf

    logs = tmp_path_factory.mktemp("spec-smollm2")
    common = ("--served-model-name", SERVED_NAME, "--max-model-len", "2048",
              "--kv-cache-memory", "512MiB")
    env = {"CANDOR_GGUF_CACHE": str(logs / "cache")}
    off = CandorServer(default_gguf(), *common, env=env).start(timeout=300, log_path=logs / "off")
    try:
        on = CandorServer(default_gguf(), *common, "--speculative-config", SPEC,
                          env=env).start(timeout=300, log_path=logs / "on")
    except BaseException:
        off.stop()
        raise
    try:
        yield SERVED_NAME, off, on
    finally:
        assert on.stop() == 0 and off.stop() == 0


async def _copy(session, srv: CandorServer, model: str, seed: int | None = None) -> dict:
    body = {"model": model, **COPY_CHAT}
    if seed is not None:
        body.update(temperature=0.8, seed=seed)
    async with session.post(srv.base_url + "/v1/chat/completions", json=body) as resp:
        payload = await resp.json()
        assert resp.status == 200, payload
        return payload


async def test_real_model_copy_accepts_drafts_and_equals_off(smollm2_pair):
    model, off, on = smollm2_pair
    async with aiohttp.ClientSession() as session:
        want = [await _copy(session, off, model), await _copy(session, off, model, seed=11)]
        alone = [await _copy(session, on, model), await _copy(session, on, model, seed=11)]
        batched = await asyncio.gather(*(_copy(session, on, model, seed)
                                         for seed in (None, 11, None, 11)))
    assert "library" in want[0]["choices"][0]["message"]["content"], want[0]
    for got, where in ((alone, "alone"), (batched[:2], "batched"), (batched[2:], "batched")):
        for g, w in zip(got, want):
            assert g["choices"] == w["choices"], f"{where}: speculation changed the answer"
    report = alone[0]["candor"]["speculative"]
    assert report["accepted"] > 0, report
    deadline = time.monotonic() + 30
    while scrape(on).total("vllm:spec_decode_num_accepted_tokens_total") == 0:
        assert time.monotonic() < deadline, "no accepted drafts in the metrics after 30 s"
        time.sleep(0.5)


def _one_server(tiny_model_dir, tmp_path, *flags: str) -> CandorServer:
    return CandorServer(tiny_model_dir, "--served-model-name", MODEL, "--max-model-len", "1024",
                        "--speculative-config", SPEC, *flags).start(log_path=tmp_path / "log")


async def _equal_to_off(off: CandorServer, srv: CandorServer, where: str,
                        fillers: int = 0) -> None:
    """Every probe, sent together (with ``fillers`` long requests of their own prompts
    beside them), answers as off answers it alone."""
    want = await _all(off, concurrent=False)
    async with aiohttp.ClientSession() as session:
        async def filler(i: int) -> None:
            body = {"model": MODEL, "prompt": f"{i} {PARAGRAPH} {i}", "max_tokens": 150,
                    "temperature": 0, "ignore_eos": True}
            async with session.post(srv.base_url + "/v1/completions", json=body) as resp:
                assert resp.status == 200, await resp.text()
        got, _ = await asyncio.gather(
            asyncio.gather(*(_post(session, srv, n) for n in PROBES)),
            asyncio.gather(*(filler(i) for i in range(fillers))))
    for name, payload in zip(PROBES, got):
        assert _choices(payload) == _choices(want[name]), f"{name} ({where}): differs from off"


async def test_requests_preempted_while_speculating_equal_off(servers, tiny_model_dir, tmp_path):
    """28 KV blocks (448 tokens) for ten probe sequences (the longest 407 tokens) and
    four long fillers: requests that drafted are preempted, recomputed and draft again;
    every answer is off's, bitwise."""
    off, _ = servers
    srv = _one_server(tiny_model_dir, tmp_path, "--num-kv-blocks", "28")
    try:
        await _equal_to_off(off, srv, "under preemption", fillers=4)
        stats = srv.wait_all_blocks_free(what="the preempting server at rest")
        assert stats["preemptions"] > 0, "28 blocks never preempted: the test proves nothing"
        assert stats["spec_drafts"] > 0, stats
    finally:
        assert srv.stop() == 0


async def test_disaggregated_decode_replica_speculates_and_equals_off(servers, tiny_model_dir,
                                                                      tmp_path):
    """Prefill on replica 0, the KV handed to replica 1, which decodes with drafts: the
    answers are off's (colocated, no drafts), bitwise, and the drafts were counted."""
    off, _ = servers
    srv = _one_server(tiny_model_dir, tmp_path, "--prefill-replicas", "1",
                      "--decode-replicas", "1")
    try:
        await _equal_to_off(off, srv, "prefill/decode split")
        deadline = time.monotonic() + 30
        while scrape(srv).total("vllm:spec_decode_num_drafts_total") == 0:
            assert time.monotonic() < deadline, "no drafts counted on the split after 30 s"
            time.sleep(0.5)
        assert scrape(srv).total("candor_kv_transfer_bytes_total", direction="received") > 0
    finally:
        assert srv.stop() == 0


async def test_suffix_decoding_equals_off_and_drafts_from_finished_outputs(servers,
                                                                           tiny_model_dir,
                                                                           tmp_path):
    """``method: suffix``: every probe answers as off does, alone and then in a batch;
    the second time the greedy probe's own earlier output is in the cache of finished
    outputs, so its drafts are that answer and are kept."""
    off, _ = servers
    srv = CandorServer(tiny_model_dir, "--served-model-name", MODEL, "--max-model-len", "1024",
                       "--speculative-config", json.dumps({
                           "method": "suffix", "num_speculative_tokens": 8})).start(
        log_path=tmp_path / "log")
    try:
        want = await _all(off, concurrent=False)
        first = await _all(srv, concurrent=False)
        again = await _all(srv, concurrent=True)
        for got, where in ((first, "alone"), (again, "batched, outputs cached")):
            for name in PROBES:
                assert _choices(got[name]) == _choices(want[name]), f"suffix {name} ({where})"
        spec = again["greedy"]["candor"]["speculative"]
        assert spec["accepted"] > 100 and spec["accepted"] <= spec["drafted"], spec
    finally:
        assert srv.stop() == 0
