"""Features composed, through the real processes: a request gives the answer it gives
alone whatever the engine does around it (a prefix-cache hit, a batch neighbour whose
own state is bad, a failed step before it), and only a request's own bad state fails it.

- penalties and ``min_tokens`` read the whole token history, cached prompt included;
- a grammar that must end before ``min_tokens``: a 400 naming both fields when the
  constraint's longest output is known to be too short, else that request alone ends
  with a ``constraint_conflict`` error while its batch goes on;
- after a failed step, the step already queued behind it runs for everyone it did not
  share with the failed one (a constrained request's run-ahead is not fed a made-up token);
- stop strings ending on the last allowed token report ``stop``; the stopping token's
  text (EOS, ``stop_token_ids``) stays out of the answer unless
  ``include_stop_str_in_output``.
"""

from __future__ import annotations

import asyncio
import json
import uuid

import aiohttp
import pytest

from tests.support.faults import fault_env
from tests.e2e.test_e2e_engine import _hf_greedy
from tests.support.polling import wait_until
from tests.support.server import CandorServer

MODEL = "tiny-llama"
HEAD = ("Prefix caching shares the KV blocks of a common prompt head between requests, "
        "so only the new tail is computed. ") * 4
FAULT_TOKEN = 300


async def _post(session, server, body: dict, path: str = "/v1/completions") -> tuple[int, dict]:
    async with session.post(server.base_url + path, json={"model": MODEL, **body}) as resp:
        return resp.status, await resp.json()


async def _stream(session, server, body: dict, path: str = "/v1/completions"
                  ) -> tuple[int, list]:
    """(status, the frames' JSON bodies, ``"[DONE]"`` kept as the string)."""
    async with session.post(server.base_url + path,
                            json={"model": MODEL, "stream": True, **body}) as resp:
        raw = (await resp.read()).decode()
    frames = [f[len("data: "):] for f in raw.split("\n\n") if f.startswith("data: ")]
    return resp.status, [f if f == "[DONE]" else json.loads(f) for f in frames]


def _lps(body: dict) -> list[float]:
    return body["choices"][0]["logprobs"]["token_logprobs"]


EOS = 4  # the tiny checkpoint's end-of-sequence id


@pytest.fixture(scope="module")
def repeating_prompt(server, hf_model):
    """Token ids whose cached head holds the tokens greedy decoding then produces: a
    penalty that missed the cached prompt (or the first generated tokens) changes them."""
    _, tok = hf_model
    ids = tok(HEAD + "1 2 3 4 5")["input_ids"]
    status, plain = asyncio.run(_once(server, {"prompt": ids, "max_tokens": 32,
                                               "temperature": 0, "ignore_eos": True,
                                               "return_token_ids": True}))
    assert status == 200, plain
    return ids[:1] + plain["choices"][0]["token_ids"] * 2 + ids[1:]


async def _once(server, body: dict) -> tuple[int, dict]:
    async with aiohttp.ClientSession() as session:
        return await _post(session, server, body)


@pytest.mark.parametrize("fields", [
    {"presence_penalty": 2.0},
    {"frequency_penalty": 1.5},
    {"repetition_penalty": 1.3},
    # EOS pushed to the top: exactly min_tokens tokens, then EOS
    {"min_tokens": 5, "logit_bias": {str(EOS): 100}},
], ids=["presence", "frequency", "repetition", "min_tokens"])
async def test_history_fields_give_the_same_answer_with_and_without_a_cache_hit(
        server, repeating_prompt, fields):
    body = {"prompt": repeating_prompt, "max_tokens": 32, "temperature": 0, "logprobs": 1,
            "return_token_ids": True, **fields}
    shared, alone = uuid.uuid4().hex, uuid.uuid4().hex
    async with aiohttp.ClientSession() as session:
        status, warm = await _post(session, server, {**body, "cache_salt": shared})
        assert status == 200, warm
        status, hit = await _post(session, server, {**body, "cache_salt": shared})
        assert status == 200, hit
        status, miss = await _post(session, server, {**body, "cache_salt": alone})
        assert status == 200, miss
    assert hit["usage"]["prompt_tokens_details"]["cached_tokens"] >= 64
    assert miss["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert hit["choices"][0]["token_ids"] == miss["choices"][0]["token_ids"]
    assert hit["choices"][0]["finish_reason"] == miss["choices"][0]["finish_reason"]
    assert _lps(hit) == pytest.approx(_lps(miss), abs=1e-4)
    if "min_tokens" in fields:
        assert hit["choices"][0]["token_ids"][-1] == EOS
        assert hit["usage"]["completion_tokens"] == fields["min_tokens"] + 1
    server.wait_all_blocks_free()


async def _solo(session, server, bodies: list[dict]) -> list[list[int]]:
    out = []
    for body in bodies:
        status, got = await _post(session, server, body)
        assert status == 200, got
        out.append(got["choices"][0]["token_ids"])
    return out


def _bystanders() -> list[dict]:
    return [{"prompt": f"Bystander {i} asks about the weather.", "max_tokens": 12 + i,
             "temperature": 0, "ignore_eos": True, "return_token_ids": True}
            for i in range(6)]


async def test_schema_that_must_end_before_min_tokens_is_a_400_and_its_batch_goes_on(server):
    """The issue's case: a boolean's longest spelling is 5 bytes, so 20 tokens can never
    come before the end: 400 naming both fields, nothing scheduled; the six beside it
    get the tokens they get alone."""
    conflict = {"messages": [{"role": "user", "content": "yes or no?"}], "max_tokens": 30,
                "min_tokens": 20, "response_format": {"type": "json_schema", "json_schema": {
                    "name": "b", "schema": {"type": "boolean"}}}}
    others = _bystanders()
    async with aiohttp.ClientSession() as session:
        alone = await _solo(session, server, others)
        results = await asyncio.gather(
            _post(session, server, conflict, "/v1/chat/completions"),
            *[_post(session, server, o) for o in others])
    status, body = results[0]
    assert status == 400, body
    err = body["error"]
    assert err["code"] == "constraint_conflict" and err["param"] == "min_tokens"
    assert "min_tokens" in err["message"] and "response_format" in err["message"]
    for (status, got), want in zip(results[1:], alone):
        assert status == 200, got
        assert got["choices"][0]["token_ids"] == want
    server.wait_all_blocks_free()


CONFLICT = {"prompt": "Answer:", "guided_regex": "(yes|no)", "min_tokens": 20,
            "max_tokens": 30, "temperature": 0}


async def test_runtime_constraint_conflict_fails_only_that_request(server):
    """A regex's length is not judged up front: the conflict shows when the grammar allows
    only the end and min_tokens holds it back. That request alone ends, with an error
    naming both; the requests batched with it get their own tokens."""
    others = _bystanders()
    async with aiohttp.ClientSession() as session:
        alone = await _solo(session, server, others)
        before = server.wait_all_blocks_free()["aborts"]
        results = await asyncio.gather(_post(session, server, CONFLICT),
                                       *[_post(session, server, o) for o in others])
        status, body = results[0]
        assert status == 400, body
        err = body["error"]
        assert err["code"] == "constraint_conflict" and err["param"] == "min_tokens"
        assert set(err) == {"message", "type", "param", "code"}
        for (status, got), want in zip(results[1:], alone):
            assert status == 200, got
            assert got["choices"][0]["token_ids"] == want
        # streamed: the tokens it had, then an error frame and [DONE]
        status, frames = await _stream(session, server, CONFLICT)
        assert status == 200 and frames[-1] == "[DONE]"
        assert frames[-2]["error"]["code"] == "constraint_conflict"
        text = "".join(f["choices"][0]["text"] for f in frames[:-2] if f.get("choices"))
        assert text in ("yes", "no")
        # the server goes on serving; both failures were counted
        again = await _solo(session, server, others[:1])
        assert again == alone[:1]
    after = server.wait_all_blocks_free(
        what="two request errors counted",
        until=lambda s: s["aborts"].get("request_error", 0) >= before.get("request_error", 0) + 2)
    assert after["aborts"]["error"] == before["error"]  # no step failed


async def test_stop_string_ending_on_the_last_allowed_token_is_stop(server):
    body = {"prompt": "The quick brown fox", "max_tokens": 8, "temperature": 0,
            "ignore_eos": True}
    async with aiohttp.ClientSession() as session:
        _, full = await _post(session, server, body)
        text = full["choices"][0]["text"]
        # the shortest tail of the text that occurs nowhere earlier: it ends in token 8
        stop = next(text[-k:] for k in range(1, len(text) + 1)
                    if text.find(text[-k:]) == len(text) - k and text[-k:].strip())
        _, cut = await _post(session, server, {**body, "stop": [stop]})
        assert cut["choices"][0]["text"] == text[:-len(stop)]
        assert cut["choices"][0]["finish_reason"] == "stop"
        assert cut["usage"]["completion_tokens"] == 8
        _, frames = await _stream(session, server, {**body, "stop": [stop]})
        choices = [f["choices"][0] for f in frames[:-1] if f.get("choices")]
        assert "".join(c["text"] for c in choices) == text[:-len(stop)]
        assert choices[-1]["finish_reason"] == "stop"
    server.wait_all_blocks_free()


def _text(choice: dict, chat: bool) -> str:
    return choice["message"]["content"] if chat else choice["text"]


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
async def test_stopping_token_text_is_left_out_unless_asked_for(server, hf_model, path):
    """The id that ends a sequence (a stop_token_ids id, EOS with special tokens kept)
    counts in usage and logprobs, but its text is not part of the answer, whole or
    streamed."""
    _, tok = hf_model
    chat = path.endswith("chat/completions")
    base = {"max_tokens": 8, "temperature": 0, "return_token_ids": True,
            "logprobs": True if chat else 1}
    base.update({"messages": [{"role": "user", "content": "The quick brown fox"}]} if chat
                else {"prompt": "The quick brown fox"})
    async with aiohttp.ClientSession() as session:
        _, free = await _post(session, server, {**base, "ignore_eos": True}, path)
        ids = free["choices"][0]["token_ids"]
        stopper = next(t for k, t in enumerate(ids) if k >= 2 and t not in ids[:k])
        n = ids.index(stopper) + 1
        cases = [({"stop_token_ids": [stopper]}, tok.decode(ids[:n - 1]), n),
                 ({"stop_token_ids": [stopper], "include_stop_str_in_output": True},
                  tok.decode(ids[:n]), n),
                 ({"logit_bias": {str(EOS): 100}, "skip_special_tokens": False}, "", 1)]
        for extra, want, n in cases:
            body = {**base, **extra}
            status, whole = await _post(session, server, body, path)
            assert status == 200, whole
            choice = whole["choices"][0]
            assert (_text(choice, chat), choice["finish_reason"]) == (want, "stop"), extra
            assert whole["usage"]["completion_tokens"] == len(choice["token_ids"]) == n
            lps = choice["logprobs"]["content"] if chat else choice["logprobs"]["tokens"]
            assert len(lps) == n
            status, frames = await _stream(session, server, body, path)
            parts = [f["choices"][0] for f in frames[:-1] if f.get("choices")]
            streamed = "".join((p["delta"].get("content") or "") if chat else p["text"]
                               for p in parts)
            assert (streamed, parts[-1]["finish_reason"]) == (want, "stop"), extra
    server.wait_all_blocks_free()


@pytest.fixture(scope="module")
def fault_server(tiny_model_dir):
    """A server whose gpu_worker fails a step that feeds FAULT_TOKEN (an engine fault)."""
    srv = CandorServer(tiny_model_dir, "--served-model-name", MODEL, "--max-model-len", "1024",
                       env=fault_env(FAULT_TOKEN)).start()
    yield srv
    assert srv.stop() == 0


async def test_failed_step_fails_only_its_own_requests(fault_server, hf_model):
    """Step p samples FAULT_TOKEN for ``faulty``; step p+1 feeds it and fails (an engine
    fault: everyone in it fails, the constrained request too). ``late`` shares
    ``faulty``'s prefix: admitted while the blocks are being filled it shares them and
    runs in p+1, failing with it (engine_error); admitted after p returned it is a
    cache hit in a later step and gets its own tokens (the constrained request's
    run-ahead is never fed a made-up token: exactly timed in
    test_worker_row_failures' run-ahead test). Either way nothing else fails and every
    block is freed."""
    model, tok = hf_model

    head = HEAD * 3
    constrained = {"prompt": "Letters:", "guided_regex": "[a-z]{1000}", "max_tokens": 1000,
                   "temperature": 0}
    faulty = {"prompt": head + "One.", "max_tokens": 4, "temperature": 0,
              "logit_bias": {str(FAULT_TOKEN): 100}}
    late = {"prompt": head + "Two.", "max_tokens": 6, "temperature": 0, "ignore_eos": True,
            "return_token_ids": True}
    async with aiohttp.ClientSession() as session:
        running = asyncio.create_task(_post(session, fault_server, constrained))
        await asyncio.to_thread(wait_until, fault_server.engine_stats,
                                "the constrained request running",
                                until=lambda s: s["running"] == 1)
        results = await asyncio.gather(_post(session, fault_server, faulty),
                                       _post(session, fault_server, late))
        status, body = await running
    assert status == 500 and body["error"]["code"] == "engine_error"
    assert results[0][0] == 500, results[0]
    status, got = results[1]
    ids = tok(late["prompt"])["input_ids"]
    if status == 200:  # joined after the faulty step: a cache hit, its own tokens
        assert got["choices"][0]["token_ids"] == _hf_greedy(model, ids, 6)
        assert got["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    else:  # ran in the failed step
        assert status == 500 and got["error"]["code"] == "engine_error", got
    after = {**late, "prompt": head + "Three."}  # the engine serves on
    async with aiohttp.ClientSession() as session:
        status, got = await _post(session, fault_server, after)
    assert status == 200, got
    assert got["choices"][0]["token_ids"] == _hf_greedy(model, tok(after["prompt"])["input_ids"], 6)
    fault_server.wait_all_blocks_free()
