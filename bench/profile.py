"""Where a server's time went in a round: CPU seconds of each process role (from /proc,
any server) and the step loop's wall-time phases that Candor's scheduler exports on
/metrics (``candor_step_phase_seconds``; ``candor_worker_idle_seconds`` for the worker's
idle gaps while work was queued). Both are read before and after a round, so the
profile costs the servers nothing beyond the counters they keep anyway.

An older commit that exports no phases shows "-" for them; its CPU rows still compare.
"""

from __future__ import annotations

import math
import statistics
import urllib.request

from prometheus_client.parser import text_string_to_metric_families

from bench.stats import pair_ratios

PHASE_FAMILY = "candor_step_phase_seconds"
IDLE_FAMILY = "candor_worker_idle_seconds"
# phase label -> what the row says (the order the step loop runs them in)
PHASES = {
    "sched_intake": "scheduler: intake (new requests, aborts)",
    "sched_plan": "scheduler: planning",
    "sched_postprocess": "scheduler: postprocess (tokens, finishes)",
    "sched_ipc": "scheduler: IPC (plans, results, token batches)",
    "worker_prepare": "worker: prepare (plan state, batch)",
    "worker_forward": "worker: model forward",
    "worker_sample": "worker: sampler + logprobs",
    "worker_grammar": "worker: grammar (on the critical path)",
    "worker_send": "worker: send results",
    "worker_idle": "worker: idle, work queued",
}


def scrape_phases(base_url: str, timeout: float = 10) -> dict[str, float]:
    """Cumulative step-loop seconds by phase from ``/metrics`` ({} if it has none or
    cannot be read: a peer server, an older commit)."""
    try:
        with urllib.request.urlopen(base_url.rstrip("/") + "/metrics", timeout=timeout) as r:
            text = r.read().decode()
    except OSError:
        return {}
    return phases_from_text(text)


def phases_from_text(text: str) -> dict[str, float]:
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if family.name == PHASE_FAMILY and s.name.endswith("_total"):
                phase = s.labels.get("phase", "")
                out[phase] = out.get(phase, 0.0) + s.value
            elif family.name == IDLE_FAMILY and s.name == IDLE_FAMILY + "_sum":
                out["worker_idle"] = out.get("worker_idle", 0.0) + s.value
    return out


def delta(after: dict[str, float], before: dict[str, float]) -> dict[str, float]:
    return {k: v - before.get(k, 0.0) for k, v in after.items()}


def _per_1k(rounds: list[dict], field: str, key: str) -> float:
    """Median over rounds of ``round[field][key]`` in ms per 1k output tokens."""
    vals = [1e6 * r[field][key] / r["output_tokens"] for r in rounds
            if key in r.get(field, {}) and r.get("output_tokens")]
    return statistics.median(vals) if vals else math.nan


def _fmt(x: float) -> str:
    return "-" if not math.isfinite(x) else f"{x:.1f}"


def profile_table(per_side: dict[str, list[dict]], ratio: tuple[str, str] | None) -> str:
    """Rows: CPU of each role, then the step-loop phases; columns: each side's median in
    ms per 1k output tokens (and the ratio of those medians)."""
    names = list(per_side)
    roles: dict[str, float] = {}
    for rounds in per_side.values():
        for r in rounds:
            for role, secs in r.get("cpu_by_role", {}).items():
                roles[role] = max(roles.get(role, 0.0), secs)
    rows = [(f"CPU {role}", "cpu_by_role", role)
            for role in sorted(roles, key=lambda k: -roles[k])]
    rows += [(label, "phases_s", phase) for phase, label in PHASES.items()]
    lines = [f"{'ms per 1k output tokens (median over rounds)':<46}"
             + "".join(f"{n:>10}" for n in names) + (f"{ratio[0] + '/' + ratio[1]:>14}"
                                                     if ratio else "")]
    for label, field, key in rows:
        vals = {n: _per_1k(per_side[n], field, key) for n in names}
        if not any(math.isfinite(v) for v in vals.values()):
            continue
        line = f"  {label:<44}" + "".join(f"{_fmt(vals[n]):>10}" for n in names)
        if ratio:
            r = pair_ratios([vals[ratio[0]]], [vals[ratio[1]]])
            line += f"{(f'{r[0]:.2f}x' if r else '-'):>14}"
        lines.append(line)
    lines.append("  (CPU: utime+stime of each role's processes, from /proc; scheduler/worker "
                 "rows: wall time of the step loop's phases from /metrics, '-' where a "
                 "side exports none)")
    return "\n".join(lines)
