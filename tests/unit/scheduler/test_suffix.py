"""Suffix decoding's drafter (scheduler/suffix.py) and its place in the planner: the
longest recent suffix that occurred before, its most frequent continuation, the length
rule (max_spec_factor x the match), the probability floor, finished requests' outputs as
a second source (bounded, oldest out first), the same history giving the same drafts, and
the config's keys (vLLM's defaults, the other method's keys refused)."""

from __future__ import annotations

import msgspec
import pytest

from cluster.topology import SpeculativeSpec
from protocol.ipc import DetokParams, SamplingParams, TokenizedReq
from scheduler.block_manager import BlockAllocator
from scheduler.planner import Planner
from scheduler.request import SchedRequest
from scheduler.suffix import SuffixCache, SuffixIndex, propose


def _propose(ids, k=8, depth=24, factor=1.0, prob=0.1, cache=None, index=None):
    return propose(index or SuffixIndex(), cache or SuffixCache(10), ids, k, depth, factor, prob)


def test_drafts_follow_the_most_frequent_continuation_of_the_longest_match():
    # [1, 2, 3] occurred twice, continued by 4 then by 9; [7, 2, 3] once, by 5
    ids = [1, 2, 3, 4, 6, 1, 2, 3, 4, 8, 7, 2, 3, 5, 0, 1, 2, 3]
    assert _propose(ids, k=1) == [4]  # match 3, continued by 4 twice
    # then 6 and 8 tie at 1/2 each: the latest occurrence's, 8 (then 7, all of those left)
    assert _propose(ids, k=3, prob=0.5) == [4, 8, 7]  # 1 * 1/2 * 1 >= 0.5
    assert _propose(ids, k=3, prob=0.6) == [4]  # 1/2 < 0.6: the path stops there
    assert _propose([5, 6, 7], k=4) == []  # nothing recurs


def test_the_match_length_bounds_the_drafts():
    ids = [9, 1, 2, 3, 4, 5, 6, 7, 8, 0, 8]  # [8] matches once (len 1), followed by 0, 8
    assert _propose(ids, k=8, factor=1.0) == [0]
    assert _propose(ids, k=8, factor=2.0) == [0, 8]
    longer = [1, 2, 3, 4, 5, 6, 7, 0, 1, 2, 3]  # match of 3: three drafts at factor 1
    assert _propose(longer, k=8) == [4, 5, 6]
    assert _propose(longer, k=8, depth=2) == [4, 5]  # the match counted up to the depth


def test_finished_outputs_draft_for_other_requests_and_the_cache_is_bounded():
    cache = SuffixCache(2)
    cache.add([40, 41, 42, 43, 44])
    assert _propose([7, 8, 40, 41], cache=cache) == [42, 43]
    cache.add([50, 51, 52])
    cache.add([60, 61, 62])  # the first output goes: oldest out first
    assert _propose([7, 8, 40, 41], cache=cache) == []
    assert _propose([7, 61], cache=cache) == [62]
    assert SuffixCache(0).outputs == {} and _propose([1, 2], cache=SuffixCache(0)) == []


def test_the_same_history_gives_the_same_drafts():
    import random
    rng = random.Random(5)
    outputs = [[rng.randrange(20) for _ in range(rng.randrange(5, 40))] for _ in range(30)]
    ids = [rng.randrange(20) for _ in range(300)]

    def run():
        cache, index, got = SuffixCache(8), SuffixIndex(), []
        for out in outputs:
            cache.add(out)
        for n in range(2, len(ids)):
            got.append(propose(index, cache, ids[:n], 6, 12, 1.5, 0.2))
        return got
    first = run()
    assert first == run() and sum(map(len, first)) > 50


@pytest.mark.parametrize("bad,why", [
    ({"method": "suffix", "prompt_lookup_max": 3}, "prompt_lookup_max: method ngram's"),
    ({"suffix_decoding_max_tree_depth": 8}, "method suffix's, not ngram's"),
    ({"method": "ngram", "num_speculative_tokens": None}, "needs num_speculative_tokens"),
    ({"method": "suffix", "suffix_decoding_min_token_prob": 1.5}, "<= 1.0"),
])
def test_suffix_config_keys(bad, why):
    with pytest.raises(msgspec.ValidationError, match=why):
        msgspec.convert({"num_speculative_tokens": 2, **bad}, SpeculativeSpec)


def test_suffix_config_takes_vllm_defaults():
    spec = msgspec.convert({"method": "suffix"}, SpeculativeSpec)
    assert (spec.num_speculative_tokens, spec.suffix_decoding_max_tree_depth,
            spec.suffix_decoding_max_cached_requests, spec.suffix_decoding_max_spec_factor,
            spec.suffix_decoding_min_token_prob) == (24, 24, 10000, 1.0, 0.1)
    assert msgspec.convert({"method": "suffix", "suffix_decoding_max_tree_depth": 40},
                           SpeculativeSpec).num_speculative_tokens == 32


def _req(rid: str, prompt: list[int], max_tokens: int = 30) -> SchedRequest:
    tok = TokenizedReq(rid=rid, reply_to="ipc://x", prompt_token_ids=prompt, max_tokens=max_tokens,
                       sampling=SamplingParams(temperature=0.0), detok=DetokParams(),
                       eos_token_ids=[0])
    return SchedRequest(tok, 0)


def test_the_planner_drafts_a_new_request_from_a_finished_ones_output():
    spec = msgspec.convert({"method": "suffix", "num_speculative_tokens": 4}, SpeculativeSpec)
    planner = Planner(BlockAllocator(64), block_size=4, max_num_seqs=8,
                      max_num_batched_tokens=64, speculative=spec)
    first = _req("a", [90, 91, 92], max_tokens=6)
    planner.waiting.push(first)
    for token in (30, 31, 32, 33, 34, 35):  # it writes 30..35 and ends (max_tokens)
        planner.postprocess(planner.plan(), [token],
                            accepted=None)
    assert first.finished and planner.drafts.cache.outputs
    second = _req("b", [80, 81, 30, 31, 32])
    planner.waiting.push(second)
    planner.postprocess(planner.plan(), [33])  # it follows the first one's output
    (chunk,) = planner.plan().chunks
    assert chunk.draft == [34, 35], chunk  # match [30..33] (4 ids): up to 4 drafts, 2 known
