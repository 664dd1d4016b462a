"""Suffix decoding's drafter (vLLM's ``suffix`` method, after Arctic Inference's
SuffixDecoding): drafts follow the longest recent suffix of a request's ids that occurred
before, in its own ids or in the outputs of recently finished requests, along the
continuation those occurrences most often took.

Proposal, for a sequence ``ids`` and at most ``k`` drafts:

1. The pattern: the longest suffix of ``ids``, at most ``max_tree_depth`` ids, that
   occurs earlier in ``ids`` (with a successor) or in a cached output. Occurrences are
   found from an index of each sequence's positions by token (the pattern's last id), the
   latest ``SCAN`` per source, each one's match length counted backwards.
2. The length: at most ``min(k, floor(match * max_spec_factor))`` drafts, so a short
   match speculates little (Arctic's rule).
3. The path: from the occurrences of the full pattern, the next token most of them
   continued with (ties: the latest occurrence's, the request's own first), then among
   those that took it the next one, and so on, while the product of the chosen tokens'
   shares stays at least ``min_token_prob``.

The global cache keeps the generated ids of the last ``max_cached_requests`` finished
requests (oldest out first) and, per token, the latest ``SCAN`` positions where it occurs
in them. Everything is a pure function of what was appended, in order: the same history
gives the same drafts. Drafts read from other requests' outputs only change how many
tokens a step verifies, never an answer: the worker keeps a draft only where it equals
the token it samples there (``gpu_worker.model_runner``).

Why positions and not a tree: a suffix tree over every request's ids costs
``max_tree_depth`` nodes per token in Python; a position list costs one entry per token,
and a proposal scans a bounded number of them (``SCAN``, ``max_tree_depth`` compares each).
"""

from __future__ import annotations

from collections import OrderedDict, deque
from dataclasses import dataclass, field

# occurrences of the pattern's last token examined per source (the request, the cache)
SCAN = 32


@dataclass
class _Occurrence:
    """Where a pattern occurred: ``seq``'s ids, ending at index ``end``; ``match``: how
    many ids before (and including) ``end`` equal the pattern's tail; ``rank``: tie-break
    order (lower first: the request's own, latest first)."""

    seq: list[int]
    end: int
    match: int
    rank: int


@dataclass
class SuffixIndex:
    """One request's ids by token: the positions where each id occurs (``upto``: ids
    indexed so far)."""

    upto: int = 0
    positions: dict[int, list[int]] = field(default_factory=dict)

    def extend(self, ids: list[int]) -> None:
        for i in range(self.upto, len(ids)):
            self.positions.setdefault(ids[i], []).append(i)
        self.upto = max(self.upto, len(ids))


class SuffixCache:
    """The outputs of the last ``capacity`` finished requests, and per token the latest
    ``SCAN`` (output, position) pairs where it occurs in them."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.outputs: OrderedDict[int, list[int]] = OrderedDict()  # id -> ids, oldest first
        self.by_token: dict[int, deque[tuple[int, int]]] = {}
        self._next = 0

    def add(self, output: list[int]) -> None:
        if self.capacity == 0 or len(output) < 2:
            return
        key = self._next
        self._next += 1
        self.outputs[key] = list(output)
        for pos, token in enumerate(output):
            self.by_token.setdefault(token, deque(maxlen=SCAN)).append((key, pos))
        while len(self.outputs) > self.capacity:
            self.outputs.popitem(last=False)  # its positions are skipped, then pushed out

    def occurrences(self, token: int) -> list[tuple[list[int], int]]:
        """The latest cached (output, position) pairs of ``token``, latest first."""
        out = []
        for key, pos in reversed(self.by_token.get(token, ())):
            seq = self.outputs.get(key)
            if seq is not None:
                out.append((seq, pos))
        return out


def _match(seq: list[int], end: int, ids: list[int], depth: int) -> int:
    """How many ids of ``seq`` ending at ``end`` equal the tail of ``ids`` (at most
    ``depth``)."""
    n = 0
    last = len(ids) - 1
    while n < depth and end - n >= 0 and seq[end - n] == ids[last - n]:
        n += 1
    return n


def propose(index: SuffixIndex, cache: SuffixCache, ids: list[int], k: int, depth: int,
            spec_factor: float, min_prob: float) -> list[int]:
    """Up to ``k`` drafts after ``ids`` (see the module docstring)."""
    if k <= 0 or not ids:
        return []
    index.extend(ids)
    tail = ids[-1]
    found: list[_Occurrence] = []
    own = index.positions.get(tail, [])
    # earlier occurrences only: the last id itself has no successor yet
    for rank, end in enumerate(reversed(own[-SCAN - 1:])):
        if end < len(ids) - 1:
            found.append(_Occurrence(ids, end, _match(ids, end, ids, depth), rank))
    for rank, (seq, end) in enumerate(cache.occurrences(tail), start=SCAN + 1):
        if end < len(seq) - 1:
            found.append(_Occurrence(seq, end, _match(seq, end, ids, depth), rank))
    if not found:
        return []
    match = max(o.match for o in found)
    live = sorted((o for o in found if o.match == match), key=lambda o: o.rank)
    limit = min(k, int(match * spec_factor))
    drafts: list[int] = []
    prob = 1.0
    while len(drafts) < limit and live:
        counts: dict[int, int] = {}
        first_seen: dict[int, int] = {}
        for o in live:
            at = o.end + 1 + len(drafts)
            if at < len(o.seq):
                token = o.seq[at]
                counts[token] = counts.get(token, 0) + 1
                first_seen.setdefault(token, o.rank)
        if not counts:
            break
        token = max(counts, key=lambda t: (counts[t], -first_seen[t]))
        prob *= counts[token] / len(live)
        if prob < min_prob:
            break
        drafts.append(token)
        live = [o for o in live if o.end + len(drafts) < len(o.seq)
                and o.seq[o.end + len(drafts)] == token]
    return drafts
