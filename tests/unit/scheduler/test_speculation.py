"""Speculative decoding in the scheduler: the n-gram drafter, drafts on decode chunks with
KV slots reserved for them, kept drafts appended and checked for the end one by one,
rejected drafts' slots never offered to the prefix cache, no run-ahead for a request
whose drafts are in flight, and the counts."""

from __future__ import annotations

import pytest

from cluster.topology import SpeculativeSpec
from protocol.ipc import DetokParams, SamplingParams, TokenizedReq
from scheduler.block_manager import BlockAllocator, chain_hash
from scheduler.planner import Planner
from scheduler.request import SchedRequest
from scheduler.speculation import Drafts, NgramIndex

BS = 4


def _req(rid: str, prompt: list[int], max_tokens: int = 30, grammar: str | None = None) -> SchedRequest:
    tok = TokenizedReq(rid=rid, reply_to="ipc://x", prompt_token_ids=prompt, max_tokens=max_tokens,
                       sampling=SamplingParams(temperature=0.0, grammar=grammar),
                       detok=DetokParams(), eos_token_ids=[0])
    return SchedRequest(tok, 0)


def _planner(k: int = 3, **kw) -> Planner:
    spec = SpeculativeSpec(num_speculative_tokens=k, prompt_lookup_min=2, prompt_lookup_max=3, **kw)
    return Planner(BlockAllocator(64), block_size=BS, max_num_seqs=8, max_num_batched_tokens=64,
                   speculative=spec)


def test_ngram_proposes_what_followed_the_latest_longest_match():
    idx = NgramIndex(2, 3)
    ids = [1, 2, 3, 4, 5, 9, 2, 3, 7, 8, 1, 2, 3]
    # the suffix [1, 2, 3] occurred at 0 (followed by 4, 5, 9); [2, 3] later at 6 (7, 8)
    assert idx.propose(ids, 3) == [4, 5, 9]
    ids += [4]
    assert idx.propose(ids, 2) == [5, 9]  # [2, 3, 4] at 1, incrementally indexed
    assert NgramIndex(2, 3).propose([5, 6, 7, 8], 3) == []  # nothing recurs
    assert NgramIndex(1, 1).propose([5, 6, 5], 4) == [6, 5]  # never past the end


def test_copy_heavy_decode_carries_drafts_and_kept_ones_are_appended():
    planner = _planner(k=3)
    text = [10, 11, 12, 13, 14, 15, 16]
    req = _req("a", text + [20] + text[:3])
    planner.waiting.push(req)
    first = planner.plan()
    assert first.chunks[0].draft == []  # the prompt's chunk never drafts
    planner.postprocess(first, [13])
    step = planner.plan()
    (chunk,) = step.chunks
    assert chunk.token_ids == [13] and chunk.draft == [14, 15, 16]
    assert req.speculating and req.num_pending == 0
    # KV slots for the token and its three drafts
    assert len(req.block_table) * BS >= chunk.start_pos + 4
    assert planner.plan(lookahead=True).chunks == []  # no run-ahead while it speculates
    out = planner.postprocess(step, [99], accepted=[2])
    assert [(s.drafted, s.token) for s in out] == [([14, 15], 99)]
    assert req.token_ids[-3:] == [14, 15, 99] and req.num_generated == 4
    assert req.num_computed == chunk.start_pos + 3 == req.num_scheduled
    assert (req.spec_drafted, req.spec_accepted) == (3, 2)
    counts = planner.drafts.counts
    assert (counts.drafts, counts.draft_tokens, counts.accepted_tokens) == (1, 3, 2)
    assert counts.accepted_per_pos == [1, 1, 0]
    nxt = planner.plan().chunks[0]
    assert nxt.start_pos == chunk.start_pos + 3 and nxt.token_ids == [99]


def test_a_kept_draft_that_ends_the_request_ends_it_there():
    planner = _planner(k=3)
    req = _req("a", [7, 5, 6, 9, 0, 8, 7, 5], max_tokens=10)
    planner.waiting.push(req)
    planner.postprocess(planner.plan(), [6])
    step = planner.plan()
    assert step.chunks[0].draft == [9, 0, 8]
    out = planner.postprocess(step, [42], accepted=[3])
    assert [(s.drafted, s.token, s.finish_reason) for s in out] == [([9], 0, "stop")]
    assert req.finished and req.token_ids[-1] == 0


def test_drafts_stay_within_max_tokens_and_the_budget():
    planner = _planner(k=8)
    text = list(range(10, 30))
    req = _req("a", text + text[:2], max_tokens=4)
    planner.waiting.push(req)
    planner.postprocess(planner.plan(), [12])
    step = planner.plan()
    assert len(step.chunks[0].draft) == 2  # 1 generated, this step's own token, 2 drafts


def test_rejected_draft_slots_never_enter_the_prefix_cache():
    planner = _planner(k=3)
    text = [10, 11, 12, 13, 14, 15, 16]
    req = _req("a", text + [20] + text[:3])  # 11 ids: two full blocks
    planner.waiting.push(req)
    planner.postprocess(planner.plan(), [13])
    cached = planner.allocator.num_cached
    step = planner.plan()
    planner.postprocess(step, [77], accepted=[0])  # every draft refused
    # 12 ids computed: three full blocks at most, whose ids are the kept tokens only
    assert planner.allocator.num_cached == cached + 1 == 3
    assert req.token_ids[9:] == [11, 12, 13, 77]
    assert req.num_computed == 12  # the drafts' slots (positions 12..14) count for nothing
    # the cached blocks hold kept ids only: block 2 is [10, 11, 12, 13]
    assert planner.cached_run(req, 3) == req.block_table[:3]


def test_blocks_that_kept_drafts_fill_are_cached_under_their_own_ids():
    """Kept drafts complete a block: it is cached under its ids (the drafts'), so a later
    request with that prefix hits it, and every block after it still chains right (the
    key was once taken before the drafts were appended: a truncated block, memoised)."""
    planner = _planner(k=3)
    text = [10, 11, 12, 13, 14, 15, 16]
    req = _req("a", text + [20] + text[:4])  # 12 ids: three full blocks
    planner.waiting.push(req)
    planner.postprocess(planner.plan(), [14])  # 13 ids; 12 computed
    step = planner.plan()
    assert step.chunks[0].draft == [15, 16, 20]
    planner.postprocess(step, [30], accepted=[3])  # every draft kept (block 3 full), then 30
    assert req.token_ids[12:] == [14, 15, 16, 20, 30] and req.num_computed == 16
    assert len(req.block_hashes) == 4
    for i in range(4):  # the memoised chain is the chain of the ids
        assert req.block_hashes[i] == chain_hash(req.block_key(i, BS)), i
    follower = _req("b", req.token_ids[:16] + [99])
    assert planner.cached_run(follower, 4) == req.block_table[:4]


def test_big_batches_do_not_speculate():
    text = [10, 11, 12, 10, 11]
    planner = _planner(k=3, disable_by_batch_size=2)
    a, b = _req("a", text), _req("b", text)
    planner.waiting.push(a)
    planner.waiting.push(b)
    planner.postprocess(planner.plan(), [12, 12])
    assert [c.draft for c in planner.plan().chunks] == [[], []]


def test_a_constrained_request_drafts_what_its_grammar_forces_else_the_ngram():
    """The worker reports the tokens a constrained request's grammar forces after its
    sample (StepResult.forced): its next decode drafts them (within max_tokens), and
    without any, what the n-gram drafter proposes (the worker cuts what the grammar
    refuses). The forced tokens also keep it from running ahead."""
    planner = _planner(k=3)
    text = [10, 11, 12, 10, 11]
    req = _req("g", text, max_tokens=7, grammar="start: /x/")
    planner.waiting.push(req)
    planner.postprocess(planner.plan(), [12], forced=[[30, 31, 32, 33]])
    assert req.forced == [30, 31, 32, 33]
    step = planner.plan()
    assert step.chunks[0].draft == [30, 31, 32]  # k: 3
    out = planner.postprocess(step, [40], accepted=[3], forced=[[50, 51]])
    assert out[0].drafted == [30, 31, 32] and req.forced == [50, 51]
    assert planner.plan().chunks[0].draft == [50]  # max_tokens 7: 5 made, 1 its own
    planner2 = _planner(k=3)
    req2 = _req("h", text, grammar="start: /x/")
    planner2.waiting.push(req2)
    planner2.postprocess(planner2.plan(), [12], forced=[[]])
    assert planner2.plan().chunks[0].draft == [10, 11, 12]  # the n-gram's
    planner3 = _planner(k=3)
    req3 = _req("i", [40, 41, 42, 43], grammar="start: /x/")
    planner3.waiting.push(req3)
    planner3.postprocess(planner3.plan(), [44], forced=[[]])
    assert planner3.plan().chunks[0].draft == []  # nothing forced, nothing to copy
    assert [c.rid for c in planner3.plan(lookahead=True).chunks] == ["i"]  # runs ahead
    req3.forced = [7]  # what the step before the one in flight said: structured text
    assert planner3._waits_to_draft(req3)


@pytest.mark.parametrize("bad,why", [
    ({"method": "medusa"}, "not yet served"),
    ({"method": "eagle"}, "not yet served"),
    ({"method": "eagle3"}, "needs `model` \\(the EAGLE-3 head\\)"),
    ({"method": "eagle3", "model": "/x", "num_speculative_tokens": None},
     "eagle3' needs num_speculative_tokens"),
    ({"method": "eagle3", "model": "/x", "prompt_lookup_min": 2},
     "prompt_lookup_min: not a key of method eagle3"),
    ({"method": "ngram", "model": "/x"}, "takes no `model`"),
    ({"method": "suffix", "model": "/x"}, "takes no `model`"),
    ({"prompt_lookup_min": 4, "prompt_lookup_max": 2}, "greater than"),
    ({"method": "draft_model"}, "needs `model`"),
    ({"model": "/x", "prompt_lookup_max": 3}, "prompt_lookup_max: not a key of method draft_model"),
    ({"model": "/x", "num_speculative_tokens": None}, "draft_model' needs num_speculative_tokens"),
])
def test_bad_configs_are_refused_naming_what(bad, why):
    import msgspec
    with pytest.raises(msgspec.ValidationError, match=why):
        msgspec.convert({"num_speculative_tokens": 2, **bad}, SpeculativeSpec)


def test_a_model_without_a_method_is_a_draft_model_as_in_vllm(tmp_path):
    import msgspec
    spec = msgspec.convert({"model": str(tmp_path), "num_speculative_tokens": 3}, SpeculativeSpec)
    assert (spec.method, spec.model) == ("draft_model", str(tmp_path))
    assert msgspec.convert({"num_speculative_tokens": 3}, SpeculativeSpec).method == "ngram"


def test_eagle3_takes_a_head_and_drafts_on_the_worker(tmp_path):
    import msgspec
    spec = msgspec.convert({"method": "eagle3", "model": str(tmp_path), "num_speculative_tokens": 3},
                           SpeculativeSpec)
    assert (spec.method, spec.model) == ("eagle3", str(tmp_path))
    assert Drafts(spec).by_model


def _decoding(planner: Planner, prompt: list[int], first: int) -> SchedRequest:
    req = _req("r", prompt)
    planner.waiting.push(req)
    planner.postprocess(planner.plan(), [first])
    return req


def test_a_copying_request_skips_run_ahead_so_its_next_step_drafts():
    """In the loop a step is always in flight: a request that ran ahead would never
    have its last token known when planned, and never draft."""
    planner = _planner(k=3)
    text = [10, 11, 12, 13, 14, 15, 16]
    req = _decoding(planner, [30, 31] + text + [20] + text[:2], 12)
    step = planner.plan()
    assert step.chunks[0].draft == [13, 14, 15]
    planner.postprocess(step, [13], accepted=[0])  # all three rejected
    plain = planner.plan()  # [12, 13]'s successor: 14 — it drafts again
    assert plain.chunks[0].draft
    assert planner.plan(lookahead=True).chunks == []  # its drafts are in flight


def test_a_request_with_nothing_to_copy_keeps_run_ahead():
    planner = _planner(k=3)
    req = _decoding(planner, [40, 41, 42, 43, 44], 45)
    step = planner.plan()
    assert step.chunks[0].draft == []  # no n-gram recurs
    ahead = planner.plan(lookahead=True)
    assert [c.rid for c in ahead.chunks] == ["r"]  # the placeholder step, as without spec
    assert req.samples_in_flight == 2


def test_drafts_mostly_rejected_turn_speculation_off_for_that_request():
    from scheduler.speculation import PROBATION

    planner = _planner(k=3)
    text = [10, 11, 12, 13, 14, 15, 16]
    req = _decoding(planner, text + [20] + text[:2], 12)
    req.spec_drafted, req.spec_accepted = PROBATION, 0  # its history so far
    planner.plan()  # in flight, its token unknown
    assert [c.rid for c in planner.plan(lookahead=True).chunks] == ["r"]  # runs ahead


def test_a_request_preempted_after_speculating_recomputes_its_kept_ids_and_drafts_again():
    """Preemption (recompute) of a request whose drafts were partly kept: it re-queues
    with its ids (prompt, kept drafts, sampled tokens; never a rejected draft), its
    re-admission feeds exactly those ids after what the prefix cache still holds (kept
    ids only: the blocks the rejected drafts' slots touched were never cached), and its
    decodes draft again from the same index."""
    planner = Planner(BlockAllocator(12), block_size=BS, max_num_seqs=8,
                      max_num_batched_tokens=64,
                      speculative=SpeculativeSpec(num_speculative_tokens=3,
                                                  prompt_lookup_min=2, prompt_lookup_max=3))
    text = [10, 11, 12, 13, 14, 15, 16]
    a = _req("a", [40, 41, 42, 43, 44, 45], max_tokens=40)
    b = _req("b", text + [20] + text[:3], max_tokens=40)
    planner.waiting.push(a)
    planner.waiting.push(b)
    planner.postprocess(planner.plan(), [46, 13])
    step = planner.plan()
    assert [c.draft for c in step.chunks] == [[], [14, 15, 16]]
    planner.postprocess(step, [47, 99], accepted=[0, 2])  # b keeps 14, 15; 16 refused
    ids = list(b.token_ids)
    assert ids[-4:] == [13, 14, 15, 99] and b.num_computed == 14
    hog = planner.allocator.allocate(planner.allocator.num_free)  # the cache is full
    preempted = []
    while not preempted:  # a decodes until it needs a block: the latest arrival goes
        ids = list(b.token_ids)
        step = planner.plan()
        preempted = step.preempted
        planner.postprocess(step, [50] * sum(c.sample for c in step.chunks),
                            accepted=[0] * sum(c.sample for c in step.chunks))
    assert preempted == [b] and b.token_ids == ids and b.num_computed == 0
    assert ids[:15] == [*text, 20, *text[:3], 13, 14, 15, 99]  # 16 refused: never an id
    assert (b.spec_drafted, b.spec_accepted) == (3, 2)  # its report survives
    planner.allocator.free(hog)
    step = planner.plan()
    (chunk,) = [c for c in step.chunks if c.rid == "b"]
    cached = chunk.start_pos
    assert cached % BS == 0 and chunk.token_ids == ids[cached:] and chunk.sample
    assert chunk.draft == []  # a prefill never drafts

    def returned(step, b_token):  # b samples b_token, a 50; no draft kept
        tokens = [b_token if c.rid == "b" else 50 for c in step.chunks if c.sample]
        return planner.postprocess(step, tokens, accepted=[0] * len(tokens))
    returned(step, 10)
    returned(planner.plan(), 11)  # b copies its prompt again: ... 10, 11
    nxt = [c for c in planner.plan().chunks if c.rid == "b"]
    assert nxt and nxt[0].draft == [12, 13, 14], nxt  # what followed 10, 11 last time


def test_dynamic_k_follows_each_requests_acceptance():
    """Drafts go as deep as the request's estimated per-position acceptance a makes
    worth it (a^j >= 0.2): five at first (a prior of 3 in 4), all k for a request whose
    drafts are nearly always kept, one for one whose drafts are mostly refused; the
    planner asks the drafter for no more."""
    from scheduler.speculation import Drafts
    fresh = _req("f", [1, 2, 3])
    assert Drafts.depth(fresh, 8) == 5 and Drafts.depth(fresh, 3) == 3
    good = _req("g", [1, 2, 3])
    good.spec_accepted, good.spec_refusals = 100, 1
    assert Drafts.depth(good, 8) == 8
    poor = _req("p", [1, 2, 3])
    poor.spec_accepted, poor.spec_refusals = 2, 10
    assert Drafts.depth(poor, 8) == 1
    planner = _planner(k=3)
    text = [10, 11, 12, 13, 14, 15, 16]
    req = _decoding(planner, text + [20] + text[:2], 12)
    req.spec_accepted, req.spec_refusals = 2, 10
    req.spec_drafted = 11  # (under probation: it still drafts)
    step = planner.plan()
    assert step.chunks[0].draft == [13]
    planner.postprocess(step, [99], accepted=[0])  # refused: one more refusal counted
    assert (req.spec_drafted, req.spec_accepted, req.spec_refusals) == (12, 2, 11)


def test_a_busy_batch_drafts_only_for_requests_whose_drafts_are_mostly_kept():
    """From BUSY_BATCH running requests on, a verify row costs compute: a draft must be
    kept with WORTH_BUSY chance. A request at the prior (0.75) or copying still drafts;
    one at about a half drafts nothing and keeps its run-ahead step."""
    from scheduler.speculation import BUSY_BATCH, Drafts
    copying, plain = _req("c", [1]), _req("p", [1])
    copying.spec_accepted, copying.spec_refusals = 60, 2
    plain.spec_accepted, plain.spec_refusals = 10, 10
    assert Drafts.depth(copying, 4, BUSY_BATCH) == 4
    assert Drafts.depth(_req("f", [1]), 4, BUSY_BATCH) == 1  # 0.75 >= 0.6 > 0.75^2
    assert Drafts.depth(plain, 4, BUSY_BATCH) == 0
    assert Drafts.depth(plain, 4, BUSY_BATCH - 1) == 2  # (0.52^2 >= 0.2)
    planner = Planner(BlockAllocator(256), block_size=BS, max_num_seqs=16,
                      max_num_batched_tokens=256,
                      speculative=SpeculativeSpec(num_speculative_tokens=3,
                                                  prompt_lookup_min=2, prompt_lookup_max=3))
    text = [10, 11, 12, 13, 14, 15, 16]
    reqs = [_req(f"r{i}", text + [20] + text[:2]) for i in range(BUSY_BATCH)]
    for r in reqs:
        planner.waiting.push(r)
        r.spec_accepted, r.spec_refusals = 10, 10
    planner.postprocess(planner.plan(), [12] * BUSY_BATCH)
    step = planner.plan()
    assert [c.draft for c in step.chunks] == [[]] * BUSY_BATCH
    ahead = planner.plan(lookahead=True)  # nothing to wait for: every one runs ahead
    assert len(ahead.chunks) == BUSY_BATCH
