"""Draft tokens for speculative decoding, proposed by the scheduler from a request's own ids
(and, for ``suffix``, recently finished requests' outputs).

The drafters are deterministic. A draft model (``draft_model``) or an EAGLE-3 head
(``eagle3``) runs on the worker (gpu_worker/draft_model.py, eagle3.py): a chunk asks it for proposals (``SeqChunk.propose``, the
request's dynamic depth), the step's result carries them (``StepResult.drafts``), and the
request's next decode drafts them, planned here like the others. Prompt lookup (vLLM's ``ngram``): the drafts after a
sequence are the tokens that followed the latest earlier occurrence of its last ``n`` ids,
for the longest ``n`` in ``prompt_lookup_min..prompt_lookup_max`` that occurs. Suffix
decoding (``suffix``): see ``scheduler.suffix``. The worker
verifies them (gpu_worker/model_runner.py ``_verify``): it keeps the longest run of drafts
equal to what it would have sampled at each position and adds the token it samples after
them, so a draft never changes the answer, only how many positions one step computes.

Why the scheduler drafts: it holds every request's ids (prompt, hits and all), and a plan
is where the KV slots for the drafts are reserved. The price is run-ahead: while a step
with drafts is in flight the next plan cannot know where the request stands (how many of
them the worker keeps), so a speculating request sits out the step planned behind its own
(``SchedRequest.speculating``); every other request of the batch still runs ahead. With
nothing else running that costs one scheduler round trip per step; with a busy batch it
would halve the request's steps, which is why ``disable_by_batch_size`` turns drafting off
there (see ``Drafts.allowed``).

Index: per request and n, a dict from each n-gram that has a successor to its latest start
(updated incrementally as ids are appended: ids never change once in the list), so a
proposal costs ``max - min + 1`` dict lookups, whatever the context length.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from cluster.topology import SpeculativeSpec
from scheduler.suffix import SuffixCache, SuffixIndex
from scheduler.suffix import propose as suffix_propose


# A request whose drafts were verified PROBATION times over and kept under LOW_ACCEPTANCE
# of the time stops speculating: each drafting step costs it the run-ahead overlap.
PROBATION = 12
LOW_ACCEPTANCE = 0.25
# Dynamic k: a request's next drafts go as deep as the position its acceptance rate
# reaches with at least WORTH chance (see ``Drafts.depth``); PRIOR_KEPT and PRIOR_SEEN
# are the pseudo-counts its estimate starts from (3 of 4: 0.75, five drafts at first).
# From BUSY_BATCH running requests on, a step's rows cost compute, not just a pass over
# the weights: a draft must then be kept with WORTH_BUSY chance (bench.spec on the
# CPU, SmolLM2-135M: plain chat at batch 16 lost 8% with WORTH, copying gained 2x).
WORTH = 0.2
WORTH_BUSY = 0.6
BUSY_BATCH = 8
PRIOR_KEPT, PRIOR_SEEN = 3, 4


@dataclass
class NgramIndex:
    """The latest start of every n-gram (for each n of the range) that some id follows
    (``upto``: the n-grams ending before that index are in)."""

    low: int
    high: int
    upto: int = 0
    starts: dict[int, dict[tuple[int, ...], int]] = field(default_factory=dict)

    def extend(self, ids: list[int]) -> None:
        """Index the n-grams of ``ids`` that end before its last id (so each has a
        successor)."""
        end = len(ids) - 1  # n-grams must end at an index < end
        for n in range(self.low, self.high + 1):
            table = self.starts.setdefault(n, {})
            for start in range(max(0, self.upto - n), end - n + 1):
                table[tuple(ids[start:start + n])] = start
        self.upto = max(self.upto, end)

    def propose(self, ids: list[int], k: int) -> list[int]:
        """Up to ``k`` ids that followed the latest earlier occurrence of the longest
        matching suffix of ``ids`` (none: no n-gram of the range recurs)."""
        self.extend(ids)
        for n in range(min(self.high, len(ids) - 1), self.low - 1, -1):
            start = self.starts.get(n, {}).get(tuple(ids[len(ids) - n:]))
            if start is not None:
                return ids[start + n:start + n + k]
        return []


@dataclass
class SpecCounts:
    """Cumulative speculative-decoding counts (vLLM's spec_decode metrics): steps that
    carried drafts, drafted tokens, accepted ones, and accepted ones by draft position."""

    drafts: int = 0
    draft_tokens: int = 0
    accepted_tokens: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)

    def add(self, drafted: int, accepted: int) -> None:
        self.drafts += 1
        self.draft_tokens += drafted
        self.accepted_tokens += accepted
        if len(self.accepted_per_pos) < drafted:
            self.accepted_per_pos.extend([0] * (drafted - len(self.accepted_per_pos)))
        for pos in range(accepted):
            self.accepted_per_pos[pos] += 1


class Drafts:
    """The drafter of one engine replica (``SpeculativeSpec``): its method, and for
    ``suffix`` the cache of finished requests' outputs it also drafts from."""

    def __init__(self, spec: SpeculativeSpec) -> None:
        self.spec = spec
        self.counts = SpecCounts()
        self.cache = (SuffixCache(spec.suffix_decoding_max_cached_requests)
                      if spec.method == "suffix" else None)
        # the worker's draft model or EAGLE-3 head proposes (after each step), not the
        # scheduler
        self.by_model = spec.method in ("draft_model", "eagle3")

    def finished(self, req) -> None:
        """``req`` ended: its generated ids join the suffix cache (suffix only)."""
        if self.cache is not None and req.num_generated:
            self.cache.add(req.token_ids[len(req.req.prompt_token_ids):])

    def allowed(self, running: int) -> bool:
        """Whether this step drafts at all: not once ``disable_by_batch_size`` requests
        run (vLLM's rule), where the batch keeps the worker busy without them."""
        limit = self.spec.disable_by_batch_size
        return limit is None or running < limit

    @staticmethod
    def gave_up(req) -> bool:
        """``req``'s drafts have mostly been rejected (under ``LOW_ACCEPTANCE`` after
        ``PROBATION`` of them): it decodes on as without speculation."""
        return req.spec_drafted >= PROBATION and req.spec_accepted < LOW_ACCEPTANCE * req.spec_drafted

    @staticmethod
    def depth(req, k: int, running: int = 1) -> int:
        """How many drafts ``req``'s next step verifies, at most ``k`` (dynamic k; 0:
        none this step). Drafts are kept position by position until the first refusal,
        so with a per-position acceptance rate a the j-th draft is kept with chance a^j;
        each one costs a verify row whether kept or not. The rate is estimated from the
        request's own history as kept / (kept + refusals) (one refusal ends each step that
        did not keep all its drafts), smoothed by a prior; the depth is the last j with
        a^j >= WORTH, so a request whose drafts are mostly right drafts deep and one
        often wrong drafts one or two, before ``gave_up`` stops it. With ``running`` at
        BUSY_BATCH or more (rows cost compute) the bar is WORTH_BUSY: copying still
        drafts, plain text mostly not."""
        rate = (req.spec_accepted + PRIOR_KEPT) / (
            req.spec_accepted + req.spec_refusals + PRIOR_SEEN)
        if rate >= 1.0:
            return k
        busy = running >= BUSY_BATCH
        depth = int(math.log(WORTH_BUSY if busy else WORTH) / math.log(rate))
        return min(k, depth if busy else max(1, depth))

    @staticmethod
    def proposals(req, k: int) -> list[int]:
        """A draft model's drafts for ``req``'s next decode: up to ``k`` of the worker's
        latest proposals, while they follow its ids (none once a later token came in)."""
        return req.proposed[:k] if k > 0 and req.proposed_at == len(req.token_ids) else []

    def propose_count(self, req, running: int) -> int:
        """How many drafts the worker's draft model should propose after the token a
        chunk of ``req`` samples (``SeqChunk.propose``): its dynamic depth, within what
        ``max_tokens`` leaves its next step (one token of which is the worker's own);
        0 where its next step would not draft."""
        sreq = req.req
        if (not self.by_model or sreq.pooling is not None or not self.allowed(running)
                or self.gave_up(req)):
            return 0
        k = self.spec.num_speculative_tokens
        return max(0, min(sreq.max_tokens - req.num_generated - 2, self.depth(req, k, running)))

    def worth_waiting(self, req, ids: list[int]) -> bool:
        """Whether ``req`` should give up its run-ahead step for drafts: the drafter
        matches ``ids``' tail now (a request copying text is likely to match after its
        next token too)."""
        req.draft_index, draft = self.propose(req.draft_index, ids, 1)
        return bool(draft)

    def propose(self, index: NgramIndex | SuffixIndex | None, ids: list[int], k: int
                ) -> tuple[NgramIndex | SuffixIndex, list[int]]:
        """(the request's index, created on first use; up to ``k`` drafts after ``ids``)."""
        spec = self.spec
        k = min(k, spec.num_speculative_tokens)
        if self.cache is not None:
            index = index or SuffixIndex()
            return index, suffix_propose(index, self.cache, ids, k,
                                         spec.suffix_decoding_max_tree_depth,
                                         spec.suffix_decoding_max_spec_factor,
                                         spec.suffix_decoding_min_token_prob)
        if index is None:
            index = NgramIndex(spec.prompt_lookup_min, spec.prompt_lookup_max)
        return index, (index.propose(ids, k) if k > 0 else [])
