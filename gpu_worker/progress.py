"""Progress of the slow start-up steps (reading the weights, allocating the KV cache) as
periodic log lines with percent and throughput, so an operator watching a multi-minute
start sees it move, and a stall shows where it stopped."""

from __future__ import annotations

import logging
import time

log = logging.getLogger("gpu_worker.progress")
MB = 1e6


class Progress:
    """Counts bytes done out of ``total``; logs at most every ``interval_s``, and once
    at the end (with the average rate)."""

    def __init__(self, what: str, total: int, interval_s: float = 2.0,
                 logger: logging.Logger | None = None) -> None:
        self.what = what
        self.total = max(1, total)
        self.interval_s = interval_s
        self.log = logger or log
        self.done_bytes = 0
        self.start = self.last = time.monotonic()
        self.lines = 0

    def advance(self, nbytes: int) -> None:
        self.done_bytes += nbytes
        now = time.monotonic()
        if now - self.last >= self.interval_s and self.done_bytes < self.total:
            self.last = now
            self._line(now, "")

    def finish(self) -> None:
        self._line(time.monotonic(), " done")

    def _line(self, now: float, suffix: str) -> None:
        elapsed = max(now - self.start, 1e-9)
        self.lines += 1
        self.log.info("%s%s: %.0f%% (%.0f of %.0f MB) at %.0f MB/s, %.1fs", self.what, suffix,
                      100 * self.done_bytes / self.total, self.done_bytes / MB,
                      self.total / MB, self.done_bytes / MB / elapsed, elapsed)
