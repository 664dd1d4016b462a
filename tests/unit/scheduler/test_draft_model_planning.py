"""Speculative decoding's ``draft_model`` in the scheduler: each decode asks the worker's
draft model for as many proposals as the request's dynamic depth and its
``max_tokens`` allow (``SeqChunk.propose``); the request then sits out the run-ahead step
behind it, and its next decode drafts the proposals the result brought
(``StepResult.drafts``), never stale ones."""

from __future__ import annotations

from cluster.topology import SpeculativeSpec
from protocol.ipc import DetokParams, SamplingParams, TokenizedReq
from scheduler.block_manager import BlockAllocator
from scheduler.planner import Planner
from scheduler.request import SchedRequest

BS = 4


def _req(rid: str, prompt: list[int], max_tokens: int = 30) -> SchedRequest:
    tok = TokenizedReq(rid=rid, reply_to="ipc://x", prompt_token_ids=prompt, max_tokens=max_tokens,
                       sampling=SamplingParams(temperature=0.0), detok=DetokParams(),
                       eos_token_ids=[0])
    return SchedRequest(tok, 0)


def _planner(k: int = 4, **kw) -> Planner:
    spec = SpeculativeSpec(model="/draft", num_speculative_tokens=k, **kw)
    return Planner(BlockAllocator(64), block_size=BS, max_num_seqs=8, max_num_batched_tokens=64,
                   speculative=spec)


def _decoding(planner: Planner, req: SchedRequest, first: int = 11) -> None:
    """Prefill ``req`` (no proposals after a prompt: they would add to its time to first
    token) and decode its first token, which asks for them."""
    planner.waiting.push(req)
    prefill = planner.plan()
    assert prefill.chunks[0].propose == 0
    planner.postprocess(prefill, [first])


def test_a_decode_asks_for_proposals_and_the_next_decode_drafts_them():
    planner = _planner()
    req = _req("a", [5, 6, 7, 8, 9])
    _decoding(planner, req)
    first = planner.plan()
    (chunk,) = first.chunks
    assert chunk.propose == 4 and chunk.draft == []
    assert planner.plan(lookahead=True).chunks == []  # waits for the proposals
    planner.postprocess(first, [11], proposed=[[12, 13, 14, 15]])
    step = planner.plan()
    (chunk,) = step.chunks
    assert chunk.token_ids == [11] and chunk.draft == [12, 13, 14, 15] and chunk.propose > 0
    assert len(req.block_table) * BS >= chunk.start_pos + 5  # slots for the drafts
    assert planner.plan(lookahead=True).chunks == []
    out = planner.postprocess(step, [20], accepted=[2], proposed=[[21, 22]])
    assert [(s.drafted, s.token) for s in out] == [([12, 13], 20)]
    assert planner.plan().chunks[0].draft == [21, 22]


def test_proposals_after_an_older_token_are_never_drafted():
    """A result's proposals follow its token; once a later token came in (a run-ahead
    step sampled it) they are stale."""
    planner = _planner()
    req = _req("a", [5, 6, 7, 8, 9])
    _decoding(planner, req)
    planner.postprocess(planner.plan(), [11], proposed=[[12, 13]])
    req.token_ids.append(12)  # as if a later step had appended its token
    req.num_generated += 1
    req.num_computed += 1
    req.num_scheduled += 1
    assert planner.plan().chunks[0].draft == []


def test_proposals_never_past_max_tokens_nor_with_speculation_off_for_the_batch():
    planner = _planner(k=8)
    req = _req("a", [5, 6, 7], max_tokens=5)
    _decoding(planner, req)
    first = planner.plan()
    assert first.chunks[0].propose == 2  # 5 tokens: 1 out, this one, the next's own, 2 drafts
    planner.postprocess(first, [11], proposed=[[12, 13]])
    step = planner.plan()
    # should both drafts be rejected, one more token and one draft fit: a proposal
    assert step.chunks[0].draft == [12, 13] and step.chunks[0].propose == 1
    planner.postprocess(step, [14], accepted=[1], proposed=[[15]])  # 11, 11, 12, 14
    assert planner.plan().chunks[0].propose == 0  # its last token: nothing to draft
    busy = _planner(disable_by_batch_size=2)
    for rid in ("a", "b"):
        busy.waiting.push(_req(rid, [5, 6, 7]))
    busy.postprocess(busy.plan(), [11, 12])
    assert [c.propose for c in busy.plan().chunks] == [0, 0]  # two running: no drafts
    assert [c.rid for c in busy.plan(lookahead=True).chunks] == ["a", "b"]  # run ahead


def test_a_request_whose_drafts_keep_failing_stops_asking():
    planner = _planner()
    req = _req("a", [5, 6, 7, 8, 9], max_tokens=200)
    _decoding(planner, req)
    step = planner.plan()
    token = 11
    for _ in range(12):
        planner.postprocess(step, [token], accepted=[0] if step.chunks[0].draft else [],
                            proposed=[[1, 2]] if step.chunks[0].propose else [[]])
        token += 1
        step = planner.plan()
    assert req.spec_drafted >= 12 and req.spec_accepted == 0
    assert step.chunks[0].propose == 0 and step.chunks[0].draft == []
    assert [c.rid for c in planner.plan(lookahead=True).chunks] == ["a"]  # runs ahead again
