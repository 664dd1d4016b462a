"""The shared KV store (``kv_store`` role) on CPU: DP replicas reuse each other's prompts.

- The configuration alone: ``kv_store:`` in a topology (typed, a bad key named), the serve
  flags, the refusal beside disaggregation; the store's tiers bounded (LRU).
- Through every process (DP=2, round-robin routing, so consecutive requests land on
  different replicas): a prompt computed on one replica is a hit on the other
  (``cached_tokens`` > 0, the hit counted) with HF's greedy tokens; a different
  ``cache_salt`` is a miss; store bytes stay within the size, evicted blocks are misses;
  the store killed mid-run: every request answered with the same tokens, none waits past
  the lookup deadline, every block free.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import msgspec
import pytest

from launcher.serve_cli import ServeArgsError, serve_parser, serve_topology
from cluster.topology import Topology
from launcher.topology_check import TopologyError, check_topology
from kv_store.tiers import Tiers
from tests.support.faults import store_import_lost_env
from tests.support.metrics_text import scrape
from tests.support.model_zoo import hf_greedy
from tests.support.polling import wait_until
from tests.support.server import CandorServer, role_of

MODEL = "tiny-llama"
MAX_NEW = 12
BLOCK = 16  # the engine's default block size
_SENTENCE = "Candor serves language models and reports what it did with every field. "


# ---------------------------------------------------------------- configuration


def test_topology_names_a_bad_kv_store_key_and_refuses_it_beside_disaggregation():
    with pytest.raises(msgspec.ValidationError, match=r"size_gb.*kv_store"):
        msgspec.yaml.decode(b"model: {path: /m}\nkv_store: {size_gb: 1}", type=Topology)
    topo = msgspec.yaml.decode(b"model: {path: /m}\nreplicas: 2\n"
                               b"kv_store: {size_gib: 1, dir: /tmp/x}", type=Topology)
    check_topology(topo, check_model=False)
    assert topo.kv_store.disk_size_gib > 0 and topo.kv_store.lookup_timeout_s == 0.5
    split = msgspec.yaml.decode(b"model: {path: /m}\nreplicas: 2\nkv_store: {size_gib: 1}\n"
                                b"disaggregation: {prefill_replicas: 1, decode_replicas: 1}",
                                type=Topology)
    with pytest.raises(TopologyError, match="kv_store: a shared KV store does not serve a "
                                            "prefill/decode split yet"):
        check_topology(split, check_model=False)


def test_a_store_on_another_node_needs_tcp_both_ways():
    topo = msgspec.yaml.decode(b"""
model: {path: /m}
replicas: 2
kv_store: {size_gib: 1}
addresses: {node_status: "tcp://{host}:7100"}
nodes:
  - {name: a, roles: [api_frontend, tokenizer_worker, scheduler, gpu_worker, detokenizer]}
  - {name: b, host: 10.0.0.2, roles: [kv_store]}
""", type=Topology)
    with pytest.raises(TopologyError) as err:
        check_topology(topo, check_model=False)
    assert sorted(p.split(" ")[0] for p in err.value.problems) == [
        "kv_store", "kv_store_rank_in[0][0]", "kv_store_rank_in[1][0]", "scheduler_in[0]",
        "scheduler_in[1]"]


def test_serve_flags_make_the_store():
    args = serve_parser().parse_args(["--model", "/m", "-dp", "2", "--kv-store-size", "0.5",
                                      "--kv-store-dir", "/tmp/s", "--kv-store-disk-size", "2",
                                      "--kv-store-timeout", "0.2"])
    store = serve_topology(args, "/m", "m").kv_store
    assert (store.size_gib, store.dir, store.disk_size_gib, store.lookup_timeout_s) == (
        0.5, "/tmp/s", 2, 0.2)
    assert serve_topology(serve_parser().parse_args(["--model", "/m"]), "/m", "m"
                          ).kv_store is None
    with pytest.raises(ServeArgsError, match="--kv-store-dir needs --kv-store-size"):
        serve_topology(serve_parser().parse_args(["--model", "/m", "--kv-store-dir", "/s"]),
                       "/m", "m")


def test_tiers_stay_within_their_bounds_least_recently_used_out(tmp_path):
    tiers = Tiers(memory_bytes=300, disk_dir=str(tmp_path / "d"), disk_bytes=200)
    for i in range(6):
        tiers.put(bytes([i]), bytes([i]) * 100)
        assert tiers.resident["memory"] <= 300 and tiers.resident["disk"] <= 200
    # 3 newest in memory, the 2 before on disk, the oldest gone
    assert list(tiers.memory) == [b"\x03", b"\x04", b"\x05"]
    assert list(tiers.disk) == [b"\x01", b"\x02"]
    assert tiers.get(b"\x00") is None and tiers.evicted == 1
    assert sorted(os.listdir(tmp_path / "d")) == ["01", "02"]
    assert tiers.get(b"\x01") == b"\x01" * 100  # back in memory; memory's oldest goes down
    assert list(tiers.memory) == [b"\x04", b"\x05", b"\x01"]
    assert list(tiers.disk) == [b"\x02", b"\x03"]
    memory_only = Tiers(memory_bytes=250)
    for i in range(4):
        memory_only.put(bytes([i]), b"x" * 100)
    assert list(memory_only.memory) == [b"\x02", b"\x03"] and memory_only.evicted == 2


# ---------------------------------------------------------------- through every process


def _store_server(model_dir, tmp_path, *flags: str, env: dict[str, str] | None = None
                  ) -> CandorServer:
    return CandorServer(model_dir, "--served-model-name", MODEL, "-dp", "2",
                        "--data-parallel-routing", "round_robin", "--max-model-len", "1024",
                        *flags, env=env).start(log_path=tmp_path / "log")


def _complete(srv: CandorServer, prompt, **more) -> dict:
    status, body = srv.post_json("/v1/completions", {
        "model": MODEL, "prompt": prompt, "max_tokens": MAX_NEW, "temperature": 0,
        "ignore_eos": True, "return_token_ids": True, **more})
    assert status == 200, body
    return body


def _store_blocks(srv: CandorServer) -> float:
    return scrape(srv).total("candor_kv_store_blocks", tier="memory")


def _stored(srv: CandorServer, at_least: int) -> None:
    """The store holds ``at_least`` blocks (the puts are write-behind)."""
    wait_until(lambda: _store_blocks(srv), f"{at_least} blocks in the KV store",
               until=lambda n: n >= at_least, timeout=30)


def _cached(body: dict) -> int:
    return body["usage"]["prompt_tokens_details"]["cached_tokens"]


def test_a_prompt_computed_on_one_replica_is_a_hit_on_the_other(tiny_model_dir, tmp_path,
                                                                hf_model):
    model, tok = hf_model
    srv = _store_server(tiny_model_dir, tmp_path, "--kv-store-size", "0.05")
    try:
        prompt = _SENTENCE * 5
        ids = tok(prompt)["input_ids"]
        full = (len(ids) - 1) // BLOCK
        expected = hf_greedy(model, ids, MAX_NEW)
        first = _complete(srv, prompt)  # replica 0 computes it and writes its blocks
        assert first["choices"][0]["token_ids"] == expected and _cached(first) == 0
        _stored(srv, full)
        second = _complete(srv, prompt)  # round robin: replica 1, whose own cache is empty
        assert second["choices"][0]["token_ids"] == expected
        assert _cached(second) == full * BLOCK
        s = scrape(srv)
        assert s.total("candor_kv_store_hits_total") == full
        assert s.total("candor_kv_store_misses_total") == full  # the first request's
        assert 0 < s.total("candor_kv_store_bytes", tier="memory") <= 0.05 * 2 ** 30
        # a different cache_salt is a different key: a miss (replica 0, whose own cache
        # and the store hold the prompt unsalted); then a hit under that salt (replica 1)
        salted = _complete(srv, prompt, cache_salt="tenant-b")
        assert salted["choices"][0]["token_ids"] == expected and _cached(salted) == 0
        _stored(srv, 2 * full)
        salted = _complete(srv, prompt, cache_salt="tenant-b")
        assert salted["choices"][0]["token_ids"] == expected
        assert _cached(salted) == full * BLOCK
        # n > 1 and logprobs through a hit: the same tokens, logprobs as computed
        # (the same tokens as the miss: HF stops at eos, which this request ignores)
        miss = _complete(srv, _SENTENCE * 6, logprobs=2)  # replica 0
        _stored(srv, 2 * full + 1)
        both = _complete(srv, _SENTENCE * 6, n=2, logprobs=2)
        want = miss["choices"][0]["token_ids"]
        assert [c["token_ids"] for c in both["choices"]] == [want, want]
        assert _cached(both) > 0
        hit_lp = both["choices"][0]["logprobs"]["token_logprobs"]
        miss_lp = miss["choices"][0]["logprobs"]["token_logprobs"]
        assert max(abs(a - b) for a, b in zip(hit_lp, miss_lp)) < 1e-4
        assert all(len(top) == 2 for top in both["choices"][0]["logprobs"]["top_logprobs"])
        srv.wait_all_blocks_free()
    finally:
        assert srv.stop() == 0


def _block_bytes(model_dir) -> int:
    """One rank's block: every layer's K and V for BLOCK positions (float32 on CPU)."""
    import json
    with open(os.path.join(model_dir, "config.json")) as fh:
        c = json.load(fh)
    head_dim = c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"]
    return 2 * c["num_hidden_layers"] * c["num_key_value_heads"] * head_dim * BLOCK * 4


def _ids(k: int) -> list[int]:
    """A prompt of token ids, 4 full blocks + 1; with max_tokens 4 it fills no fifth."""
    return list(range(300 + 100 * k, 365 + 100 * k))


def test_store_bounds_hold_lru_evicts_to_disk_then_out_and_evicted_blocks_miss(
        tiny_model_dir, tmp_path):
    block = _block_bytes(tiny_model_dir)
    six = f"{6 * block / 2 ** 30!r}"  # each tier holds six blocks
    srv = _store_server(tiny_model_dir, tmp_path, "--kv-store-size", six, "--kv-store-dir",
                        str(tmp_path / "tier"), "--kv-store-disk-size", six)
    written = 0

    def run(prompt, blocks_new: int) -> dict:
        nonlocal written
        body = _complete(srv, prompt, max_tokens=4)
        written += blocks_new
        wait_until(lambda: scrape(srv).total("candor_kv_store_written_blocks_total"),
                   f"{written} blocks written", until=lambda n: n >= written, timeout=30)
        return body

    try:
        first = run(_ids(0), 4)  # replica 0
        run(_ids(1), 4)  # replica 1: memory's oldest two (prompt 0's head) go to disk
        run("Hi", 0)  # replica 0 (no full block)
        again = run(_ids(0), 0)  # replica 1: every block found, two of them on disk
        assert _cached(again) == 4 * BLOCK
        assert again["choices"][0]["token_ids"] == first["choices"][0]["token_ids"]
        evicted = run(_ids(2), 4)  # replica 0
        for k in (3, 4, 5):  # replicas 1, 0, 1: twelve newer blocks push prompt 2 out
            run(_ids(k), 4)
        run("Hi", 0)  # replica 0
        late = run(_ids(2), 0)  # replica 1: never computed it, the store no longer has it
        assert _cached(late) == 0
        assert late["choices"][0]["token_ids"] == evicted["choices"][0]["token_ids"]
        s = scrape(srv)
        for tier in ("memory", "disk"):
            assert 0 < s.total("candor_kv_store_bytes", tier=tier) <= 6 * block, tier
            assert s.total("candor_kv_store_blocks", tier=tier) <= 6, tier
        assert len(os.listdir(tmp_path / "tier")) == s.total("candor_kv_store_blocks",
                                                             tier="disk")
        assert s.total("candor_kv_store_hits_total") == 4
        srv.wait_all_blocks_free()
    finally:
        assert srv.stop() == 0


def test_a_stalled_then_killed_store_costs_misses_only(tiny_model_dir, tmp_path, hf_model):
    """The store stopped (SIGSTOP) and killed while requests wait on its lookups: they
    wait out the deadline and compute; killed: lookups fail at once. Every request is answered with
    the tokens it had with the store, none waits long, every block comes back, and the
    launcher serves on (/health 200)."""
    model, tok = hf_model
    srv = _store_server(tiny_model_dir, tmp_path, "--kv-store-size", "0.05",
                        "--kv-store-timeout", "1")
    try:
        prompts = [_SENTENCE * 4, _ids(0), "Once upon a time, " * 10, _ids(1)]
        want = [_complete(srv, p)["choices"][0]["token_ids"] for p in prompts]
        model_ids = tok(prompts[0])["input_ids"]
        assert want[0] == hf_greedy(model, model_ids, MAX_NEW)
        store = next(p for p in srv.children() if role_of(p) == "kv_store[0]")
        os.kill(store, signal.SIGSTOP)
        try:
            with ThreadPoolExecutor(4) as pool:  # parked on lookups the store never answers
                started = time.monotonic()
                stalled = [pool.submit(_complete, srv, p) for p in [_ids(2), *prompts[1:]]]
                time.sleep(0.3)  # (the lookups are out: the store dies under them)
                os.kill(store, signal.SIGKILL)
                bodies = [f.result(timeout=60) for f in stalled]
            assert time.monotonic() - started < 30
            assert _cached(bodies[0]) == 0
            for prompt, body in zip(prompts[1:], bodies[1:]):
                assert body["choices"][0]["token_ids"] == want[prompts.index(prompt)]
        finally:
            with contextlib.suppress(ProcessLookupError):  # (killed above unless it failed)
                os.kill(store, signal.SIGKILL)
        wait_until(srv.health, "the launcher to see the store gone",
                   until=lambda h: h[0] == 200 and "kv_store" in (tmp_path / "log")
                   .read_text() and "exited" in (tmp_path / "log").read_text(), timeout=20)
        with ThreadPoolExecutor(4) as pool:
            started = time.monotonic()
            bodies = list(pool.map(lambda p: _complete(srv, p), prompts * 2))
            assert time.monotonic() - started < 60
        for prompt, body in zip(prompts * 2, bodies):
            assert body["choices"][0]["token_ids"] == want[prompts.index(prompt)], prompt
        assert srv.health()[0] == 200
        srv.wait_all_blocks_free(timeout=20)
        assert srv.proc.poll() is None
    finally:
        assert srv.stop() == 0
    log = (tmp_path / "log").read_text()
    assert "kv_store exited" in log and "the KV store did not answer within 1.00s" in log


def test_a_hit_whose_blocks_are_lost_before_its_turn_is_computed(tiny_model_dir, tmp_path,
                                                                   hf_model):
    """One sequence slot per replica, and workers that lose the blocks the store sends
    them before a plan imports them. The hit lands on replica 1 while a long stream holds
    its slot, so it waits with its found blocks: its import goes out with its first chunk,
    fails there, and the request computes its prompt: HF's tokens, no hit reported. (On
    the old scheduler the import went out at once in a plan without the request, its
    failure was forgotten and the request decoded over blocks never written.)"""
    model, tok = hf_model
    srv = _store_server(tiny_model_dir, tmp_path, "--kv-store-size", "0.05",
                        "--max-num-seqs", "1", env=store_import_lost_env())
    try:
        ids = tok(_SENTENCE * 5)["input_ids"]
        expected = hf_greedy(model, ids, MAX_NEW)
        assert _complete(srv, ids)["choices"][0]["token_ids"] == expected  # replica 0
        _stored(srv, (len(ids) - 1) // BLOCK)
        busy = urllib.request.urlopen(urllib.request.Request(  # replica 1, 600 tokens
            srv.base_url + "/v1/completions", headers={"Content-Type": "application/json"},
            data=json.dumps({"model": MODEL, "prompt": "Hi", "max_tokens": 600,
                             "ignore_eos": True, "stream": True}).encode()), timeout=120)
        with busy:
            assert busy.readline().startswith(b"data: ")  # running: the slot is taken
            _complete(srv, "Hi", max_tokens=1)  # replica 0
            with ThreadPoolExecutor(1) as pool:
                hit = pool.submit(_complete, srv, ids)  # replica 1: found, waits for the slot
                wait_until(lambda: scrape(srv).total("candor_kv_store_hits_total"),
                           "the store lookup to find the blocks on replica 1")
                assert not hit.done(), "the hit did not wait for the slot: the test proves nothing"
                rest = busy.read().decode()
                assert rest.rstrip().endswith("data: [DONE]"), rest[-300:]
                body = hit.result(timeout=120)
        assert body["choices"][0]["token_ids"] == expected
        assert _cached(body) == 0  # computed after all
        assert "kv_store_lost" not in json.dumps(body)
        srv.wait_all_blocks_free()
    finally:
        assert srv.stop() == 0
    assert "computing its prompt here instead" in (tmp_path / "log").read_text()


def test_two_ranks_per_replica_each_store_and_import_their_own_shard(tiny_model_dir,
                                                                    tmp_path, hf_model):
    """-tp 2 -dp 2: every rank writes its KV heads under its own rank; a hit needs every
    rank's shard and each rank imports its own."""
    model, tok = hf_model
    srv = _store_server(tiny_model_dir, tmp_path, "--kv-store-size", "0.05",
                        "--tensor-parallel-size", "2")
    try:
        ids = tok(_SENTENCE * 4)["input_ids"]
        full = (len(ids) - 1) // BLOCK
        expected = hf_greedy(model, ids, MAX_NEW)
        assert _complete(srv, ids)["choices"][0]["token_ids"] == expected  # replica 0
        _stored(srv, 2 * full)  # a shard per rank
        hit = _complete(srv, ids)  # replica 1
        assert hit["choices"][0]["token_ids"] == expected
        assert _cached(hit) == full * BLOCK
        srv.wait_all_blocks_free()
    finally:
        assert srv.stop() == 0
