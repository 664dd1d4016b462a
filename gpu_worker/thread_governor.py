"""The worker's torch threads, following the cores the other processes leave idle.

Why: a fixed count is wrong both ways. On a 2-core box the start-up split (cores less one
per other role) gives the worker 1 thread even while the frontend, scheduler and
detokenizer sit idle and a 100M-model step could use both cores; yet threads beyond the
cores that are really free cost far more than they give (measured on a busy 2-core box:
a 256-token prefill of the 100M model 0.73 s at 1 thread, 4.3 s at 2; a tiny model's
32-row decode 7.6 ms -> 24 ms), because a parallel region waits for its slowest thread
and a preempted thread stalls all of them.

So the governor decides twice, before each step:

- **How many cores are free** (``allowed``): every ``period_s`` it reads the box's busy
  CPU time (``/proc/stat``) less this process's own (``time.process_time``): what the
  other processes used, in cores; and how long this process's threads waited on the run
  queue (``/proc/self/task/*/schedstat``). ``allowed`` = the free cores (rounded up past
  ``1 - headroom``), between 1 and the usable cores, and 1 while its threads wait (over
  ``WAIT_LIMIT``): its own spinning threads would otherwise hide the processes they
  starve. It drops at the first sample that shows the cores taken (a thread too many
  collapses a step), and rises only after ``up_after`` samples in a row agree, twice as
  many after each back-off that found it crowding the box (up to ``MAX_HOLD_BACKOFF``).
- **Whether more threads pay for this step**: a small model's op is too short to split
  (the threads' fork and join cost more than the op), a large prefill's is not. Steps
  are bucketed by token count; for each bucket it keeps a moving average of the step's
  wall time at 1 thread and at ``allowed`` threads and uses the faster, re-measuring
  the slower one after ``explore_every`` steps of the bucket (the box changes), then
  twice as late each time it loses again (up to ``MAX_EXPLORE_BACKOFF`` times), so a
  count that never pays costs next to nothing.

The deterministic mode is unaffected: every kernel gives a row the same bits at any
thread count (``MKL_CBWR=AUTO,STRICT`` for the matmuls; the attention and MoE kernels
split rows, never a row's sum), pinned by ``tests/e2e/test_thread_governor.py``.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable

log = logging.getLogger(__name__)

CLOCK_TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
MAX_EXPLORE_BACKOFF = 64
MAX_HOLD_BACKOFF = 64  # a rise after contended back-offs waits up to this many times longer
WAIT_LIMIT = 0.1  # thread-seconds per second this process's threads may wait for a CPU
CHANGE_LOG_INTERVAL_S = 60.0  # thread changes are logged at INFO at most this often


def usable_cpus() -> frozenset[int]:
    """The CPUs this process may run on."""
    try:
        return frozenset(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return frozenset(range(os.cpu_count() or 1))


def busy_seconds(cpus: frozenset[int], path: str = "/proc/stat") -> float | None:
    """CPU seconds the CPUs ``cpus`` have spent busy since boot (None: no /proc)."""
    try:
        with open(path, "rb") as f:
            lines = f.read().split(b"\n")
    except OSError:
        return None
    ticks = 0
    for line in lines[1:]:
        if not line.startswith(b"cpu"):
            break
        fields = line.split()
        if int(fields[0][3:]) in cpus:
            # user nice system idle iowait irq softirq steal (guest time is inside user)
            t = [int(x) for x in fields[1:9]]
            ticks += sum(t) - t[3] - t[4]
    return ticks / CLOCK_TICKS


class ThreadGovernor:
    """Sets the worker's thread count before each step (see the module docstring), between
    1 and ``cores`` (the CPUs it may run on). ``set_threads`` is ``torch.set_num_threads``;
    ``read_box`` gives those CPUs' busy seconds; the readers and the clock are injectable
    so the policy can be tested without a busy box."""

    def __init__(self, cores: int, set_threads: Callable[[int], None], *,
                 read_box: Callable[[], float | None],
                 read_own: Callable[[], float] = time.process_time,
                 read_wait: Callable[[], float | None] = lambda: None,
                 clock: Callable[[], float] = time.monotonic,
                 period_s: float = 0.25, headroom: float = 0.25, up_after: int = 2,
                 explore_every: int = 32, smoothing: float = 0.25) -> None:
        self.ceiling = max(1, cores)
        self._set = set_threads
        self._read_box, self._read_own, self._clock = read_box, read_own, clock
        self._read_wait = read_wait
        self.period_s, self.headroom, self.up_after = period_s, headroom, up_after
        self.explore_every, self.smoothing = explore_every, smoothing
        self.threads = 1
        self.allowed = 1
        self.others = 0.0  # cores the other processes used in the last sample
        self.waiting = 0.0  # this process's threads waiting for a CPU, per second
        self._rises = 0  # samples in a row that would allow more than now
        self._hold = up_after  # idle samples a rise needs; grows after each contended back-off
        self._last = (clock(), read_box(), read_own(), read_wait())
        self._avg: dict[tuple[int, int], float] = {}  # (bucket, threads) -> step seconds
        self._seen: dict[int, int] = {}  # bucket -> steps run
        self._check_at: dict[int, int] = {}  # bucket -> the step count of its next re-check
        self._interval: dict[int, int] = {}  # bucket -> steps between its re-checks
        self._bucket = 0
        self._checking = False  # this step re-measures the slower count
        self._logged = float("-inf")
        set_threads(1)

    def describe(self) -> str:
        """The start-up log's account of what was chosen and why."""
        if self.ceiling == 1:
            return "1 (1 usable core; --worker-threads or OMP_NUM_THREADS to choose)"
        return (f"adaptive, 1 to {self.ceiling} ({self.ceiling} usable cores; more than 1 only "
                f"while the other processes leave cores idle, sampled every {self.period_s:g} s, "
                "and only for steps that measured faster with them; --worker-threads or "
                "OMP_NUM_THREADS fixes it)")

    def before_step(self, tokens: int) -> int:
        """Choose and set the thread count for a step of ``tokens`` tokens; returns it."""
        now = self._clock()
        if now - self._last[0] >= self.period_s:
            self._sample(now)
        self._bucket = max(1, tokens).bit_length()
        want = self._choose(self._bucket) if self.allowed > 1 else 1
        if want != self.threads:
            self._set(want)
            self.threads = want
        return want

    def after_step(self, seconds: float) -> None:
        """Record the wall time of the step ``before_step`` set up."""
        bucket, key = self._bucket, (self._bucket, self.threads)
        old = self._avg.get(key)
        seen = self._seen[bucket] = self._seen.get(bucket, 0) + 1
        if self._checking or old is None:  # an old average is stale: the box changed
            self._avg[key] = seconds
            lost = self._checking and self._best(bucket) != self.threads
            step = min(self._interval.get(bucket, self.explore_every) * 2,
                       self.explore_every * MAX_EXPLORE_BACKOFF) if lost else self.explore_every
            self._interval[bucket] = step
            self._check_at[bucket] = seen + step
            self._checking = False
        else:
            self._avg[key] = old + self.smoothing * (seconds - old)

    def _best(self, bucket: int) -> int:
        one, many = self._avg.get((bucket, 1)), self._avg.get((bucket, self.allowed))
        if one is None:
            return 1
        if many is None:
            return self.allowed
        return 1 if one <= many else self.allowed

    def _choose(self, bucket: int) -> int:
        best = self._best(bucket)
        if (bucket, 1) not in self._avg or (bucket, self.allowed) not in self._avg:
            return best  # the unmeasured count
        if self._seen.get(bucket, 0) >= self._check_at.get(bucket, 0):
            self._checking = True
            return self.allowed if best == 1 else 1
        return best

    def _sample(self, now: float) -> None:
        box, own, wait = self._read_box(), self._read_own(), self._read_wait()
        then, box0, own0, wait0 = self._last
        self._last = (now, box, own, wait)
        if box is None or box0 is None:
            return  # no /proc: stay at 1
        self.others = max(0.0, (box - box0) - (own - own0)) / (now - then)
        # Busy cores alone cannot tell a box shared fairly from one this process crowds:
        # its own spinning threads count as its own and starve the others, who then look
        # idle. Its threads waiting on the run queue can: someone else wanted the cores.
        self.waiting = 0.0 if wait is None or wait0 is None else (wait - wait0) / (now - then)
        contended = self.waiting > WAIT_LIMIT
        fits = 1 if contended else max(1, min(self.ceiling, int(self.ceiling - self.others
                                                                + self.headroom)))
        if fits < self.allowed:  # back off at once
            self._rises = 0
            if contended and self.allowed > 1:  # it crowded the box: rise later next time
                self._hold = min(self._hold * 2, self.up_after * MAX_HOLD_BACKOFF)
            self._change(fits)
        elif fits > self.allowed:
            self._rises += 1
            if self._rises >= self._hold:
                self._rises = 0
                self._change(fits)
        else:
            self._rises = 0
            if self.allowed > 1 and not contended:  # more threads and nobody waits: trust again
                self._hold = max(self.up_after, self._hold - 1)

    def _change(self, allowed: int) -> None:
        self.allowed = allowed
        self._check_at.clear()  # measure the new count soon in every bucket
        self._interval.clear()
        now = self._clock()
        level = logging.INFO if now - self._logged >= CHANGE_LOG_INTERVAL_S else logging.DEBUG
        if level == logging.INFO:
            self._logged = now
        log.log(level, "worker threads: up to %d (the other processes used %.2f of %d cores; "
                "this one's threads waited %.2f s/s for a CPU)", allowed, self.others,
                self.ceiling, self.waiting)


def run_queue_wait_seconds(task_dir: str = "/proc/self/task") -> float | None:
    """Seconds this process's threads have spent runnable but waiting for a CPU (the
    second field of each thread's ``schedstat``); None where the kernel has none."""
    total = 0
    try:
        tids = os.listdir(task_dir)
    except OSError:
        return None
    for tid in tids:
        try:
            with open(f"{task_dir}/{tid}/schedstat", "rb") as f:
                total += int(f.read().split()[1])
        except (OSError, IndexError, ValueError):
            continue  # a thread that ended meanwhile
    return total / 1e9


def for_this_process(set_threads: Callable[[int], None]) -> ThreadGovernor:
    """A governor over the CPUs this process may run on, reading ``/proc``."""
    cpus = usable_cpus()
    return ThreadGovernor(len(cpus), set_threads, read_box=lambda: busy_seconds(cpus),
                          read_wait=run_queue_wait_seconds)
