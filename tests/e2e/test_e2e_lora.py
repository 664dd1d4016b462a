"""LoRA adapters through every process, with PEFT as the reference.

One server of a tiny Qwen2 over two tensor-parallel ranks (gloo), started with vLLM's
flags: ``--enable-lora``, ``--lora-modules`` in both forms (name=path and JSON with
``base_model_name``), ``--max-loras 2``, ``--max-lora-rank 8``, ``--max-cpu-loras 2``,
an API key and ``VLLM_ALLOW_RUNTIME_LORA_UPDATING=True``. The adapters are built here
with peft (``tests/support/lora_zoo.py``), seeded so each one's greedy tokens differ from the
base model's and from each other's.

- Requests for the base and for two adapters sent together give each its own reference
  tokens (HF for the base, PEFT for an adapter), on chat, completions and responses.
- A prompt cached under one adapter is a miss for the base and the other adapter, and a
  hit for the same adapter.
- /v1/models lists the adapters with their ``parent``; an unknown name is a 404 listing
  the served ones.
- Runtime loading (vLLM's routes and bodies) needs the key, loads only from the
  directories holding the ``--lora-modules``, refuses a bad adapter with a 400 naming the
  problem, replaces in place and unloads.
- A second server with one adapter slot (``--max-loras 1``): a request for another
  adapter waits while one runs, and ``vllm:lora_requests_info`` says so; without the
  runtime switch the routes are 404. A bad ``--lora-modules`` adapter stops the launcher
  in one line before any process starts.
"""

from __future__ import annotations

import asyncio
import json
import random
import subprocess
import sys

import aiohttp
import pytest
import torch

from tests.support import lora_zoo, model_zoo
from tests.support.faults import slow_env
from tests.support.metrics_text import scrape
from tests.support.polling import wait_until
from tests.support.server import REPO, CandorServer

KEY = "lora-test-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
BASE = "qwen2"
MAX_NEW = 8


def _prompt(n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return [0] + torch.randint(6, model_zoo.VOCAB, (n - 1,), generator=g).tolist()


@pytest.fixture(scope="module")
def zoo(tmp_path_factory, tiny_model_dir):
    root = tmp_path_factory.mktemp("e2e-lora")
    base = model_zoo.build(BASE, root / BASE, tiny_model_dir)
    adapters = root / "adapters"  # the allowed directory: it holds the --lora-modules
    wider = model_zoo.build(BASE, root / "wider", intermediate_size=96)
    return {
        "root": root, "base": base,
        **lora_zoo.build_named(base, adapters),  # full, qv
        "late": lora_zoo.build_adapter(base, adapters / "late", rank=8, alpha=8, seed=3,
                                       targets=["o_proj", "gate_proj", "up_proj"]),
        "late-b": lora_zoo.build_adapter(base, adapters / "late-b", rank=6, alpha=12, seed=4),
        "rank16": lora_zoo.build_adapter(base, adapters / "rank16", rank=16, alpha=16, seed=5),
        "dora": lora_zoo.build_adapter(base, adapters / "dora", rank=4, alpha=8, use_dora=True),
        "wider": lora_zoo.build_adapter(wider, adapters / "wider", rank=4, alpha=8),
        "outside": lora_zoo.build_adapter(base, root / "elsewhere" / "outside", rank=4, alpha=8),
    }


@pytest.fixture(scope="module")
def srv(zoo):
    qv = json.dumps({"name": "qv", "path": str(zoo["qv"]), "base_model_name": BASE})
    server = CandorServer(
        zoo["base"], "--served-model-name", BASE, "--tensor-parallel-size", "2",
        "--num-kv-blocks", "128", "--enable-lora", "--lora-modules", f"full={zoo['full']}", qv,
        "--max-loras", "2", "--max-lora-rank", "8", "--max-cpu-loras", "2", "--api-key", KEY,
        env={"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True"},
    ).start(log_path=zoo["root"] / "server.log")
    yield server
    assert server.stop() == 0


_REFERENCES: dict[str, object] = {}


def _reference(zoo, name: str | None, prompt: list[int], n: int = MAX_NEW) -> list[int]:
    """HF's greedy tokens for the base model, PEFT's for an adapter (its directory)."""
    key = str(name)
    if key not in _REFERENCES:
        _REFERENCES[key] = (model_zoo.hf_model(zoo["base"]) if name is None
                            else lora_zoo.peft_model(zoo["base"], zoo[name]))
    generate = model_zoo.hf_greedy if name is None else lora_zoo.peft_greedy
    return generate(_REFERENCES[key], prompt, n)


async def _post(session, srv, path: str, body: dict, headers=AUTH) -> tuple[int, dict | str]:
    async with session.post(srv.base_url + path, json=body, headers=headers) as resp:
        text = await resp.text()
        try:
            return resp.status, json.loads(text)
        except ValueError:
            return resp.status, text


async def _complete(session, srv, model: str, prompt: list[int], n: int = MAX_NEW):
    status, body = await _post(session, srv, "/v1/completions", {
        "model": model, "prompt": prompt, "max_tokens": n, "temperature": 0,
        "ignore_eos": True, "return_token_ids": True})
    assert status == 200, body
    assert body["model"] == model
    return body["choices"][0]["token_ids"], body["usage"]


async def _get(session, srv, path: str) -> tuple[int, dict]:
    async with session.get(srv.base_url + path, headers=AUTH) as resp:
        return resp.status, json.loads(await resp.text())


async def test_models_list_adapters_with_parent(srv, zoo):
    async with aiohttp.ClientSession() as session:
        status, models = await _get(session, srv, "/v1/models")
        assert status == 200
        cards = {m["id"]: m for m in models["data"]}
        assert list(cards) == [BASE, "full", "qv"]
        assert cards[BASE]["parent"] is None
        for name in ("full", "qv"):
            assert cards[name]["parent"] == BASE and cards[name]["root"] == str(zoo[name])
            assert cards[name]["max_model_len"] == cards[BASE]["max_model_len"]
        status, card = await _get(session, srv, "/v1/models/full")
        assert status == 200 and card["parent"] == BASE


async def test_mixed_adapters_and_base_batched_give_peft_tokens(srv, zoo):
    """Six requests at once, the base and two adapters interleaved: each gets the tokens
    of its own model alone (rank 8 on all seven projections; rank 4 rslora on q, v and
    down of two layers), on two tensor-parallel ranks."""
    names = [None, "full", "qv", "full", "qv", None]
    prompts = [_prompt(n, seed) for seed, n in enumerate((9, 33, 17, 5, 24, 12))]
    async with aiohttp.ClientSession() as session:
        results = await asyncio.gather(*[_complete(session, srv, name or BASE, p)
                                         for name, p in zip(names, prompts)])
    got = [tokens for tokens, _ in results]
    assert got == [_reference(zoo, name, p) for name, p in zip(names, prompts)]
    # each adapter changes the tokens, so the comparison above tells them apart
    assert all(got[i] != _reference(zoo, None, prompts[i]) for i in (1, 2, 3, 4))
    assert _reference(zoo, "full", prompts[2]) != got[2]
    srv.wait_all_blocks_free(timeout=30)


async def test_an_adapter_request_is_bitwise_the_same_alone_and_beside_others(srv):
    """The deterministic mode with adapters: one greedy ``full`` request with top logprobs
    gives the same tokens and logprobs, bit for bit, alone and beside 3, 8 and 15 others
    (the base, ``full`` and ``qv``, prompts of 1-40 tokens), so its adapter's row groups
    take every size from 1 on; each response says it ran deterministically."""
    probe = {"model": "full", "prompt": _prompt(21, 123), "max_tokens": 12, "temperature": 0,
             "ignore_eos": True, "logprobs": 5, "return_token_ids": True}
    rng = random.Random(5)
    async with aiohttp.ClientSession() as session:
        async def probe_once(delay: float = 0.0) -> dict:
            await asyncio.sleep(delay)
            status, body = await _post(session, srv, "/v1/completions", probe)
            assert status == 200, body
            assert body["candor"]["deterministic"] is True, body["candor"]
            return body["choices"][0]

        def other() -> dict:
            return {"model": rng.choice([BASE, "full", "qv"]), "temperature": 0, "ignore_eos": True,
                    "prompt": _prompt(rng.randint(1, 40), rng.randrange(10**6)),
                    "max_tokens": rng.randint(4, 20)}

        alone = await probe_once()
        assert alone["logprobs"]["top_logprobs"][0], alone
        for count in (3, 8, 15):
            got, *others = await asyncio.gather(
                probe_once(rng.uniform(0, 0.05)),
                *(_post(session, srv, "/v1/completions", other()) for _ in range(count)))
            assert [status for status, _ in others] == [200] * count, others
            assert got == alone, f"beside {count} other requests: tokens or logprobs differ"
    srv.wait_all_blocks_free(timeout=30)


async def test_chat_and_responses_run_on_the_named_adapter(srv, zoo):
    messages = [{"role": "user", "content": "Name three colours."}]
    async with aiohttp.ClientSession() as session:
        chats = {}
        for model in (BASE, "qv"):
            status, body = await _post(session, srv, "/v1/chat/completions", {
                "model": model, "messages": messages, "max_tokens": MAX_NEW, "temperature": 0,
                "ignore_eos": True, "return_token_ids": True})
            assert status == 200, body
            chats[model] = body
        prompt = chats["qv"]["prompt_token_ids"]
        assert chats["qv"]["choices"][0]["token_ids"] == _reference(zoo, "qv", prompt)
        assert chats[BASE]["choices"][0]["token_ids"] == _reference(zoo, None, prompt)
        status, resp = await _post(session, srv, "/v1/responses", {
            "model": "qv", "input": messages, "max_output_tokens": MAX_NEW, "temperature": 0})
        assert status == 200, resp
        assert resp["model"] == "qv"
        text = "".join(part["text"] for item in resp["output"] if item["type"] == "message"
                       for part in item["content"])
        assert text == chats["qv"]["choices"][0]["message"]["content"]
        assert text != chats[BASE]["choices"][0]["message"]["content"]


async def test_prefix_cache_is_keyed_by_adapter(srv, zoo):
    """A 48-token prompt (three full blocks) computed under ``full``: the base model and
    ``qv`` miss it, ``full`` again hits it, and every answer is its model's own."""
    prompt = _prompt(48, 99)
    async with aiohttp.ClientSession() as session:
        order = ["full", None, "qv", "full"]
        usages = []
        for name in order:
            tokens, usage = await _complete(session, srv, name or BASE, prompt)
            assert tokens == _reference(zoo, name, prompt), name
            usages.append(usage["prompt_tokens_details"]["cached_tokens"])
    assert usages[1] == 0 and usages[2] == 0, usages
    assert usages[3] >= 32, usages


async def test_unknown_adapter_is_404_listing_served_names(srv):
    async with aiohttp.ClientSession() as session:
        status, body = await _post(session, srv, "/v1/completions",
                                   {"model": "nope", "prompt": "hi", "max_tokens": 2})
    assert status == 404
    err = body["error"]
    assert err["code"] == "model_not_found" and err["param"] == "model"
    assert all(repr(n) in err["message"] for n in (BASE, "full", "qv")), err


async def _stream_open(session, srv, model: str):
    """A long streamed completion, open (running) once its first chunk arrived."""
    resp = await session.post(srv.base_url + "/v1/completions", headers=AUTH, json={
        "model": model, "prompt": _prompt(8, 7), "max_tokens": 400, "ignore_eos": True,
        "temperature": 0, "stream": True})
    assert resp.status == 200
    await resp.content.readline()
    return resp


def _lora_info(srv) -> dict[str, str]:
    """The labels of vLLM's LoRA gauge, as the Inference Extension's picker reads them."""
    now = scrape(srv)
    assert now.families["vllm:lora_requests_info"].type == "gauge"
    labels = [dict(ls) for name, ls in now.samples if name == "vllm:lora_requests_info"]
    assert len(labels) == 1, labels
    return labels[0]


async def test_runtime_load_and_unload_behind_the_key(srv, zoo):
    load = {"lora_name": "late", "lora_path": str(zoo["late"])}
    prompt = _prompt(20, 5)
    async with aiohttp.ClientSession() as session:
        status, body = await _post(session, srv, "/v1/load_lora_adapter", load, headers={})
        assert status == 401, body
        status, body = await _post(session, srv, "/v1/load_lora_adapter", load)
        assert status == 200, body
        _, models = await _get(session, srv, "/v1/models")
        late = next(m for m in models["data"] if m["id"] == "late")
        assert late["parent"] == BASE and late["root"] == str(zoo["late"])
        # three adapters, two kept in host memory (--max-cpu-loras 2): all still serve
        for name in ("late", "full", "qv", "late"):
            tokens, _ = await _complete(session, srv, name, prompt)
            assert tokens == _reference(zoo, name, prompt), name

        status, body = await _post(session, srv, "/v1/load_lora_adapter", load)
        assert status == 400 and body["error"]["param"] == "lora_name", body
        assert "already been loaded" in body["error"]["message"]

        # in place: the name now serves the other adapter
        status, body = await _post(session, srv, "/v1/load_lora_adapter",
                                   {"lora_name": "late", "lora_path": str(zoo["late-b"]),
                                    "load_inplace": True})
        assert status == 200, body
        tokens, _ = await _complete(session, srv, "late", prompt)
        assert tokens == _reference(zoo, "late-b", prompt)

        status, body = await _post(session, srv, "/v1/unload_lora_adapter",
                                   {"lora_name": "late", "lora_int_id": 3})
        assert status == 200, body
        status, body = await _post(session, srv, "/v1/completions",
                                   {"model": "late", "prompt": "hi", "max_tokens": 2})
        assert status == 404 and "'full'" in body["error"]["message"], body
        status, body = await _post(session, srv, "/v1/unload_lora_adapter", {"lora_name": "late"})
        assert status == 404, body
        assert body["error"]["param"] == "lora_name"
        assert "'full', 'qv'" in body["error"]["message"], body
    srv.wait_all_blocks_free(timeout=30)


@pytest.mark.parametrize("body, status, param, says", [
    ({"lora_name": "x", "lora_path": "{outside}"}, 400, "lora_path", "is outside the directories"),
    ({"lora_name": "x", "lora_path": "relative/dir"}, 400, "lora_path", "must be an absolute"),
    ({"lora_name": "x", "lora_path": "{adapters}/absent"}, 400, "lora_path", "is not a directory"),
    ({"lora_name": "x", "lora_path": "{rank16}"}, 400, "lora_path",
     "rank 16 exceeds this deployment's max_lora_rank 8"),
    ({"lora_name": "x", "lora_path": "{dora}"}, 400, "lora_path", "DoRA"),
    ({"lora_name": "x", "lora_path": "{wider}"}, 400, "lora_path", "do not fit the base model"),
    ({"lora_name": BASE, "lora_path": "{late}"}, 400, "lora_name", "a served model's name"),
    ({"lora_name": "x", "lora_path": "{late}", "extra": 1}, 400, "extra", "unknown field"),
    ({"lora_path": "{late}"}, 400, "lora_name", "lora_name"),
])
async def test_bad_adapters_are_400_naming_the_problem(srv, zoo, body, status, param, says):
    paths = {k: str(v) for k, v in zoo.items()}
    paths["adapters"] = str(zoo["full"].parent)
    body = {k: v.format(**paths) if isinstance(v, str) else v for k, v in body.items()}
    async with aiohttp.ClientSession() as session:
        got, reply = await _post(session, srv, "/v1/load_lora_adapter", body)
        assert got == status, reply
        assert set(reply["error"]) == {"message", "type", "param", "code"}
        assert reply["error"]["param"] == param and says in reply["error"]["message"], reply
        assert "\n" not in reply["error"]["message"]
        _, models = await _get(session, srv, "/v1/models")
        assert "x" not in {m["id"] for m in models["data"]}
    assert srv.health()[0] == 200


def test_bad_adapter_at_start_is_one_line(zoo):
    proc = subprocess.run(
        [sys.executable, str(REPO / "launch_cluster.py"), "serve", str(zoo["base"]),
         "--enable-lora", "--lora-modules", f"d={zoo['dora']}", "--port", "1"],
        capture_output=True, text=True, timeout=120, cwd=REPO)
    assert proc.returncode != 0
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert lines[-1].startswith("candor: cannot serve LoRA adapter 'd': ") and "DoRA" in lines[-1], \
        proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr


async def test_one_lora_slot_queues_the_other_adapter_and_the_metric_says_so(zoo):
    """``--max-loras 1`` without runtime loading (steps slowed so a request stays running):
    a request for ``qv`` waits while ``full`` runs, base requests pass it, and
    ``vllm:lora_requests_info`` names both; the load routes are 404 here."""
    server = CandorServer(zoo["base"], "--served-model-name", BASE, "--enable-lora",
                          "--lora-modules", f"full={zoo['full']}", f"qv={zoo['qv']}",
                          "--num-kv-blocks", "64",
                          env={"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "0", **slow_env(0.05)}
                          ).start(log_path=zoo["root"] / "one-slot.log")
    prompt = _prompt(12, 8)
    try:
        async with aiohttp.ClientSession() as session:
            for route in ("/v1/load_lora_adapter", "/v1/unload_lora_adapter"):
                code, body = await _post(session, server, route,
                                         {"lora_name": "x", "lora_path": str(zoo["late"])}, {})
                assert code == 404, body
                assert "--allow-runtime-lora-updating" in body["error"]["message"]
            code, caps = server.get("/v1/capabilities")
            lora = json.loads(caps)["lora"]
            assert lora["enabled"] and not lora["runtime_updates"] and lora["max_loras"] == 1

            stream = await _stream_open(session, server, "full")
            waiting = asyncio.create_task(_complete(session, server, "qv", prompt))
            info = await asyncio.to_thread(  # the loop sends the waiting request meanwhile
                wait_until, lambda: _lora_info(server), "qv waiting while full runs",
                until=lambda i: i["waiting_lora_adapters"] == "qv", timeout=15)
            assert info["running_lora_adapters"] == "full" and info["max_lora"] == "1"
            tokens, _ = await _complete(session, server, BASE, prompt)  # the base passes qv
            assert tokens == _reference(zoo, None, prompt)
            assert not waiting.done()
            stream.close()  # full's request ends: qv takes the slot
            tokens, _ = await asyncio.wait_for(waiting, 60)
            assert tokens == _reference(zoo, "qv", prompt)
        info = wait_until(lambda: _lora_info(server), "no adapter request left",
                          until=lambda i: i["running_lora_adapters"] == "", timeout=30)
        assert info["waiting_lora_adapters"] == ""
        server.wait_all_blocks_free(timeout=30)
    finally:
        assert server.stop() == 0


async def test_a_runtime_load_reaches_every_data_parallel_replica(zoo):
    """Two replicas, round robin: one load serves the adapter on both (requests for it
    land on each, with PEFT's tokens), and one unload takes it from both."""
    server = CandorServer(zoo["base"], "--served-model-name", BASE, "--data-parallel-size", "2",
                          "--data-parallel-routing", "round_robin", "--num-kv-blocks", "32",
                          "--enable-lora", "--lora-modules", f"full={zoo['full']}",
                          "--allow-runtime-lora-updating").start(log_path=zoo["root"] / "dp.log")
    prompt = _prompt(10, 3)
    try:
        async with aiohttp.ClientSession() as session:
            load = {"lora_name": "late", "lora_path": str(zoo["late"])}
            code, body = await _post(session, server, "/v1/load_lora_adapter", load, {})
            assert code == 200, body
            for _ in range(4):  # round robin: two on each replica
                tokens, _ = await _complete(session, server, "late", prompt)
                assert tokens == _reference(zoo, "late", prompt)
            # only these requests reached the engines: each replica looked up prompts
            wait_until(lambda: scrape(server), "both replicas served a request for it",
                       until=lambda s: all(s.value("candor_replica_prefix_cache_queried_tokens",
                                                   replica=r) > 0 for r in "01"))
            code, body = await _post(session, server, "/v1/unload_lora_adapter",
                                     {"lora_name": "late"}, {})
            assert code == 200, body
            for _ in range(2):
                code, body = await _post(session, server, "/v1/completions",
                                         {"model": "late", "prompt": "hi", "max_tokens": 2}, {})
                assert code == 404, body
    finally:
        assert server.stop() == 0
