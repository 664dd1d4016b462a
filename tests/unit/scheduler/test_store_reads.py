"""The scheduler's half of the shared KV store (scheduler/kv_connectors/kv_store.py),
against a fake store socket: what a parked request becomes for each answer (or none)."""

from __future__ import annotations

import time

import msgspec
import zmq

from cluster.process_config import process_configs
from cluster.topology import Topology
from protocol import ipc
from protocol import kv_store as msg
from scheduler.block_manager import BlockAllocator
from scheduler.planner import Planner
from scheduler.request import SchedRequest
from scheduler.kv_connectors.kv_store import StoreReads, store_chain

BS = 16


def _req(rid: str, prompt_len: int = 50, salt: str | None = None, **sampling) -> SchedRequest:
    tok = ipc.TokenizedReq(rid=rid, reply_to="ipc://x",
                           prompt_token_ids=list(range(1, prompt_len + 1)), max_tokens=4,
                           sampling=ipc.SamplingParams(temperature=0.0, **sampling),
                           detok=ipc.DetokParams(), eos_token_ids=[0], cache_salt=salt)
    return SchedRequest(tok, 0)


def _setup(tmp_path, timeout: float = 0.3):
    topo = msgspec.convert({"model": {"path": "/m"}, "kv_store": {
        "size_gib": 1, "lookup_timeout_s": timeout}}, Topology)
    cfg = next(c for c in process_configs(topo, str(tmp_path)) if c.role == "scheduler")
    ctx = zmq.Context()
    fake_store = ctx.socket(zmq.PULL)
    fake_store.bind(cfg.addresses.kv_store)
    reads = StoreReads(ctx, cfg)
    reads.namespace = b"ns"
    time.sleep(0.05)  # the PUSH connects
    return ctx, fake_store, reads, Planner(BlockAllocator(32), BS, 8, 256)


def _lookup(sock) -> msg.StoreLookup:
    assert sock.poll(2000)
    return msgspec.msgpack.decode(sock.recv(), type=msg.StoreInbound)


def test_chain_hashes_differ_by_salt_and_prefix_and_agree_across_requests():
    a, b = _req("a"), _req("b")
    from scheduler.kv_connectors.kv_store import store_chains
    assert store_chains(a, 3, BS) == store_chains(b, 3, BS)
    assert store_chains(_req("c", salt="t"), 1, BS) != store_chains(a, 1, BS)
    assert store_chain(b"x", None, [1, 2]) != store_chain(b"y", None, [1, 2])


def test_chain_hashes_hold_the_images_a_block_overlaps():
    """Two images behind the same placeholder ids never share a stored block: the blocks
    an image overlaps (and every block after: chained) differ, the ones before agree."""
    from scheduler.kv_connectors.kv_store import store_chains

    def with_image(rid: str, content: bytes) -> SchedRequest:
        req = _req(rid)
        req.req.images.append(ipc.ImageInput(b"", [3], "float32", 20, 8, content))
        return req

    cat, dog, cat2 = with_image("a", b"cat"), with_image("b", b"dog"), with_image("c", b"cat")
    assert store_chains(cat, 3, BS) == store_chains(cat2, 3, BS)
    first = [store_chains(r, 3, BS)[0] for r in (cat, dog, _req("d"))]  # (memoised: 3 each)
    assert first[0] == first[1] == first[2]
    assert store_chains(cat, 3, BS)[1] != store_chains(dog, 3, BS)[1]
    assert store_chains(cat, 3, BS)[2] != store_chains(dog, 3, BS)[2]
    assert store_chains(cat, 3, BS)[1] != store_chains(_req("e"), 3, BS)[1]


def test_a_parked_request_settles_as_hit_miss_or_is_dropped(tmp_path):
    ctx, store, reads, planner = _setup(tmp_path)
    try:
        hit, miss, gone = _req("hit"), _req("miss"), _req("gone")
        for r in (hit, miss, gone):
            assert reads.park(r, planner)
        looks = [_lookup(store) for _ in range(3)]
        assert [len(x.hashes) for x in looks] == [3, 3, 3]  # (50 - 1) // 16 full blocks
        reads.on_held(msg.StoreHeld("hit", 2))
        reads.on_received(ipc.KvReceived("hit", 0, True))
        reads.on_held(msg.StoreHeld("miss", 0))
        gone.finished = True  # aborted while parked
        out = reads.settle(planner)
        assert [r.rid for r in out] == ["hit", "miss"] and not reads.lookups
        assert hit.num_computed == 2 * BS and len(hit.block_table) == 2
        assert miss.num_computed == 0 and not miss.block_table
        chunk = ipc.SeqChunk("hit", hit.token_ids[2 * BS:], 2 * BS, [], True)
        assert reads.take_imports([]) == []  # a plan without it: the import waits
        imports = reads.take_imports([chunk])
        assert imports == [ipc.KvImport("hit", hit.block_table)]
        assert reads.metrics.hits._value.get() == 2
        planner.finish(hit)
        assert planner.allocator.num_free == planner.allocator.total
    finally:
        ctx.destroy(linger=0)


def test_a_silent_store_costs_one_deadline_then_is_not_asked(tmp_path):
    ctx, store, reads, planner = _setup(tmp_path, timeout=0.2)
    try:
        first = _req("first")
        assert reads.park(first, planner)
        assert reads.settle(planner) == []  # still within the deadline
        time.sleep(0.25)
        assert reads.settle(planner) == [first] and first.num_computed == 0
        assert not reads.park(_req("second"), planner)  # down: a miss without asking
        # prompt logprobs need every position: never parked
        reads.down_until = 0.0
        assert not reads.park(_req("lp", prompt_logprobs=1), planner)
    finally:
        ctx.destroy(linger=0)


def test_a_store_hit_never_ends_inside_a_whole_image(tmp_path):
    """Gemma 3 images (``whole``) at 10..21 and 40..51: the lookup asks for the blocks up
    to the one holding the second's first token (2 of the 3 full blocks); a store that
    holds only the first block would end the hit inside the first image, so it runs as a
    miss."""
    ctx, store, reads, planner = _setup(tmp_path)
    try:
        req = _req("r")
        req.req.images.extend([ipc.ImageInput(b"", [3], "float32", 10, 12, b"cat", True),
                               ipc.ImageInput(b"", [3], "float32", 40, 12, b"dog", True)])
        assert reads.park(req, planner) and len(_lookup(store).hashes) == 2
        reads.on_held(msg.StoreHeld("r", 1))
        reads.on_received(ipc.KvReceived("r", 0, True))
        assert reads.settle(planner) == [req]
        assert req.num_computed == 0 and not req.block_table
        assert reads.metrics.hits._value.get() == 0
    finally:
        ctx.destroy(linger=0)
