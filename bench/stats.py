"""How sure a benchmark is: min/median/max per metric, round-by-round ratios between
two servers, and the tables ``bench.ab`` and ``bench.compare`` print.

A round runs every server once on the same prompts (their order alternates from round
to round), so the ratio of one round's pair is the least noisy comparison there is; the
median of those ratios, their range and how many pairs went each way say more than a
ratio of two medians alone.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Spread:
    lo: float
    median: float
    hi: float
    n: int

    @classmethod
    def of(cls, values: Sequence[float]) -> Spread | None:
        """None when there is no finite value."""
        vals = sorted(v for v in values if isinstance(v, (int, float)) and math.isfinite(v))
        if not vals:
            return None
        return cls(vals[0], statistics.median(vals), vals[-1], len(vals))

    @property
    def rel_range(self) -> float:
        """(max - min) / median: what the README quotes as "the spread"."""
        return (self.hi - self.lo) / self.median if self.median else math.inf


def rel_mad(values: Sequence[float]) -> float:
    """Median absolute deviation over the median: a spread one outlier does not set,
    so it can shrink as rounds are added (max - min only grows)."""
    vals = [v for v in values if math.isfinite(v)]
    if len(vals) < 2:
        return math.inf
    med = statistics.median(vals)
    return statistics.median(abs(v - med) for v in vals) / med if med else math.inf


def pair_ratios(num: Sequence[float], den: Sequence[float]) -> list[float]:
    """Round-by-round ``num[i] / den[i]`` (rounds where either is missing or 0 skipped)."""
    return [a / b for a, b in zip(num, den)
            if math.isfinite(a) and math.isfinite(b) and b != 0]


@dataclass(frozen=True)
class Metric:
    label: str
    key: str  # the key in a round's result
    unit: str  # "ms" (stored in seconds), or a format spec for the raw value
    higher_is_better: bool

    def fmt(self, value: float | None) -> str:
        if value is None or not math.isfinite(value):
            return "-"
        return f"{1000 * value:.1f}" if self.unit == "ms" else format(value, self.unit)


METRICS = (
    Metric("output tok/s", "output_tokens_per_s", ".0f", True),
    Metric("TTFT p50 ms", "ttft_s_p50", "ms", False),
    Metric("TTFT p90 ms", "ttft_s_p90", "ms", False),
    Metric("ITL p50 ms", "itl_s_p50", "ms", False),
    Metric("e2e p50 ms", "e2e_s_p50", "ms", False),
    Metric("CPU s / 1k out tok", "cpu_s_per_1k_tokens", ".3f", False),
    Metric("busy after round s", "tail_s", ".1f", False),
    Metric("errors", "errors", ".0f", False),
)


def values(rounds: list[dict], key: str) -> list[float]:
    return [r[key] for r in rounds if key in r]


def ratio_text(num: list[float], den: list[float], higher_is_better: bool) -> str:
    """``median [min..max]`` of the pair ratios and how many pairs favour ``num``."""
    ratios = pair_ratios(num, den)
    spread = Spread.of(ratios)
    if spread is None:
        return "-"
    better = sum(1 for r in ratios if (r > 1) == higher_is_better and r != 1)
    return (f"{spread.median:.2f}x [{spread.lo:.2f}..{spread.hi:.2f}] "
            f"{better}/{len(ratios)} better")


def _cell(metric: Metric, spread: Spread | None) -> str:
    if spread is None:
        return "-"
    return " / ".join(metric.fmt(v) for v in (spread.lo, spread.median, spread.hi))


def summary_table(per_side: dict[str, list[dict]], ratio: tuple[str, str] | None) -> str:
    """One row per metric: each side's min / median / max over its rounds, then the
    ``ratio[0]/ratio[1]`` pair ratios (``x [min..max]``, pairs where ratio[0] did better)."""
    names = list(per_side)
    head = f"{'metric':<20}" + "".join(f"{n + ' min / med / max':>28}" for n in names)
    if ratio:
        head += f"   {ratio[0]}/{ratio[1]} by round pair"
    lines = [head]
    for m in METRICS:
        row = f"{m.label:<20}" + "".join(
            f"{_cell(m, Spread.of(values(per_side[n], m.key))):>28}" for n in names)
        if ratio and all(n in per_side for n in ratio):
            row += "   " + ratio_text(values(per_side[ratio[0]], m.key),
                                      values(per_side[ratio[1]], m.key), m.higher_is_better)
        lines.append(row)
    if ratio:
        lines.append(f"(x > 1: {ratio[0]} higher; 'better' counts the round pairs in which "
                     f"{ratio[0]} did better: higher tok/s, lower latency and CPU)")
    return "\n".join(lines)


def round_line(tag: str, name: str, res: dict) -> str:
    """One measured round, as it finishes."""
    foreign = res.get("foreign_cpu") or {}
    return (f"[{tag}] {name:>6}: {res['output_tokens_per_s']:7.0f} tok/s  TTFT p50 "
            f"{1000 * res['ttft_s_p50']:6.1f} ms  ITL p50 {1000 * res['itl_s_p50']:5.1f} ms  "
            f"CPU {res.get('cpu_s_per_1k_tokens', math.nan):.3f} s/1k tok  busy after "
            f"{res.get('tail_s', math.nan):.1f} s  others "
            f"{res.get('others_cores', math.nan):.2f} cores  errors {res['errors']}"
            + ("  ! also ran: " + ", ".join(f"{k} {v:.2f}s" for k, v in foreign.items())
               if foreign else ""))
