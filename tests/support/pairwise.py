"""Pairwise covering arrays: few rows such that every allowed pair of factor values meets
in at least one row.

A table-driven end-to-end test with a dozen factors cannot run their full product (one
server request per row, servers that cost seconds to start), but most interaction bugs
need only two features together. ``covering_array`` builds the rows greedily (AETG
style: several candidate rows per step, each seeded with a pair still uncovered and
filled value by value with whatever covers most new pairs; the best candidate is kept),
deterministically for a given ``seed``. ``every_pair`` is the exhaustive alternative:
one row per allowed pair, the other factors at their first allowed value.

``allowed(partial)`` judges a partial row (a dict of some factors): it must return False
only when the values it sees already break a rule, so a row can be grown one factor at a
time. A pair that no complete row can hold is left out of both.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Mapping, Sequence
from itertools import combinations
from typing import Any

Row = dict[str, Any]
Allowed = Callable[[Row], bool]
# a pair as (factor index, value index, factor index, value index), first factor lower
Pair = tuple[int, int, int, int]


def complete(factors: Mapping[str, Sequence], allowed: Allowed, row: Row) -> Row | None:
    """``row`` with every missing factor at its first value that keeps the row allowed,
    in ``factors``' order, or None where some factor has no such value."""
    out = dict(row)
    for name, values in factors.items():
        if name in out:
            continue
        for value in values:
            if allowed({**out, name: value}):
                out[name] = value
                break
        else:
            return None
    return {name: out[name] for name in factors}


def _pairs_of(names: list[str], factors: Mapping[str, Sequence], row: Row) -> set[Pair]:
    index = [list(factors[n]).index(row[n]) for n in names]
    return {(i, index[i], j, index[j]) for i, j in combinations(range(len(names)), 2)}


def allowed_pairs(factors: Mapping[str, Sequence], allowed: Allowed) -> list[Pair]:
    """Every pair of values some complete row allows, in a fixed order."""
    names = list(factors)
    out = []
    for i, j in combinations(range(len(names)), 2):
        for vi, a in enumerate(factors[names[i]]):
            for vj, b in enumerate(factors[names[j]]):
                row = {names[i]: a, names[j]: b}
                if allowed(row) and complete(factors, allowed, row) is not None:
                    out.append((i, vi, j, vj))
    return out


def every_pair(factors: Mapping[str, Sequence], allowed: Allowed) -> list[Row]:
    """One row per allowed pair (the rest at their first allowed values), duplicates
    dropped: the exhaustive table a covering array compresses."""
    names = list(factors)
    rows: list[Row] = []
    seen: set[tuple] = set()
    for i, vi, j, vj in allowed_pairs(factors, allowed):
        row = complete(factors, allowed, {names[i]: factors[names[i]][vi],
                                           names[j]: factors[names[j]][vj]})
        key = tuple(list(factors[n]).index(row[n]) for n in names)
        if key not in seen:
            seen.add(key)
            rows.append(row)
    return rows


def covering_array(factors: Mapping[str, Sequence], allowed: Allowed, *, seed: int = 0,
                   candidates: int = 24) -> list[Row]:
    """Rows (dicts, factors in ``factors``' order) covering every allowed pair."""
    names = list(factors)
    rng = random.Random(seed)
    uncovered = set(allowed_pairs(factors, allowed))
    rows: list[Row] = []
    while uncovered:
        best, best_gain = None, 0
        for _ in range(candidates):
            row = _candidate(names, factors, allowed, sorted(uncovered), uncovered, rng)
            if row is None:
                continue
            gain = len(_pairs_of(names, factors, row) & uncovered)
            if gain > best_gain:
                best, best_gain = row, gain
        if best is None:  # cannot happen for pairs allowed_pairs kept; never loop forever
            raise AssertionError(f"no allowed row covers any of {sorted(uncovered)[:5]}")
        rows.append(best)
        uncovered -= _pairs_of(names, factors, best)
    return rows


def _candidate(names: list[str], factors: Mapping[str, Sequence], allowed: Allowed,
               open_pairs: list[Pair], uncovered: set[Pair], rng: random.Random) -> Row | None:
    i, vi, j, vj = rng.choice(open_pairs)
    row: Row = {names[i]: factors[names[i]][vi], names[j]: factors[names[j]][vj]}
    rest = [k for k in range(len(names)) if k not in (i, j)]
    rng.shuffle(rest)
    for k in rest:
        name = names[k]
        scored = []
        for vk, value in enumerate(factors[name]):
            trial = {**row, name: value}
            if not allowed(trial):
                continue
            gain = 0
            for other, other_value in row.items():
                o = names.index(other)
                ov = list(factors[other]).index(other_value)
                pair = (o, ov, k, vk) if o < k else (k, vk, o, ov)
                gain += pair in uncovered
            scored.append((gain, rng.random(), value))
        if not scored:
            return None
        row[name] = max(scored, key=lambda s: (s[0], s[1]))[2]
    return {name: row[name] for name in names}
