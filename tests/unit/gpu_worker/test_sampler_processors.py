"""Sampler logit processors against straightforward dense reference computations."""

from __future__ import annotations

import pytest
import torch

from gpu_worker.request_state import RequestTracker
from gpu_worker.sampler import Sampler
from protocol.ipc import SamplingParams, SeqChunk

GREEDY = SamplingParams(temperature=0.0)


def _processed(params, histories, logits):
    return Sampler()._process(logits.clone(), params, histories)


def test_penalties_match_a_dense_reference():
    torch.manual_seed(0)
    logits = torch.randn(3, 50)
    hist = [([1, 2, 3, 7, 7, 9], 3), ([4, 4, 4], 1), ([5], 1)]
    params = [SamplingParams(presence_penalty=0.5, frequency_penalty=0.25, repetition_penalty=1.5),
              SamplingParams(frequency_penalty=-1.0),
              SamplingParams()]
    out = _processed(params, hist, logits)
    ref = logits.clone()
    for r, ((ids, n_prompt), p) in enumerate(zip(hist, params)):
        for t in set(ids):  # repetition over prompt + generated (HF)
            x = ref[r, t]
            ref[r, t] = x / p.repetition_penalty if x > 0 else x * p.repetition_penalty
        gen = ids[n_prompt:]
        for t in set(gen):  # presence / frequency over generated only (OpenAI)
            ref[r, t] -= p.frequency_penalty * gen.count(t) + p.presence_penalty
    torch.testing.assert_close(out, ref)


def test_logit_bias_is_sparse_and_exact():
    logits = torch.zeros(4, 100)
    params = [SamplingParams(), SamplingParams(logit_bias=[(3, 5.0), (99, -100.0)]),
              SamplingParams(), SamplingParams(logit_bias=[(0, 1.5)])]
    out = _processed(params, [None] * 4, logits)
    ref = torch.zeros(4, 100)
    ref[1, 3], ref[1, 99], ref[3, 0] = 5.0, -100.0, 1.5
    assert torch.equal(out, ref)
    assert torch.equal(logits, torch.zeros(4, 100))  # the caller's logits are untouched


def test_min_tokens_suppresses_stop_ids_until_reached():
    logits = torch.zeros(2, 10)
    logits[:, 2] = 10.0  # the "eos" would win
    p = SamplingParams(temperature=0.0, min_tokens=2, min_tokens_stop_ids=[2])
    histories = [([5, 6, 7], 2), ([5, 6, 7, 8], 2)]
    tokens, _, _ = Sampler().sample(logits, [p, p], [None, None], histories)
    assert tokens[0] != 2          # one generated so far: eos suppressed
    assert tokens[1] == 2          # two generated: allowed again


def test_min_p_keeps_only_tokens_near_the_top():
    logits = torch.tensor([[5.0, 4.99, 0.0, -1.0]])
    sampler = Sampler(seed=1)
    seen = {sampler.sample(logits, [SamplingParams(min_p=0.5)], [None])[0][0] for _ in range(200)}
    assert seen == {0, 1}


def test_logprobs_are_raw_log_softmax_before_processors():
    torch.manual_seed(1)
    logits = torch.randn(2, 30)
    params = [SamplingParams(temperature=0.0, logprobs=3, logit_bias=[(7, 100.0)]),
              SamplingParams(temperature=0.5, top_k=2)]
    ref = torch.log_softmax(logits[0], -1)  # before: the sampler works in place
    tokens, lps, _ = Sampler().sample(logits, params, [None, None])
    assert tokens[0] == 7 and lps[1] is None
    assert abs(lps[0].logprob - ref[7].item()) < 1e-5
    top = ref.topk(3)
    assert lps[0].top_ids == top.indices.tolist()
    torch.testing.assert_close(torch.tensor(lps[0].top_logprobs), top.values)


def test_prompt_logprobs_across_chunks_equal_one_pass():
    torch.manual_seed(2)
    ids = [3, 1, 4, 1, 5, 9, 2]
    logits = torch.randn(len(ids), 12)
    p = SamplingParams(prompt_logprobs=2, num_prompt_tokens=len(ids))
    tracker = RequestTracker()
    tracker.add_prompt_logprobs(SeqChunk("r", ids[:3], 0, [0], False), p, logits[:3])
    tracker.add_prompt_logprobs(SeqChunk("r", ids[3:], 3, [0], True), p, logits[3:])
    got = tracker.take_prompt_logprobs("r")
    ref = torch.log_softmax(logits, -1)
    assert [e.token_id for e in got] == ids and got[0].logprob is None
    for pos in range(1, len(ids)):
        assert abs(got[pos].logprob - ref[pos - 1, ids[pos]].item()) < 1e-5
        assert got[pos].top_ids == ref[pos - 1].topk(2).indices.tolist()
    assert tracker.take_prompt_logprobs("r") is None  # handed out once


def test_a_row_with_nothing_to_sample_fails_alone_and_says_why():
    """min_tokens holding back the only token a grammar allows, NaN logits, everything
    masked: that row gets no token and a reason; the other rows sample as alone."""
    torch.manual_seed(3)
    logits = torch.randn(4, 64)
    warm = SamplingParams(temperature=0.7)
    alone = Sampler().sample(logits[3:].clone(), [warm], [torch.Generator().manual_seed(1)])[0][0]
    logits[1, 5] = float("nan")
    only_eos = torch.zeros(4, 2, dtype=torch.int32)
    only_eos[:, 0] = 1 << 2  # token 2 ("eos") alone allowed
    held = SamplingParams(temperature=0.0, min_tokens=4, min_tokens_stop_ids=[2])
    params = [held, GREEDY, GREEDY, warm]
    histories = [([1, 2, 3], 1), None, None, None]
    gens = [None, None, None, torch.Generator().manual_seed(1)]
    masked = logits.clone()
    tokens, _, failed = Sampler().sample(masked, params, gens, histories, ([0, 2], only_eos[:2]))
    assert tokens == [-1, -1, 2, alone]
    assert set(failed) == {0, 1}
    assert (failed[0].code, failed[0].status, failed[0].param) == ("constraint_conflict", 400,
                                                                   "min_tokens")
    assert "min_tokens (4)" in failed[0].message and "after 2 generated" in failed[0].message
    assert failed[1].code == "invalid_logits" and failed[1].status == 500
    nothing = torch.zeros(1, 2, dtype=torch.int32)
    _, _, failed = Sampler().sample(torch.randn(1, 64), [GREEDY], [None], None, ([0], nothing))
    assert failed[0].code == "no_token_allowed"


def test_history_after_a_cache_hit_starts_with_the_context():
    tracker = RequestTracker()
    p = SamplingParams(presence_penalty=1.0, num_prompt_tokens=6)
    tracker.observe(SeqChunk("r", [5, 6], 4, [0], True, 0, [1, 2, 3, 4]), p)
    tracker.observe(SeqChunk("r", [9], 6, [], True, 1), p)
    assert tracker.history("r", p) == ([1, 2, 3, 4, 5, 6, 9], 6)
    tracker.observe(SeqChunk("r", [5, 6, 9], 4, [0], False), p)  # recompute after preemption
    assert tracker.history("r", p) == ([1, 2, 3, 4, 5, 6, 9], 6)
    tracker.observe(SeqChunk("plain", [7], 3, [0], True), GREEDY)  # needs none: kept none
    assert tracker.history("plain", GREEDY) is None
    with pytest.raises(ValueError, match="history holds 0 ids"):  # loud, never a hole
        tracker.observe(SeqChunk("hole", [5, 6], 4, [0], True), p)
