"""Prompt KV imports waiting for the plan that schedules their request.

A request whose prompt KV comes from elsewhere (a prefill replica's transfer, blocks the
shared KV store found) holds blocks for it and waits in the queue like any other. The
worker writes the KV into those blocks (``KvImport``) in the plan that carries the
request's first chunk, never earlier: only there does the worker know the request (its
sampling state, which a transfer's generator state goes into) and report an import it
could not write as that request's own failure (``StepResult.failed``). A plan that
imported for a request it did not schedule would leave a failed import with nobody to
fail, and the request would later decode over blocks nobody wrote.

A request that gave its blocks back before it ran (finished, or admitted without room
and rewound to compute its prompt) drops its import.
"""

from __future__ import annotations

from protocol import ipc
from scheduler.request import SchedRequest


class PendingImports:
    def __init__(self) -> None:
        # rid -> (the request, the index of its first imported block, the import)
        self.waiting: dict[str, tuple[SchedRequest, int, ipc.KvImport]] = {}

    def add(self, sreq: SchedRequest, first: int, imp: ipc.KvImport) -> None:
        self.waiting[sreq.rid] = (sreq, first, imp)

    def take(self, chunks: list[ipc.SeqChunk]) -> list[ipc.KvImport]:
        """The imports for the plan whose ``chunks`` are these: those of the requests it
        schedules; the others wait (or are dropped, with their blocks gone)."""
        if not self.waiting:
            return []
        scheduled = {c.rid for c in chunks}
        out = []
        for rid, (sreq, first, imp) in list(self.waiting.items()):
            if sreq.finished or sreq.block_table[first:first + len(imp.blocks)] != imp.blocks:
                del self.waiting[rid]
            elif rid in scheduled:
                del self.waiting[rid]
                out.append(imp)
        return out
