"""One frontend's store of ``/v1/responses`` results, bounded in entries, bytes and age.

Entries are the encoded ``StoredResponse`` (so the byte bound is what they really take,
and a peer frontend gets the bytes as they are). Oldest-stored goes first: past
``max_entries`` or ``max_bytes`` the oldest entries are evicted, and an entry is gone
``ttl_s`` after it was stored (checked on every access, so no timer runs). Ids that left
(evicted, expired, deleted, too large to keep) are remembered, up to as many as the store
holds, so a lookup can say why an id is not there rather than only that it is not.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable

from prometheus_client import Counter, Gauge

from cluster.topology import ResponsesStoreSpec

MIN_TOMBSTONES = 1024


class StoreMetrics:
    """The store's size and its comings and goings, per frontend process."""

    def __init__(self) -> None:
        self.entries = Gauge(
            "candor_responses_store_entries", "Responses held by the frontends' stores "
            "(previous_response_id, GET /v1/responses/{id})", multiprocess_mode="livesum",
            registry=None)
        self.bytes = Gauge(
            "candor_responses_store_bytes", "Encoded bytes of the responses the frontends' "
            "stores hold", multiprocess_mode="livesum", registry=None)
        self.removed = Counter(
            "candor_responses_store_removed", "Stored responses that left a store, by why: "
            "ttl, max_entries, max_bytes, deleted, too_large (never kept)", ["reason"],
            registry=None)
        self.lookups = Counter(
            "candor_responses_store_lookups", "Lookups of stored responses by id, by where "
            "the entry was (local: this frontend; peer: the frontend that stored it) and "
            "whether it was found", ["where", "result"], registry=None)


class Missing(Exception):
    """The id is not in this store; ``why`` says what became of it, if known."""

    def __init__(self, why: str) -> None:
        super().__init__(why)
        self.why = why


class ResponseStore:
    def __init__(self, spec: ResponsesStoreSpec, metrics: StoreMetrics | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.spec = spec
        self.metrics = metrics
        self.clock = clock
        self._entries: OrderedDict[str, tuple[bytes, float]] = OrderedDict()
        self._gone: OrderedDict[str, str] = OrderedDict()
        self.size = 0

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def enabled(self) -> bool:
        return self.spec.max_entries > 0 and self.spec.max_bytes > 0

    def put(self, response_id: str, entry: bytes) -> bool:
        """Keep ``entry``; False when it alone exceeds the byte bound (or storing is off)."""
        self._expire()
        if not self.enabled or len(entry) > self.spec.max_bytes:
            self._forget(response_id, f"it was not kept: its {len(entry)} bytes exceed the "
                         f"store's bound (max_bytes {self.spec.max_bytes})", "too_large")
            return False
        self._entries[response_id] = (entry, self.clock())
        self.size += len(entry)
        while len(self._entries) > self.spec.max_entries:
            self._evict_oldest("max_entries", f"the store keeps at most "
                               f"{self.spec.max_entries} responses (max_entries)")
        while self.size > self.spec.max_bytes:
            self._evict_oldest("max_bytes", f"the store keeps at most {self.spec.max_bytes} "
                               "bytes of responses (max_bytes)")
        self._count()
        return True

    def get(self, response_id: str) -> bytes:
        """The entry, or ``Missing`` saying why not."""
        self._expire()
        found = self._entries.get(response_id)
        if found is None:
            raise Missing(self._gone.get(response_id, "no response with this id was stored "
                                         "here (or it left the store too long ago to say "
                                         "why)"))
        return found[0]

    def delete(self, response_id: str) -> None:
        self.get(response_id)
        entry, _ = self._entries.pop(response_id)
        self.size -= len(entry)
        self._forget(response_id, "it was deleted (DELETE /v1/responses/{id})", "deleted")
        self._count()

    def _expire(self) -> None:
        deadline = self.clock() - self.spec.ttl_s
        while self._entries:
            _, (_, stored) = next(iter(self._entries.items()))
            if stored > deadline:
                break
            self._evict_oldest("ttl", f"it expired: responses are kept {self.spec.ttl_s:g}s "
                               "(ttl_s)")
        self._count()

    def _evict_oldest(self, reason: str, why: str) -> None:
        response_id, (entry, _) = self._entries.popitem(last=False)
        self.size -= len(entry)
        self._forget(response_id, f"it was evicted: {why}", reason)

    def _forget(self, response_id: str, why: str, reason: str) -> None:
        self._gone[response_id] = why
        self._gone.move_to_end(response_id)
        while len(self._gone) > max(MIN_TOMBSTONES, self.spec.max_entries):
            self._gone.popitem(last=False)
        if self.metrics is not None:
            self.metrics.removed.labels(reason).inc()

    def _count(self) -> None:
        if self.metrics is not None:
            self.metrics.entries.set(len(self._entries))
            self.metrics.bytes.set(self.size)
