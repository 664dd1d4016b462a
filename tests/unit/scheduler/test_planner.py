"""Scheduler policy without processes: chunking, block accounting, preemption."""

import msgspec

from protocol.ipc import DetokParams, SamplingParams, TokenizedReq
from scheduler.block_manager import BlockAllocator
from scheduler.planner import Planner
from scheduler.request import SchedRequest


def _wait(planner, *reqs):
    for req in reqs:
        planner.waiting.push(req)


def _req(rid: str, prompt_len: int, max_tokens: int = 8, seq: int = 0) -> SchedRequest:
    tok = TokenizedReq(rid=rid, reply_to="ipc://x", prompt_token_ids=list(range(1, prompt_len + 1)),
                       max_tokens=max_tokens, sampling=SamplingParams(temperature=0.0),
                       detok=DetokParams(), eos_token_ids=[0])
    return SchedRequest(tok, seq)


def _run_step(planner: Planner, sampled_token: int = 7) -> list:
    """Apply a plan as the engine loop would after the worker answers."""
    step = planner.plan()
    planner.step_returned(step)
    for (req, n), chunk in zip(step.members, step.chunks):
        req.step_returned(n, chunk.sample)
        if chunk.sample:
            req.token_ids.append(sampled_token)
            req.num_generated += 1
    return step.chunks


def test_allocator_accounting():
    alloc = BlockAllocator(4)
    a = alloc.allocate(3)
    assert a == [0, 1, 2] and alloc.num_free == 1
    assert alloc.allocate(2) is None and alloc.num_free == 1
    alloc.free(a)
    assert alloc.num_free == 4


def test_long_prompt_is_chunked_and_decodes_share_the_step():
    planner = Planner(BlockAllocator(64), block_size=4, max_num_seqs=8, max_num_batched_tokens=16)
    short = _req("short", 3)
    planner.waiting.push(short)
    chunks = _run_step(planner)
    assert [(c.rid, len(c.token_ids), c.sample) for c in chunks] == [("short", 3, True)]
    long = _req("long", 40, seq=1)
    planner.waiting.push(long)
    chunks = _run_step(planner)
    # the running decode goes first, the new prompt gets the rest of the budget
    assert [(c.rid, len(c.token_ids), c.start_pos, c.sample) for c in chunks] == [
        ("short", 1, 3, True), ("long", 15, 0, False)]
    chunks = _run_step(planner)
    assert [(c.rid, len(c.token_ids), c.start_pos, c.sample) for c in chunks] == [
        ("short", 1, 4, True), ("long", 15, 15, False)]
    chunks = _run_step(planner)
    assert [(c.rid, len(c.token_ids), c.start_pos, c.sample) for c in chunks] == [
        ("short", 1, 5, True), ("long", 10, 30, True)]
    # block tables cover every position written so far
    assert len(long.block_table) == 10 and len(short.block_table) == 2


def test_preemption_frees_blocks_and_resumes_with_generated_tokens():
    planner = Planner(BlockAllocator(4), block_size=4, max_num_seqs=8, max_num_batched_tokens=64)
    a, b = _req("a", 4, seq=0), _req("b", 4, seq=1)
    _wait(planner, a, b)
    _run_step(planner)          # both prefilled: 1 block each, 2 free
    _run_step(planner)          # decode pos 4: each needs a 2nd block -> 0 free
    assert planner.allocator.num_free == 0
    for _ in range(3):          # positions 5..7 fit in the 2nd blocks
        _run_step(planner)
    # position 8 needs a third block each: b (latest arrival) is preempted
    chunks = _run_step(planner)
    assert [c.rid for c in chunks] == ["a"]
    assert b in planner.waiting and b.num_computed == 0 and b.block_table == []
    assert b.token_ids[4:] == [7] * 5 and b.preemptions == 1   # generated tokens kept
    planner.running.remove(a)
    planner.free(a)
    chunks = _run_step(planner)
    # b recomputes its prompt + generated tokens in one chunk and samples again
    assert [(c.rid, len(c.token_ids), c.sample) for c in chunks] == [("b", 9, True)]


def test_max_num_seqs_limits_admission():
    planner = Planner(BlockAllocator(64), block_size=4, max_num_seqs=2, max_num_batched_tokens=64)
    _wait(planner, *(_req(str(i), 2, seq=i) for i in range(3)))
    chunks = _run_step(planner)
    assert [c.rid for c in chunks] == ["0", "1"] and len(planner.waiting) == 1


def test_finish_reasons():
    r = _req("r", 2, max_tokens=3)
    r.num_generated = 1
    assert r.finish_reason_after(0) == "stop"          # eos
    assert r.finish_reason_after(5) is None
    r.num_generated = 3
    assert r.finish_reason_after(5) == "length"


def test_lookahead_plan_feeds_a_placeholder_and_never_preempts():
    """While step N is in flight, step N+1 continues chunked prompts, feeds the token N
    samples as PLACEHOLDER_TOKEN at the next position, and only uses free blocks."""
    from protocol.ipc import PLACEHOLDER_TOKEN

    planner = Planner(BlockAllocator(6), block_size=4, max_num_seqs=8, max_num_batched_tokens=6)
    a, b = _req("a", 3, max_tokens=8, seq=0), _req("b", 9, max_tokens=8, seq=1)
    _wait(planner, a, b)
    first = planner.plan()                       # a's prompt (3) + b's first 3 prompt tokens
    assert [(c.rid, c.start_pos, c.sample) for c in first.chunks] == [("a", 0, True), ("b", 0, False)]
    ahead = planner.plan(lookahead=True)         # a decodes its in-flight token; b continues
    assert [(c.rid, c.token_ids, c.start_pos, c.sample) for c in ahead.chunks] == [
        ("a", [PLACEHOLDER_TOKEN], 3, True), ("b", [4, 5, 6, 7, 8], 3, False)]
    # a's sample from step 1 arrives: it becomes the real token at position 3
    for (req, n), chunk in zip(first.members, first.chunks):
        req.step_returned(n, chunk.sample)
    a.token_ids.append(42)
    a.num_generated += 1
    assert a.num_pending == 1 and a.samples_in_flight == 1  # the placeholder step still flies
    # out of blocks (a 2, b 2 of 6 ... b needs a third for position 8): no preemption ahead
    planner.allocator.allocate(planner.allocator.num_free)
    third = planner.plan(lookahead=True)
    assert third.chunks == [] and third.preempted == [] and a in planner.running and b in planner.running
    assert a.block_table and b.block_table


def test_lookahead_skips_a_request_whose_last_token_is_in_flight():
    planner = Planner(BlockAllocator(16), block_size=4, max_num_seqs=8, max_num_batched_tokens=64)
    a = _req("a", 3, max_tokens=1)
    planner.waiting.push(a)
    assert [c.rid for c in planner.plan().chunks] == ["a"]
    assert planner.plan(lookahead=True).chunks == []


class _WorkerTables:
    """The worker's side of the block-table diffs (as ``ModelRunner._apply_blocks``)."""

    def __init__(self) -> None:
        self.tables: dict[str, list[int]] = {}

    def apply(self, step) -> None:
        for rid in step.released:
            self.tables.pop(rid, None)
        for c in step.chunks:
            table = self.tables.setdefault(c.rid, [])
            assert len(table) >= c.kept_blocks
            del table[c.kept_blocks:]
            table.extend(c.new_blocks)


def test_plans_carry_block_diffs_that_rebuild_every_table_through_preemption():
    """Every step's chunks name only blocks the worker was not sent yet, and replaying the
    diffs gives exactly the planner's tables, across growth, preemption and re-admission."""
    planner = Planner(BlockAllocator(6), block_size=4, max_num_seqs=8, max_num_batched_tokens=64)
    a, b = _req("a", 6, max_tokens=12, seq=0), _req("b", 6, max_tokens=12, seq=1)
    _wait(planner, a, b)
    worker = _WorkerTables()
    preempted = False
    for _ in range(14):
        step = planner.plan()
        worker.apply(step)
        preempted |= bool(step.preempted)
        for c in step.chunks:
            req = a if c.rid == "a" else b
            assert worker.tables[c.rid] == req.block_table
            if c.kept_blocks:
                assert len(c.new_blocks) <= 1  # a decode adds at most one block
        planner.postprocess(step, [7] * sum(c.sample for c in step.chunks))
    assert preempted  # 6 blocks cannot hold both to the end: b was evicted and came back


def test_decode_plan_size_does_not_grow_with_context():
    """The encoded decode step is the same size at 64 and 4096 tokens of context, up to
    the msgpack width of its integers (a whole table would add ~2 KB at 4096)."""
    import msgspec

    from protocol.ipc import StepPlan

    sizes = []
    for context in (64, 4096):
        planner = Planner(BlockAllocator(context // 4 + 4), block_size=4, max_num_seqs=1,
                          max_num_batched_tokens=context)
        planner.waiting.push(_req("r", context, max_tokens=4))
        planner.postprocess(planner.plan(), [7])
        step = planner.plan()
        sizes.append(len(msgspec.msgpack.encode(StepPlan(2, step.chunks))))
    assert sizes[1] - sizes[0] <= 8, sizes


def test_postprocess_appends_finishes_and_releases_in_the_next_plan():
    planner = Planner(BlockAllocator(16), block_size=4, max_num_seqs=8, max_num_batched_tokens=64)
    a, b = _req("a", 3, max_tokens=2, seq=0), _req("b", 3, max_tokens=8, seq=1)
    _wait(planner, a, b)
    out = planner.postprocess(planner.plan(), [5, 6])
    assert [(s.req.rid, s.token, s.row, s.finish_reason) for s in out] == [
        ("a", 5, 0, None), ("b", 6, 1, None)]
    out = planner.postprocess(planner.plan(), [9, 0])  # a hits max_tokens, b samples eos
    assert [(s.req.rid, s.finish_reason) for s in out] == [("a", "length"), ("b", "stop")]
    assert a.token_ids[3:] == [5, 9] and b.token_ids[3:] == [6, 0]
    assert a.finished and b.finished and not planner.running
    assert planner.allocator.num_free == 16
    c = _req("c", 2, seq=2)
    planner.waiting.push(c)
    assert planner.plan().released == ["a", "b"]  # the worker forgets them with the next step


def test_postprocess_drops_the_sample_of_a_request_finished_while_in_flight():
    """An abort lands while a step and its run-ahead step are in flight: neither step's
    sample reaches the request, and its blocks are back at once."""
    planner = Planner(BlockAllocator(16), block_size=4, max_num_seqs=8, max_num_batched_tokens=64)
    a, b = _req("a", 3, seq=0), _req("b", 3, seq=1)
    _wait(planner, a, b)
    first = planner.plan()
    ahead = planner.plan(lookahead=True)
    planner.finish(a)
    assert planner.allocator.num_free == 16 - len(b.block_table)
    assert [s.req.rid for s in planner.postprocess(first, [4, 5])] == ["b"]
    assert [s.req.rid for s in planner.postprocess(ahead, [6, 7])] == ["b"]
    assert a.token_ids == [1, 2, 3] and b.token_ids[3:] == [5, 7]


def test_step_failed_finishes_its_live_requests():
    planner = Planner(BlockAllocator(16), block_size=4, max_num_seqs=8, max_num_batched_tokens=64)
    a = _req("a", 3)
    planner.waiting.push(a)
    step = planner.plan()
    assert planner.step_failed(step) == [a]
    assert a.finished and planner.allocator.num_free == 16 and a.steps_in_flight == 0


def test_a_request_that_failed_on_its_own_ends_alone_and_caches_nothing():
    """A StepResult that names a failed rid: that request ends with its failure, its
    blocks (the worker may not have written them) never reach the prefix cache; the
    others in the step append their tokens."""
    from protocol.ipc import RequestFailure

    planner = Planner(BlockAllocator(64), block_size=4, max_num_seqs=8, max_num_batched_tokens=64)
    bad, good = _req("bad", 9), _req("good", 9, seq=1)
    good.token_ids = [100 + t for t in good.token_ids]  # no prefix shared with bad
    _wait(planner, bad, good)
    step = planner.plan()
    why = RequestFailure("constraint_conflict", "both cannot hold", 400, "min_tokens")
    out = planner.postprocess(step, [-1, 42], {"bad": why})
    assert [(s.req.rid, s.token, s.finish_reason, s.failure) for s in out] == [
        ("bad", -1, "error", why), ("good", 42, None, None)]
    assert bad.finished and bad not in planner.running and planner.released == ["bad"]
    assert good.token_ids[-1] == 42 and good.num_registered == 2
    assert planner.allocator.num_cached == 2  # good's two full blocks, none of bad's


def test_prefix_hits_count_only_admitted_requests():
    """A request that matches cached blocks but cannot be admitted (its other blocks do
    not fit) gives the matches back; /health's prefix_hit_blocks must not count them on
    every retry."""
    planner = Planner(BlockAllocator(4), block_size=4, max_num_seqs=8,
                      max_num_batched_tokens=64)
    first = _req("first", 9, max_tokens=1)
    planner.waiting.push(first)
    step = planner.plan()
    for s in planner.postprocess(step, [7]):
        assert s.finish_reason == "length"
    assert planner.allocator.num_cached == 2  # its two full prompt blocks
    too_big = SchedRequest(TokenizedReq(
        rid="too_big", reply_to="ipc://x", prompt_token_ids=list(range(1, 21)), max_tokens=1,
        sampling=SamplingParams(temperature=0.0), detok=DetokParams(), eos_token_ids=[0]), 1)
    planner.waiting.push(too_big)
    for _ in range(3):  # matches the 2 cached blocks, needs 3 more, 2 are free
        assert not planner.plan().chunks
    assert planner.prefix_hit_blocks == 0
    planner.waiting.remove(too_big)
    fits = _req("fits", 9, max_tokens=1, seq=2)
    planner.waiting.push(fits)
    assert [c.start_pos for c in planner.plan().chunks] == [8]
    assert planner.prefix_hit_blocks == 2


def test_an_encoder_prompt_is_never_split_it_waits_for_a_step_with_room():
    """``whole_prompts`` (a bidirectional encoder): a prompt that does not fit the step's
    remaining budget waits for the next step rather than being chunked."""
    from protocol.ipc import PoolingParams

    def pooled(rid, n):
        req = _req(rid, n, max_tokens=1)
        req.req = msgspec.structs.replace(req.req, pooling=PoolingParams())
        return req

    planner = Planner(BlockAllocator(64), block_size=4, max_num_seqs=8, max_num_batched_tokens=16,
                      whole_prompts=True)
    a = pooled("a", 10)
    _wait(planner, a, pooled("b", 10), pooled("c", 6))
    first = _run_step(planner)
    assert [(c.rid, c.start_pos, len(c.token_ids)) for c in first] == [("a", 0, 10)]
    planner.finish(a)  # its one output ends it (the engine loop's rule for pooling)
    second = _run_step(planner)
    assert [(c.rid, c.start_pos, len(c.token_ids)) for c in second] == [("b", 0, 10), ("c", 0, 6)]


def _with_images(req: SchedRequest, *spans: tuple[int, int, bytes]) -> SchedRequest:
    from protocol.ipc import ImageInput

    for offset, length, tag in spans:
        req.req.images.append(ImageInput(pixels=b"px-" + tag, shape=[3, 2, 2], dtype="float32",
                                         offset=offset, length=length, content_hash=tag))
    return req


def _carried(chunk) -> list[tuple[bytes, bool]]:
    """(content hash, pixels carried) of each image a chunk names."""
    return [(im.content_hash, bool(im.pixels)) for im in chunk.images]


def test_an_images_pixels_go_with_the_first_chunk_that_needs_it():
    """Chunked prefill splits the first image's span (3..10) over two chunks: its pixels go
    with the first, the second names it without them; the second image (14..17) goes
    with the third; the last chunk overlaps no image. After preemption the request is
    recomputed from 0 and the pixels go again (the worker may have dropped them)."""
    planner = Planner(BlockAllocator(64), block_size=4, max_num_seqs=8, max_num_batched_tokens=6)
    req = _with_images(_req("a", 20, max_tokens=4), (3, 8, b"cat"), (14, 4, b"dog"))
    planner.waiting.push(req)
    got = [_carried(_run_step(planner)[0]) for _ in range(5)]
    assert got == [[(b"cat", True)], [(b"cat", False)], [(b"dog", True)], [], []]
    from scheduler.planner import PlannedStep

    planner._preempt(req, PlannedStep())  # as the planner does when blocks run out
    chunk = _run_step(planner)[0]
    assert chunk.start_pos == 0 and _carried(chunk) == [(b"cat", True)]


def test_a_prefix_hit_inside_an_images_span_sends_its_pixels():
    """A second request with the same prompt and image hits the cache for its first two
    blocks (0..7, the span 3..10 half cached): its first chunk starts at 8, inside the
    span, and carries the pixels (the tower encodes the whole image)."""
    from tests.unit.scheduler.test_prefix_cache import _step

    planner = Planner(BlockAllocator(64), block_size=4, max_num_seqs=8, max_num_batched_tokens=64)
    a = _with_images(_req("a", 13, max_tokens=4), (3, 8, b"cat"))
    planner.waiting.push(a)
    _step(planner)
    b = _with_images(_req("b", 13, max_tokens=4, seq=1), (3, 8, b"cat"))
    planner.waiting.push(b)
    chunks = _step(planner)
    first = next(c for c in chunks if c.rid == "b")
    assert b.cached_tokens == 12 and first.start_pos == 12 and _carried(first) == []
    c = _with_images(_req("c", 13, max_tokens=4, seq=2), (3, 8, b"cow"))
    planner.waiting.push(c)
    chunks = _step(planner)
    first = next(ch for ch in chunks if ch.rid == "c")
    assert c.cached_tokens == 0 and _carried(first) == [(b"cow", True)]
    d = _with_images(_req("d", 13, max_tokens=4, seq=3), (3, 8, b"cat"))
    d.token_ids[9] = 99  # the third block differs: the hit ends at 8, inside the span
    d.req.prompt_token_ids[9] = 99
    planner.waiting.push(d)
    chunks = _step(planner)
    first = next(ch for ch in chunks if ch.rid == "d")
    assert d.cached_tokens == 8 and first.start_pos == 8 and _carried(first) == [(b"cat", True)]


def _whole(req: SchedRequest, *spans: tuple[int, int, bytes]) -> SchedRequest:
    """``_with_images`` with Gemma 3's ``whole`` spans (computed in one chunk)."""
    _with_images(req, *spans)
    req.req.images[:] = [msgspec.structs.replace(im, whole=True) for im in req.req.images]
    return req


def test_chunked_prefill_never_splits_a_whole_image():
    """Budget 8: a first chunk 0..7 would end inside the span 3..10, so it stops before
    it (0..2); the next holds the whole span and no more (3..10); the one after (11..18)
    holds the second span (14..17) whole."""
    planner = Planner(BlockAllocator(64), block_size=4, max_num_seqs=8, max_num_batched_tokens=8)
    req = _whole(_req("a", 20, max_tokens=4), (3, 8, b"cat"), (14, 4, b"dog"))
    planner.waiting.push(req)
    spans = []
    for _ in range(4):
        chunk = _run_step(planner)[0]
        spans.append((chunk.start_pos, chunk.start_pos + len(chunk.token_ids), _carried(chunk)))
    assert spans == [(0, 3, []), (3, 11, [(b"cat", True)]), (11, 19, [(b"dog", True)]),
                     (19, 20, [])]


def test_a_whole_image_waits_for_room_beside_decodes():
    planner = Planner(BlockAllocator(64), block_size=4, max_num_seqs=8, max_num_batched_tokens=8)
    a = _req("a", 3, max_tokens=8)
    planner.waiting.push(a)
    _run_step(planner)  # a decodes from now on: one token a step
    b = _whole(_req("b", 12, max_tokens=4, seq=1), (0, 8, b"cat"))
    planner.waiting.push(b)
    chunks = _run_step(planner)
    assert [(c.rid, c.start_pos, len(c.token_ids)) for c in chunks] == [("a", 3, 1)]
    assert b in planner.waiting  # 7 tokens of room: not the whole image
    planner.finish(a)
    chunks = _run_step(planner)
    assert [(c.rid, c.start_pos, len(c.token_ids)) for c in chunks] == [("b", 0, 8)]


def test_a_prefix_hit_never_ends_inside_a_whole_image():
    """The same prompt and image again: a LLaVA image lets the hit end inside its span
    (test above); a whole one cuts it back to the block holding its first token (block 0:
    positions 0..3, the span starting at 3), so the image is computed again, whole."""
    from tests.unit.scheduler.test_prefix_cache import _step

    planner = Planner(BlockAllocator(64), block_size=4, max_num_seqs=8, max_num_batched_tokens=64)
    a = _whole(_req("a", 13, max_tokens=4), (5, 8, b"cat"))
    planner.waiting.push(a)
    _step(planner)
    b = _whole(_req("b", 13, max_tokens=4, seq=1), (5, 8, b"cat"))
    planner.waiting.push(b)
    first = next(c for c in _step(planner) if c.rid == "b")
    assert b.cached_tokens == 4 and first.start_pos == 4 and _carried(first) == [(b"cat", True)]
    assert b.whole_blocks(3, 4) == 1 and b.whole_blocks(1, 4) == 1 and b.chunk_size(4, 5) == 1


def test_chunks_carry_the_m_rope_shift_of_the_images_before_them():
    """Qwen2-VL's gridded images: a 2x4 image (8 tokens at 3..10) advances M-RoPE's
    positions by 4, a 1x4 one (4 tokens at 14..17) by 4: gains -4 and 0. Each chunk
    carries the gains of the images that end at or before its start (an image it
    overlaps is its own to position); every decode carries them all."""
    planner = Planner(BlockAllocator(64), block_size=4, max_num_seqs=8, max_num_batched_tokens=6)
    req = _with_images(_req("a", 20, max_tokens=4), (3, 8, b"cat"), (14, 4, b"dog"))
    req.req.images[:] = [msgspec.structs.replace(im, grid=grid) for im, grid in
                         zip(req.req.images, ([1, 2, 4], [1, 1, 4]))]
    assert [im.rope_gain for im in req.req.images] == [-4, 0]
    planner.waiting.push(req)
    got = [(c.start_pos, c.rope_shift) for c in (_run_step(planner)[0] for _ in range(6))]
    assert got == [(0, 0), (6, 0), (12, -4), (18, -4), (20, -4), (21, -4)]
