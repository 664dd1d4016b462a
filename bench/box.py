"""Is the box quiet enough to trust a benchmark? What other processes took, before and
during the rounds, and the warning when it was too much.

"Ours" is every server tree the benchmark started plus the benchmark process itself;
everything else the box did in a window (``/proc/stat``) belongs to others.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

from bench import procstat

# Another job using this share of the box (in cores, over a window) makes a benchmark
# worth a warning: on 2 cores, 0.2 cores is already a tenth of what the servers can get.
BUSY_SHARE = 0.1
PRE_RUN_WINDOW_S = 2.0


@dataclass(frozen=True)
class BoxSample:
    wall_s: float
    others_cores: float  # average cores other processes kept busy in the window
    loadavg: float  # 1-minute load average at the window's end (ours included)


def ours_cpu_s(roots: list[int]) -> float:
    procs = procstat.processes()
    return (sum(p.cpu_s for root in roots for p in procstat.tree(root, procs))
            + procstat.self_cpu_s())


class BoxMeter:
    """One window at a time: ``start()``, the work, ``stop()`` -> BoxSample."""

    def __init__(self, roots: Callable[[], list[int]] = list) -> None:
        self.roots = roots
        self._start: tuple[float, float, float] | None = None

    def _now(self) -> tuple[float, float, float]:
        return time.monotonic(), procstat.box_busy_s()[0], ours_cpu_s(self.roots())

    def start(self) -> None:
        self._start = self._now()

    def stop(self) -> BoxSample:
        assert self._start is not None, "stop() before start()"
        (t0, box0, ours0), (t1, box1, ours1) = self._start, self._now()
        wall = max(t1 - t0, 1e-9)
        others = max(0.0, (box1 - box0) - (ours1 - ours0)) / wall
        return BoxSample(wall, others, procstat.loadavg())


def sample_before_run(window_s: float = PRE_RUN_WINDOW_S) -> BoxSample:
    """What the box does while no server of ours runs yet."""
    meter = BoxMeter()
    meter.start()
    time.sleep(window_s)
    return meter.stop()


def describe_before(before: BoxSample, cpus: int) -> str:
    busy = busy_warning(before, [], cpus)
    return (f"box: {cpus} CPUs; before the run: load average {before.loadavg:.2f}, other "
            f"processes {before.others_cores:.2f} cores"
            + (" (busy: see the warning at the end)" if busy else ""))


def busy_warning(before: BoxSample, rounds_others: list[float], cpus: int,
                 share: float = BUSY_SHARE) -> str | None:
    """A warning naming what made the box busy, or None when it was quiet: other
    processes above ``share`` of the cores before or during any round, or a 1-minute load
    average of half the cores or more before the servers started. ``rounds_others``:
    each round's ``others_cores``."""
    limit = share * cpus
    reasons = []
    if before.others_cores > limit:
        reasons.append(f"before the run other processes used {before.others_cores:.2f} "
                       f"cores")
    if before.loadavg >= 0.5 * cpus:
        reasons.append(f"the load average was {before.loadavg:.2f} before the servers "
                       f"started")
    noisy = [x for x in rounds_others if x > limit]
    if noisy:
        mean = sum(rounds_others) / len(rounds_others)
        reasons.append(f"other processes used more than {limit:.2f} cores in {len(noisy)} "
                       f"of {len(rounds_others)} rounds (max {max(noisy):.2f}, mean over "
                       f"all rounds {mean:.2f})")
    if not reasons:
        return None
    return (f"WARNING: the box is busy ({cpus} CPUs): " + "; ".join(reasons)
            + ". Ratios are less certain than their spread suggests; rerun on a quiet box.")
