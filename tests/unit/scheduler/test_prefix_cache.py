"""Prefix cache and waiting-queue policy, without processes."""

import pytest

import scheduler.request as request_mod
from protocol.ipc import DetokParams, RequestFailure, SamplingParams, TokenizedReq
from scheduler.block_manager import BlockAllocator
from scheduler.planner import BORROWED_FROM_FAILED, Planner
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
    # b's block 1 (being filled in the same step) hashes like c's, but its tokens differ
    assert c.cached_tokens == 4 and c.block_table[0] == a.block_table[0]
    assert c.block_table[1] not in (a.block_table[1], b.block_table[1])


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


def _run_like_the_engine(planner, reqs):
    """Plan and return steps as the engine loop does (two in flight, the second planned
    around the first); (tokens computed, step number of each request's first token)."""
    _wait(planner, *reqs)
    in_flight, steps, computed, first = [], 0, 0, {}
    while planner.running or planner.waiting or in_flight:
        step = planner.plan(lookahead=bool(in_flight))
        if step.chunks:
            steps += 1
            computed += sum(n for _, n in step.members)
            in_flight.append((steps, step))
        if len(in_flight) == 2 or not step.chunks:
            number, done = in_flight.pop(0)
            for s in planner.postprocess(done, [7] * sum(c.sample for c in done.chunks)):
                first.setdefault(s.req.rid, number)
    return computed, first


def test_burst_with_one_prefix_computes_it_once_and_all_start_in_the_first_step():
    """32 requests with a 256-token shared prefix arrive together. The first one fills
    the prefix blocks and the other 31 share them in the same step (the worker writes a
    step's K/V before attending), so every first token comes from step 1. Before, the
    others waited for the filling step to return: their first tokens came from step 3
    (the prefix was computed once then too; 1376 tokens either way)."""
    bs, prefix, own = 16, list(range(1000, 1256)), 16
    planner = Planner(BlockAllocator(1024), block_size=bs, max_num_seqs=64,
                      max_num_batched_tokens=1024)
    reqs = [_req(f"r{i}", prefix + [10 + i] * own, seq=i) for i in range(32)]
    computed, first = _run_like_the_engine(planner, reqs)
    assert set(first.values()) == {1}
    # the prefix once, each request's own 16 tokens, 3 more decodes each (max_tokens 4)
    assert computed == len(prefix) + 32 * own + 32 * 3
    assert reqs[5].cached_tokens == len(prefix)
    assert planner.allocator.num_free == planner.allocator.total and not planner.filling
    # the shared blocks were cached when their steps returned: a latecomer hits them
    late = _req("late", prefix + [3] * own, seq=99)
    planner.waiting.push(late)
    _step(planner)
    assert late.cached_tokens == len(prefix)


def test_a_prefix_longer_than_the_budget_is_shared_from_the_step_in_flight():
    """The filler's first chunk takes the whole budget; the step planned while it runs
    gives the others the blocks it is filling (the worker runs steps in order)."""
    planner = _planner(blocks=32, bs=4, budget=16)
    prefix = list(range(100, 116))  # 4 full blocks = the whole budget
    a, b = _req("a", prefix + [1, 2], seq=0), _req("b", prefix + [3, 4], seq=1)
    _wait(planner, a, b)
    first = planner.plan()
    assert [c.rid for c in first.chunks] == ["a"] and len(first.writing) == 4
    ahead = planner.plan(lookahead=True)
    got = {c.rid: c for c in ahead.chunks}
    assert got["b"].start_pos == 16 and got["b"].token_ids == [3, 4]
    assert got["b"].new_blocks[:4] == a.block_table[:4] and b.cached_tokens == 16
    assert first.lent == {"a": [b]}
    planner.postprocess(first, [])
    assert set(planner.filling) == set(ahead.writing)  # first's blocks are cached now
    planner.postprocess(ahead, [7, 7])
    assert not planner.filling
    assert planner.allocator.lookup(a.block_key(3, 4), a.block_table[2]) == a.block_table[3]


def test_a_finished_filler_lends_nothing_more():
    """Aborted while its step is in flight, a request's blocks go back to the pool (a later
    plan may hand them to anyone), so nobody may borrow them as 'being filled' any more;
    those already borrowed keep their references and stay allocated."""
    planner = _planner(blocks=64, bs=4, budget=16)
    prefix = list(range(100, 116))
    a, b = _req("a", prefix + [1], seq=0), _req("b", prefix + [2], seq=1)
    _wait(planner, a, b)
    first = planner.plan()
    ahead = planner.plan(lookahead=True)
    assert b.cached_tokens == 16
    planner.finish(a)
    assert not any(entry.filler is a for entry in planner.filling.values())
    assert planner.allocator.num_free == 64 - len(b.block_table)  # b holds the prefix
    d = _req("d", prefix + [3], seq=2)
    planner.waiting.push(d)
    planner.postprocess(first, [])
    planner.postprocess(ahead, [7, 7])
    planner.plan()
    # a's blocks never entered the cache (a finished before its step returned); b's did
    assert d.cached_tokens == 16 and d.block_table[:4] == b.block_table[:4]


def test_borrowers_fail_with_a_filler_that_failed():
    """The worker skips a request that failed on its own, so the blocks it was to fill
    may hold nothing: requests sharing them fail too, with a reason of their own; a
    request with a grammar (which can fail to compile on the worker) lends nothing."""
    planner = _planner(blocks=64, bs=4, budget=16)
    prefix = list(range(100, 116))
    a, b, c = (_req(r, prefix + [i], seq=i) for i, r in enumerate("abc"))
    _wait(planner, a, b, c)
    first = planner.plan()
    ahead = planner.plan(lookahead=True)
    assert {ch.rid for ch in ahead.chunks} == {"a", "b", "c"}
    failure = RequestFailure("grammar_error", "bad")
    out = planner.postprocess(first, [], failed={"a": failure})
    assert [(s.req.rid, s.finish_reason) for s in out] == [("a", "error"), ("b", "error"),
                                                             ("c", "error")]
    assert out[1].failure is BORROWED_FROM_FAILED and b.finished and c.finished
    assert planner.postprocess(ahead, [7, 7, 7]) == []
    assert planner.allocator.num_free == planner.allocator.total and not planner.filling

    # a whole step that failed takes its borrowers in later steps with it
    d, e = _req("d", prefix + [5], seq=5), _req("e", prefix + [6], seq=6)
    _wait(planner, d, e)
    first = planner.plan()
    ahead = planner.plan(lookahead=True)
    assert [r.rid for r in planner.step_failed(first)] == ["d", "e"]
    planner.step_failed(ahead)
    assert planner.allocator.num_free == planner.allocator.total

    import msgspec
    g = _req("g", prefix + [8], seq=8)
    g.req = msgspec.structs.replace(g.req, sampling=SamplingParams(temperature=0.0, grammar="x"))
    h = _req("h", prefix + [9], seq=9)
    planner = _planner(blocks=64, bs=4, budget=64)
    _wait(planner, g, h)
    step = planner.plan()
    assert [ch.rid for ch in step.chunks] == ["g", "h"] and h.cached_tokens == 0
    assert {f.filler.rid for f in planner.filling.values()} == {"h"} and not step.lent


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


def _image(offset, length, content_hash):
    from protocol.ipc import ImageInput

    return ImageInput(pixels=b"", shape=[0], dtype="float32", offset=offset, length=length,
                      content_hash=content_hash)


def test_blocks_covering_different_images_never_share():
    """Same prompt ids (the placeholders of an image at positions 5..9), different image
    content: the text-only block before the image is shared, every block the image
    overlaps is not; the same image again shares them all."""
    planner = _planner()
    prompt = list(range(1, 13))
    a = _req("a", prompt)
    a.req.images.append(_image(5, 5, b"cat"))
    planner.waiting.push(a)
    _step(planner)
    other, same = _req("other", prompt, seq=1), _req("same", prompt, seq=2)
    other.req.images.append(_image(5, 5, b"dog"))
    same.req.images.append(_image(5, 5, b"cat"))
    _wait(planner, other, same)
    _step(planner)
    assert other.cached_tokens == 4 and other.block_table[0] == a.block_table[0]
    assert not set(other.block_table[1:]) & set(a.block_table)
    assert same.cached_tokens == 8
