"""Hand the C heap's free pages back to the OS when the worker goes idle.

A prefill chunk's activations (a 1k-token chunk of make serve's model: about 100 MiB)
are freed after the step, but glibc keeps most of them: its mmap threshold rises as big
blocks are freed, so later ones come from the heap, whose free pages it returns only
from the top. The worker's RSS would then stay at the peak of its largest step for good.
``malloc_trim(0)`` returns every free page; it walks the heap (milliseconds), so it runs
once per idle spell, after a plan-less poll turn, never between steps under load.
Where the C library is not glibc there is nothing to call, and nothing happens.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from cluster.heap import glibc_trim

log = logging.getLogger(__name__)


class HeapTrim:
    """``stepped()`` after each step, ``idle()`` after each turn without a plan: the
    first idle turn after steps trims the heap, later ones do nothing."""

    def __init__(self, trim: Callable[[int], int] | None = None) -> None:
        self._trim = trim
        self._dirty = False
        self.trims = 0

    @classmethod
    def for_this_process(cls) -> HeapTrim:
        return cls(glibc_trim())

    def stepped(self) -> None:
        self._dirty = True

    def idle(self) -> None:
        if not self._dirty or self._trim is None:
            return
        self._dirty = False
        self._trim(0)
        self.trims += 1
