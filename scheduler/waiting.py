"""The waiting queue: probes first, then by (priority, arrival)."""

from __future__ import annotations

import bisect

from scheduler.request import SchedRequest


class WaitQueue:
    """``/health/generate`` probes first (FCFS among themselves: a probe measures whether
    the engine serves, so it must not wait behind traffic), then lower ``priority``
    first, FCFS within a priority. A preempted request keeps its original arrival number,
    so it goes back ahead of everything that arrived after it."""

    def __init__(self) -> None:
        self._items: list[SchedRequest] = []
        self._keys: list[tuple[bool, int, int]] = []

    def __len__(self) -> int:
        return len(self._items)

    def __bool__(self) -> bool:
        return bool(self._items)

    def __iter__(self):
        return iter(self._items)

    def __contains__(self, req: SchedRequest) -> bool:
        return any(r is req for r in self._items)

    def __getitem__(self, i: int) -> SchedRequest:
        return self._items[i]

    def push(self, req: SchedRequest) -> None:
        key = req.sort_key
        i = bisect.bisect_right(self._keys, key)
        self._keys.insert(i, key)
        self._items.insert(i, req)

    def pop(self, i: int) -> SchedRequest:
        self._keys.pop(i)
        return self._items.pop(i)

    def remove(self, req: SchedRequest) -> None:
        for i, r in enumerate(self._items):
            if r is req:
                del self._items[i]
                del self._keys[i]
                return
        raise ValueError("request not waiting")
