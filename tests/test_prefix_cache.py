"""Prefix cache and waiting-queue policy, without processes."""

import pytest

import scheduler.request as request_mod
from protocol.ipc import DetokParams, SamplingParams, TokenizedReq
from scheduler.block_manager import BlockAllocator
from scheduler.planner import Planner
from scheduler.request import SchedRequest


def _wait(planner, *reqs):
    for req in reqs:
        planner.waiting.push(req)


def _req(rid, prompt, seq=0, salt=None, priority=0, max_tokens=4, adapter=0):
    tok = TokenizedReq(rid=rid, reply_to="ipc://x", prompt_token_ids=list(prompt),
                       max_tokens=max_tokens, sampling=SamplingParams(temperature=0.0),
                       detok=DetokParams(), eos_token_ids=[0], cache_salt=salt,
                       priority=priority)
    return SchedRequest(tok, seq, adapter=adapter)


def _step(planner, token=7):
    """Plan one step and apply it as the engine loop does (commit after the 'worker')."""
    step = planner.plan()
    planner.step_returned(step)
    for (req, n), chunk in zip(step.members, step.chunks):
        req.step_returned(n, chunk.sample)
        planner.commit(req)
        if chunk.sample:
            req.token_ids.append(token)
            req.num_generated += 1
    return step.chunks


def _finish(planner, req):
    planner.running.remove(req)
    planner.free(req)


def _planner(blocks=32, bs=4, budget=64, max_loras=4):
    return Planner(BlockAllocator(blocks), block_size=bs, max_num_seqs=8,
                   max_num_batched_tokens=budget, max_loras=max_loras)


def test_refcounts_and_lru_eviction():
    alloc = BlockAllocator(3)
    a = alloc.allocate(2)
    alloc.register(a[0], (0, None, (1, 2)), -1)
    alloc.acquire(a[0])                       # shared by a second request
    alloc.free(a)                             # first owner leaves
    assert alloc.num_free == 2                # a[1] plain free, a[0] still referenced
    alloc.free([a[0]])                        # last owner leaves: evictable, still cached
    assert alloc.num_free == 3 and alloc.num_cached == 1
    assert alloc.lookup((0, None, (1, 2)), -1) == a[0]
    taken = alloc.allocate(2)                 # plain blocks go first, cache survives
    assert a[0] not in taken and alloc.num_cached == 1
    taken += alloc.allocate(1)                # now the cached block must be evicted
    assert a[0] in taken and alloc.num_cached == 0 and alloc.evictions == 1
    with pytest.raises(RuntimeError):
        alloc.free([taken[0], taken[0]])


def test_second_request_reuses_full_prefix_blocks_and_reports_cached_tokens():
    planner = _planner()
    prompt = list(range(1, 11))              # 10 tokens: 2 full blocks of 4 + 2
    a = _req("a", prompt)
    planner.waiting.push(a)
    _step(planner)
    b = _req("b", prompt + [99], seq=1)
    planner.waiting.push(b)
    chunks = _step(planner)
    got = {c.rid: c for c in chunks}
    assert got["b"].start_pos == 8 and got["b"].token_ids == [9, 10, 99]
    assert got["b"].kept_blocks == 0 and got["b"].new_blocks[:2] == a.block_table[:2]
    assert b.cached_tokens == 8 and a.cached_tokens == 0
    _finish(planner, a)
    _finish(planner, b)
    assert planner.allocator.num_free == planner.allocator.total


def test_whole_prompt_hit_still_computes_the_last_token():
    planner = _planner()
    prompt = list(range(1, 9))               # exactly 2 full blocks
    a = _req("a", prompt)
    planner.waiting.push(a)
    _step(planner)
    _finish(planner, a)
    b = _req("b", prompt, seq=1)
    planner.waiting.push(b)
    (chunk,) = _step(planner)
    assert chunk.start_pos == 4 and chunk.token_ids == [5, 6, 7, 8] and chunk.sample
    assert b.cached_tokens == 4


def test_different_salts_never_share():
    planner = _planner()
    prompt = list(range(1, 11))
    a = _req("a", prompt, salt="tenant-1")
    planner.waiting.push(a)
    _step(planner)
    b = _req("b", prompt, seq=1, salt="tenant-2")
    c = _req("c", prompt, seq=2, salt="tenant-1")
    _wait(planner, b, c)
    _step(planner)
    assert b.cached_tokens == 0 and not set(b.block_table) & set(a.block_table)
    assert c.cached_tokens == 8


def test_blocks_are_keyed_by_lora_adapter():
    """A block computed under adapter 1 never serves adapter 2 or the base model (their
    KV differ: the adapter changes k and v), and serves adapter 1 again."""
    planner = _planner()
    prompt = list(range(1, 11))
    a = _req("a", prompt, adapter=1)
    planner.waiting.push(a)
    _step(planner)
    base, other, same = (_req("base", prompt, seq=1), _req("b", prompt, seq=2, adapter=2),
                         _req("c", prompt, seq=3, adapter=1))
    _wait(planner, base, other, same)
    step = planner.plan()
    assert base.cached_tokens == 0 and other.cached_tokens == 0 and same.cached_tokens == 8
    assert not set(base.block_table) & set(a.block_table)
    assert not set(other.block_table) & set(a.block_table)
    assert step.new_adapters == {"b": 2, "c": 1}  # the worker learns each request's adapter


def test_at_most_max_loras_adapters_run_and_others_let_later_requests_by():
    planner = _planner(max_loras=1)
    one, two, base, one_again = (_req("one", [1, 2], adapter=1), _req("two", [3, 4], seq=1, adapter=2),
                                 _req("base", [5, 6], seq=2), _req("one2", [7, 8], seq=3, adapter=1))
    _wait(planner, one, two, base, one_again)
    chunks = _step(planner)
    assert [c.rid for c in chunks] == ["one", "base", "one2"]  # adapter 2 waits its turn
    assert list(planner.waiting) == [two]
    for req in (one, one_again):
        planner.finish(req)
    assert [c.rid for c in _step(planner)] == ["base", "two"]  # adapter 1 has left


def test_hash_collisions_are_checked_not_assumed(monkeypatch):
    # every block hashes alike: only the stored token ids and parent block tell them apart
    monkeypatch.setattr(request_mod, "chain_hash", lambda key: 42)
    planner = _planner()
    a = _req("a", [1, 2, 3, 4, 5, 6, 7, 8, 9])
    planner.waiting.push(a)
    _step(planner)
    b = _req("b", [9, 9, 9, 9, 5, 6, 7, 8, 9], seq=1)    # block 1 equal, block 0 differs
    c = _req("c", [1, 2, 3, 4, 0, 0, 0, 0, 9], seq=2)    # block 0 equal only
    _wait(planner, b, c)
    _step(planner)
    assert b.cached_tokens == 0
    # c waited a step: b's blocks hash alike, so c's block 1 looked like one being written
    # (a collision can delay a request, never share a wrong block)
    assert c.cached_tokens is None
    _step(planner)
    assert c.cached_tokens == 4 and c.block_table[0] == a.block_table[0]
    assert c.block_table[1] != a.block_table[1]


def test_freed_cached_blocks_are_reused_after_preemption():
    planner = _planner(blocks=4, bs=4)
    a, b = _req("a", range(1, 5), seq=0), _req("b", range(11, 15), seq=1)
    _wait(planner, a, b)
    for _ in range(5):
        _step(planner)                       # both at 8 tokens + 1: 2 blocks each
    chunks = _step(planner)                  # position 8 needs a 3rd block: b preempted
    assert [c.rid for c in chunks] == ["a"] and b.preemptions == 1
    # a's third block came from the tail of b's freed (cached) blocks; b's head survives
    _finish(planner, a)
    (chunk,) = _step(planner)                # b resumes from its cached first block
    assert chunk.rid == "b" and chunk.start_pos == 4 and chunk.token_ids == [7] * 5
    assert b.cached_tokens == 0              # reported hits count first admission only
    _finish(planner, b)
    assert planner.allocator.num_free == planner.allocator.total


def test_priority_orders_waiting_fcfs_within_a_priority():
    planner = Planner(BlockAllocator(64), block_size=4, max_num_seqs=2, max_num_batched_tokens=64)
    reqs = [_req("low0", [1, 2], seq=0, priority=5), _req("hi0", [1, 3], seq=1, priority=-1),
            _req("mid", [1, 4], seq=2), _req("hi1", [1, 5], seq=3, priority=-1)]
    _wait(planner, *reqs)
    assert [r.rid for r in planner.waiting] == ["hi0", "hi1", "mid", "low0"]
    chunks = _step(planner)
    assert [c.rid for c in chunks] == ["hi0", "hi1"]


def test_request_waits_a_step_for_a_prefix_block_being_written():
    """Two requests with one long shared prefix arriving together: the second does not
    recompute the blocks the first is filling; it waits one step and hits them."""
    planner = _planner(blocks=32, bs=4, budget=64)
    prefix = list(range(100, 116))  # 4 full blocks
    a, b = _req("a", prefix + [1, 2], seq=0), _req("b", prefix + [3, 4], seq=1)
    _wait(planner, a, b)
    first = planner.plan()
    assert [c.rid for c in first.chunks] == ["a"] and len(first.writing) == 4
    ahead = planner.plan(lookahead=True)  # a's blocks still being written: b keeps waiting
    assert [c.rid for c in ahead.chunks] == ["a"] and b in planner.waiting
    for step in (first, ahead):
        planner.step_returned(step)
        for (req, n), chunk in zip(step.members, step.chunks):
            req.step_returned(n, chunk.sample)
            planner.commit(req)
            if chunk.sample:
                req.token_ids.append(7)
                req.num_generated += 1
    third = planner.plan()
    assert [c.rid for c in third.chunks] == ["a", "b"]
    assert b.cached_tokens == 16 and b.block_table[:4] == a.block_table[:4]
    assert sum(planner.blocks_being_written.values()) == len(third.writing)


def test_prompt_logprobs_request_computes_its_whole_prompt_but_shares_its_blocks():
    import msgspec

    planner = _planner()
    prompt = list(range(1, 11))
    a = _req("a", prompt)
    planner.waiting.push(a)
    _step(planner)
    wants = _req("wants", prompt + [99], seq=1)
    wants.req = msgspec.structs.replace(
        wants.req, sampling=SamplingParams(temperature=0.0, prompt_logprobs=0))
    planner.waiting.push(wants)
    got = {c.rid: c for c in _step(planner)}
    assert got["wants"].start_pos == 0 and len(got["wants"].token_ids) == 11
    assert wants.cached_tokens == 0
    _finish(planner, a)
    # its own full blocks (of a prompt nobody cached before) serve later requests
    fresh = list(range(50, 61))
    first = _req("first", fresh, seq=2)
    first.req = wants.req.__class__(**{**msgspec.structs.asdict(wants.req), "rid": "first",
                                       "prompt_token_ids": fresh})
    planner.waiting.push(first)
    _step(planner)
    c = _req("c", fresh + [5], seq=3)
    planner.waiting.push(c)
    got = {ch.rid: ch for ch in _step(planner)}
    assert got["c"].start_pos == 8 and c.block_table[:2] == first.block_table[:2]


def test_a_hit_sends_its_prompt_ids_once_to_requests_that_read_their_history():
    """Penalties and min_tokens read the whole history: the chunk after a hit carries the
    cached ids, once; a request that reads none pays nothing."""
    import msgspec

    planner = _planner()
    prompt = list(range(1, 11))
    a = _req("a", prompt)
    planner.waiting.push(a)
    _step(planner)
    plain = _req("plain", prompt, seq=1)
    penalized = _req("pen", prompt, seq=2, max_tokens=8)
    penalized.req = msgspec.structs.replace(
        penalized.req, sampling=SamplingParams(temperature=0.0, presence_penalty=1.0))
    _wait(planner, plain, penalized)
    got = {c.rid: c for c in _step(planner)}
    assert got["plain"].start_pos == got["pen"].start_pos == 8
    assert got["plain"].context == [] and got["pen"].context == prompt[:8]
    got = {c.rid: c for c in _step(planner)}
    assert got["pen"].context == []  # the worker has it now
