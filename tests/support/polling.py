"""Wait for a condition with a deadline instead of sleeping a fixed time and hoping.

A test that needs something to have happened (a heartbeat carrying new counters, a
process gone, a request admitted) polls for it: fast when the machine is fast, and a
failure that names what never happened, with the last value seen, when it is not. An
async test with tasks in flight calls it through ``asyncio.to_thread`` so they keep
running meanwhile.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any, TypeVar

T = TypeVar("T")


def wait_until(probe: Callable[[], T], what: str, *, until: Callable[[T], Any] = bool,
               timeout: float = 10.0, interval: float = 0.05) -> T:
    """Call ``probe`` until ``until`` holds for its value (by default: the value is
    truthy) and return that value; an AssertionError naming ``what`` and the last value
    once ``timeout`` seconds pass."""
    deadline = time.monotonic() + timeout
    while True:
        value = probe()
        if until(value):
            return value
        if time.monotonic() >= deadline:
            raise AssertionError(f"timed out after {timeout:g}s waiting for {what}; "
                                 f"last: {value!r}")
        time.sleep(interval)
