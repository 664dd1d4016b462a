"""A prompt KV import travels with its request, and one the worker cannot write is
recomputed (scheduler/kv_connectors/pending_imports.py), in a real scheduler ``EngineLoop`` with its
sockets and no worker: the test plays the worker, reading each plan from the loop and
answering with a ``StepResult``.

Both sources of imported KV: blocks the shared KV store found, and a prefill replica's
transfer on a decode replica. With one sequence slot taken, the request holding imported
blocks waits; the import must not go out in a plan that does not schedule it (the worker
would write or fail it with nobody to fail, and the request would later decode over
blocks never written: issue 29 item 2). It goes out with the request's first chunk, and
when the worker reports that import lost, the request computes its prompt after all
instead of failing or running on."""

from __future__ import annotations

import logging

import msgspec
import pytest
import zmq

from cluster.process_config import process_configs
from cluster.topology import Topology
from protocol import ipc
from protocol.kv_store import StoreHeld
from scheduler.engine_loop import EngineLoop
from scheduler.kv_connectors.kv_store import StoreReads
from tests.support.polling import wait_until

BS = 16
PROMPT = list(range(1, 51))  # 3 full blocks and 2 tokens: the store may hold 3 blocks


def _tokenized(rid: str, prompt: list[int], max_tokens: int, **kw) -> ipc.TokenizedReq:
    return ipc.TokenizedReq(rid=rid, reply_to="ipc:///nonexistent-frontend",
                            prompt_token_ids=prompt, max_tokens=max_tokens,
                            sampling=ipc.SamplingParams(temperature=0.0),
                            detok=ipc.DetokParams(), eos_token_ids=[0], **kw)


@pytest.fixture
def make_loop(tmp_path):
    contexts, sockets = [], []

    def make(topology: dict, replica: int) -> EngineLoop:
        topology = {"model": {"path": "/m"}, "engine": {"max_num_seqs": 1}, **topology}
        configs = process_configs(msgspec.convert(topology, Topology), str(tmp_path))
        cfg = next(c for c in configs if c.role == "scheduler" and c.replica == replica)
        ctx = zmq.Context()
        contexts.append(ctx)
        if cfg.kv_store is not None:  # a store socket that takes the lookups
            store = ctx.socket(zmq.PULL)
            store.bind(cfg.addresses.kv_store)
            sockets.append(store)  # (held: a collected socket closes)
        loop = EngineLoop(cfg, ctx, logging.getLogger("test-scheduler"))
        if cfg.kv_store is not None:
            wait_until(lambda: loop.kv.of(StoreReads).sock.poll(0, zmq.POLLOUT),
                       "the store socket to connect")
        loop.subscribed = loop.ranks  # (as if every rank subscribed to the plans)
        loop._on_worker_ready(ipc.WorkerReady(num_blocks=32, block_size=BS, max_model_len=512,
                                              kv_namespace=b"ns"))
        return loop

    yield make
    for ctx in contexts:
        ctx.destroy(linger=0)


def _plan(loop: EngineLoop) -> ipc.StepPlan:
    """The newest plan the loop sent."""
    return loop.in_flight[-1].plan


def _answer(loop: EngineLoop, failed: dict[str, ipc.RequestFailure] | None = None) -> None:
    """The worker returns the oldest plan in flight: token 7 for every sampling chunk
    (-1 for the failed ones)."""
    plan = loop.in_flight[0].plan
    failed = failed or {}
    sampled = [-1 if s.rid in failed else 7 for s in plan.seqs if s.sample]
    loop._on_result(ipc.StepResult(plan.step_id, sampled, 0.0, failed=failed))


def _imports(plan: ipc.StepPlan) -> list[ipc.KvImport]:
    """The plan's KV imports, whichever connector's."""
    return [imp for work in plan.kv for imp in work.imports]


def _chunks(plan: ipc.StepPlan) -> dict[str, tuple[int, int]]:
    return {s.rid: (s.start_pos, len(s.token_ids)) for s in plan.seqs}


def _no_import_without_its_chunk(plan: ipc.StepPlan) -> None:
    stray = [imp.rid for imp in _imports(plan) if imp.rid not in _chunks(plan)]
    assert not stray, (f"plan {plan.step_id} imports KV for {stray} without scheduling them "
                       f"(it schedules {sorted(_chunks(plan))})")


def _lost(code: str) -> ipc.RequestFailure:
    return ipc.RequestFailure(code, "the imported blocks were no longer held; retry", 503,
                              recompute=True)


def _run_busy_then_import(loop: EngineLoop, rid: str, first_chunk: tuple[int, int]) -> ipc.KvImport:
    """``busy`` holds the one slot while ``rid`` (its imported blocks settled) waits:
    every plan until busy ends, and the one after, must keep ``rid``'s import for the
    plan with its first chunk; returns that import."""
    assert "busy" in _chunks(_plan(loop)) and rid not in _chunks(_plan(loop))
    for _ in range(6):  # busy's decodes: the run-ahead plan is in flight behind each
        for item in loop.in_flight:
            _no_import_without_its_chunk(item.plan)
        if rid in _chunks(_plan(loop)):
            break
        _answer(loop)
    plan = _plan(loop)
    assert _chunks(plan)[rid] == first_chunk, _chunks(plan)
    imports = [imp for imp in _imports(plan) if imp.rid == rid]
    assert len(imports) == 1, f"the plan scheduling {rid}'s first chunk has no import for it"
    assert imports[0].blocks == loop.requests[rid].block_table[:len(imports[0].blocks)]
    return imports[0]


def _recomputes(loop: EngineLoop, rid: str, code: str, tokens: int) -> None:
    """The worker reports ``rid``'s import lost: it is released and scheduled again from
    position 0 (``tokens`` tokens: its prompt, and a handed-over token), as a request the
    worker has not seen, with no import; it is not finished."""
    while rid not in _chunks(loop.in_flight[0].plan):
        _answer(loop)
    _answer(loop, {rid: _lost(code)})
    while rid not in _chunks(_plan(loop)):
        _answer(loop)
    plan = _plan(loop)
    earlier = [item.plan for item in loop.in_flight]
    assert any(rid in p.released for p in earlier), "the failed request was not released"
    assert _chunks(plan)[rid] == (0, tokens) and rid in plan.new_sampling
    assert not _imports(plan)
    assert not loop.requests[rid].finished and loop.requests[rid].num_computed == 0


def test_a_store_hit_waiting_for_a_slot_imports_with_its_first_chunk_and_recomputes_if_lost(make_loop):
    loop = make_loop({"kv_store": {"size_gib": 1}}, 0)
    loop._on_tokenized(_tokenized("busy", [9, 8, 7], max_tokens=4))
    loop._launch_step()
    loop._on_tokenized(_tokenized("hit", PROMPT, max_tokens=4))
    assert "hit" in loop.kv.of(StoreReads).lookups  # parked: the store was asked
    loop._on_kv_message(StoreHeld("hit", 3))
    loop._on_kv_message(ipc.KvReceived("hit", 0, True))
    assert loop.requests["hit"].num_computed == 3 * BS  # the found blocks count as computed
    imp = _run_busy_then_import(loop, "hit", (3 * BS, len(PROMPT) - 3 * BS))
    assert len(imp.blocks) == 3
    _recomputes(loop, "hit", "kv_store_lost", len(PROMPT))


def test_a_handed_request_waiting_for_a_slot_imports_with_its_first_chunk_and_recomputes_if_lost(make_loop):
    loop = make_loop({"replicas": 2, "disaggregation": {"prefill_replicas": 1,
                                                        "decode_replicas": 1}}, 1)
    loop._on_tokenized(_tokenized("busy", [9, 8, 7], max_tokens=4))
    loop._launch_step()
    first = ipc.TokenOutput("handed", [42], None, cached_tokens=0)
    loop._on_kv_message(ipc.KvHandoff(_tokenized("handed", PROMPT, max_tokens=4), first, 0))
    loop._on_kv_message(ipc.KvReceived("handed", 0, True))
    imp = _run_busy_then_import(loop, "handed", (len(PROMPT), 1))  # the first token
    assert len(imp.blocks) == 4  # the prompt's blocks (50 tokens)
    _recomputes(loop, "handed", "kv_transfer_lost", len(PROMPT) + 1)
    assert loop.requests["handed"].num_generated == 1  # the first token stays the first
