"""CPU seconds from /proc: a server's whole process tree, and the whole box.

Why /proc and not each server's own metrics: the same numbers for every server (Candor,
vLLM, an old commit that exports less), with nothing added to their hot paths.

A tree's CPU is ``utime + stime + cutime + cstime`` summed over the live processes that
descend from the root or share its process group: a child that exited and was reaped
moved its time into its parent's ``c*time``, so short-lived helpers (a compiler the
worker spawned, a restarted role) stay counted and nothing counts twice. The box's busy
time comes from ``/proc/stat`` (every CPU, exited processes included), so "other
processes" = box busy - ours, even for jobs that start and end between two samples.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from dataclasses import dataclass

TICK_S = 1.0 / os.sysconf("SC_CLK_TCK")


@dataclass(frozen=True)
class ProcInfo:
    pid: int
    ppid: int
    pgrp: int
    name: str  # the kernel's comm (15 chars): a fallback when the cmdline says nothing
    cpu_s: float  # utime + stime + cutime + cstime


def parse_stat(pid: int, text: str) -> ProcInfo:
    """One ``/proc/PID/stat`` line; comm may hold spaces and parentheses, so fields are
    counted from its last ')'."""
    name = text[text.index("(") + 1:text.rindex(")")]
    fields = text[text.rindex(")") + 2:].split()
    # fields[0] is state (field 3); ppid 4, pgrp 5; utime 14, stime 15, cutime 16, cstime 17
    ticks = sum(int(fields[i]) for i in (11, 12, 13, 14))
    return ProcInfo(pid, int(fields[1]), int(fields[2]), name, ticks * TICK_S)


def processes() -> dict[int, ProcInfo]:
    """Every process readable now (one that exits while being read is skipped)."""
    out = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as fh:
                out[int(entry)] = parse_stat(int(entry), fh.read())
        except (OSError, ValueError, IndexError):
            continue
    return out


def tree(root: int, procs: dict[int, ProcInfo]) -> list[ProcInfo]:
    """The root, its descendants, and whatever else is in its process group."""
    children: dict[int, list[int]] = {}
    for p in procs.values():
        children.setdefault(p.ppid, []).append(p.pid)
    found, todo = set(), [root]
    while todo:
        pid = todo.pop()
        if pid in procs and pid not in found:
            found.add(pid)
            todo.extend(children.get(pid, ()))
    found.update(p.pid for p in procs.values() if p.pgrp == root)
    return [procs[pid] for pid in sorted(found)]


def role_of(pid: int, fallback: str) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as fh:
            argv = [a.decode(errors="replace") for a in fh.read().split(b"\0") if a]
    except OSError:
        return fallback
    return role_from_argv(argv, fallback)


def role_from_argv(argv: list[str], fallback: str) -> str:
    """``python -m pkg.ROLE ...`` -> ROLE, ``... launch_cluster.py`` -> launcher, else
    ``fallback``, the process name (vLLM names its engine process ``VLLM::EngineCore``)."""
    for i, arg in enumerate(argv[:-1]):
        if arg == "-m":
            return argv[i + 1].rsplit(".", 1)[-1]
    if any(a.endswith("launch_cluster.py") for a in argv):
        return "launcher"
    return fallback


def cpu_by_role(roots: Iterable[int], procs: dict[int, ProcInfo] | None = None
                ) -> dict[str, float]:
    """CPU seconds of each role over the trees of ``roots`` (several processes of one
    role add up)."""
    procs = processes() if procs is None else procs
    out: dict[str, float] = {}
    for root in roots:
        for p in tree(root, procs):
            role = role_of(p.pid, p.name)
            out[role] = out.get(role, 0.0) + p.cpu_s
    return out


def self_cpu_s() -> float:
    """This process's own CPU (the load generator's share), children excluded: the
    servers it started are counted in their own trees."""
    t = os.times()
    return t.user + t.system


def box_busy_s() -> tuple[float, int]:
    """Busy CPU seconds of the whole box since boot and its CPU count, from /proc/stat
    (user+nice+system+irq+softirq+steal; guest time is already inside user)."""
    with open("/proc/stat") as fh:
        lines = fh.read().splitlines()
    fields = [int(x) for x in lines[0].split()[1:]]
    busy = fields[0] + fields[1] + fields[2] + sum(fields[5:8])
    cpus = sum(1 for line in lines if line.startswith("cpu") and line[3:4].isdigit())
    return busy * TICK_S, cpus


def loadavg() -> float:
    return os.getloadavg()[0]


def rss_bytes(pid: int) -> int:
    """VmRSS of one process (0 once it is gone)."""
    try:
        with open(f"/proc/{pid}/status") as fh:
            for line in fh:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def rss_by_role(root: int) -> dict[str, int]:
    """Resident bytes of each role in the tree of ``root`` (several processes of one role
    add up; pages two processes share count in both)."""
    out: dict[str, int] = {}
    for p in tree(root, processes()):
        role = role_of(p.pid, p.name)
        out[role] = out.get(role, 0) + rss_bytes(p.pid)
    return out
