"""The shared KV store's policy: the scheduler's half of the store (absent without one).

Reads: a new request whose leading full prompt blocks are not all in the local prefix
cache is parked while the store is asked for the rest (``StoreLookup``: their chain
hashes past the local run). The store answers how many it holds (``StoreHeld``) and sends
each rank its shards; every rank reports them (``KvReceived``). All in: the request
takes its local run, blocks for the found ones and the plan that schedules its first
chunk imports them before its forward (``KvImport``, ``pending_imports``); it then counts
them as computed (``cached_tokens`` says so). Blocks the worker no longer holds by then
fail the import, and the request computes its prompt after all (``RequestFailure.recompute``).
No answer within ``lookup_timeout_s``, a refused shard, no free blocks, or a local run
that changed meanwhile: the request runs as a miss. A store that missed its deadline is
not asked again for ``DOWN_S``, so a dead store costs one deadline, not one per request.

Writes: each plan names the full blocks its chunks complete (``KvStorePut``, beside the
imports in its ``KvStorePlan``) that this
scheduler has not sent before (or that a lookup found missing since: evicted); the ranks
copy them out after the step (write-behind).

Keys: ``store_chain`` hashes a block's tokens onto its parent's chain hash and the
request's ``cache_salt`` (blake2b: the same in every process); ``namespace`` (from the
worker) adds the checkpoint, dtype and layout. Requests under a LoRA adapter neither
read nor write: adapter ids are numbered per replica, so they cannot key a shared store.
"""

from __future__ import annotations

import hashlib
import logging
import time
from collections import OrderedDict
from dataclasses import dataclass, field

import msgspec
import zmq

from cluster.metrics import KvStoreReadMetrics
from cluster.process_config import SchedulerConfig
from protocol import ipc
from protocol import kv_store as msg
from protocol.transport import open_socket
from scheduler.kv_connectors.base import KvHost, KvPolicy
from scheduler.kv_connectors.pending_imports import PendingImports
from scheduler.planner import PlannedStep, Planner
from scheduler.request import SchedRequest

log = logging.getLogger("scheduler")

DOWN_S = 5.0  # after a lookup missed its deadline: misses without asking, this long
MAX_SENT = 200_000  # chain hashes remembered as already sent (oldest forgotten first)
SEND_HWM = 64


def store_chain(parent: bytes, salt: str | None, tokens: list[int],
                images: tuple[bytes, ...] = ()) -> bytes:
    """``images``: the content hash of each image whose placeholder span the block
    overlaps (as the prefix cache's key: two images behind the same ids never alias)."""
    h = hashlib.blake2b(parent, digest_size=16)
    h.update(b"\x00" if salt is None else b"\x01" + salt.encode() + b"\x00")
    h.update(b"".join(t.to_bytes(4, "little", signed=True) for t in tokens))
    for content in images:
        h.update(b"\x02" + content)
    return h.digest()


def store_chains(sreq: SchedRequest, n: int, block_size: int) -> list[bytes]:
    """Chain hashes of the first ``n`` full blocks (memoised on the request)."""
    chains = sreq.store_chains
    while len(chains) < n:
        i = len(chains)
        start, end = i * block_size, (i + 1) * block_size
        images = tuple(im.content_hash for im in sreq.req.images
                       if im.offset < end and im.offset + im.length > start)
        chains.append(store_chain(chains[-1] if i else b"", sreq.req.cache_salt,
                                  sreq.token_ids[start:end], images))
    return chains


@dataclass
class _Lookup:
    sreq: SchedRequest
    first: int  # the local run when asked: the store was asked for blocks from here
    asked: int  # blocks asked for
    deadline: float  # monotonic
    held: int | None = None
    ok: set[int] = field(default_factory=set)
    refused: bool = False


class StoreReads(KvPolicy):
    takes = (msg.StoreHeld, ipc.KvReceived)

    @classmethod
    def configured(cls, cfg: SchedulerConfig) -> bool:
        return cfg.kv_store is not None

    def __init__(self, ctx: zmq.Context, cfg: SchedulerConfig) -> None:
        assert cfg.kv_store is not None
        self.timeout_s = cfg.kv_store.lookup_timeout_s
        self.enabled = cfg.engine.enable_prefix_caching
        self.sock = open_socket(ctx, zmq.PUSH, cfg.addresses.kv_store, bind=False,
                                send_hwm=SEND_HWM)
        self.encoder = msgspec.msgpack.Encoder()
        self.reply_to = cfg.addresses.scheduler_in
        self.ranks = cfg.addresses.kv_store_rank_in
        self.namespace = b""  # the worker's (WorkerReady); nothing is asked before it
        self.block_size = cfg.engine.block_size  # the worker's, once it is ready
        self.sent: OrderedDict[bytes, None] = OrderedDict()
        self.lookups: dict[str, _Lookup] = {}
        self.imports = PendingImports()
        self.down_until = 0.0
        self.metrics = KvStoreReadMetrics()

    def worker_ready(self, ready: ipc.WorkerReady) -> None:
        self.namespace = ready.kv_namespace
        self.block_size = ready.block_size

    def _shares(self, sreq: SchedRequest) -> bool:
        req = sreq.req
        return (self.enabled and bool(self.namespace) and not sreq.adapter
                and req.pooling is None and req.sampling.prompt_logprobs < 0)

    # ------------------------------------------------------------------ reads
    def park(self, sreq: SchedRequest, planner: Planner) -> bool:
        """Ask the store for ``sreq``'s blocks past its local run; True: it waits."""
        if not self._shares(sreq):
            return False
        bs = planner.block_size
        # a hit never covers the last token, nor ends inside a whole image (Gemma 3)
        limit = sreq.whole_blocks((len(sreq.token_ids) - 1) // bs, bs)
        if limit == 0:
            return False
        local = sreq.whole_blocks(len(planner.cached_run(sreq, limit)), bs)
        if local >= limit:
            return False
        if time.monotonic() < self.down_until:
            self.metrics.misses.inc(limit - local)
            return False
        chains = store_chains(sreq, limit, bs)
        lookup = msg.StoreLookup(sreq.rid, self.namespace, chains[local:], self.reply_to,
                                 self.ranks)
        try:
            self.sock.send(self.encoder.encode(lookup), flags=zmq.NOBLOCK, copy=False)
        except zmq.Again:  # not connected or not keeping up
            self.metrics.misses.inc(limit - local)
            return False
        self.lookups[sreq.rid] = _Lookup(sreq, local, limit - local,
                                         time.monotonic() + self.timeout_s)
        return True

    def on_message(self, message: msg.StoreHeld | ipc.KvReceived, host: KvHost) -> None:
        if isinstance(message, msg.StoreHeld):
            self.on_held(message)
        else:
            self.on_received(message)

    def on_held(self, held: msg.StoreHeld) -> None:
        lookup = self.lookups.get(held.rid)
        if lookup is not None:
            lookup.held = held.blocks

    def on_received(self, report: ipc.KvReceived) -> None:
        lookup = self.lookups.get(report.rid)
        if lookup is None:
            return  # late: it ran as a miss (the rank's copy expires)
        if report.ok:
            lookup.ok.add(report.rank)
        else:
            lookup.refused = True
            log.warning("%s: KV store blocks refused by rank %d (%s); computing them",
                        report.rid, report.rank, report.reason)

    @property
    def pending(self) -> bool:
        return bool(self.lookups)

    def settle(self, planner: Planner) -> list[SchedRequest]:
        """Parked requests decided now (hits with blocks and a queued import, or misses),
        to enqueue; aborted ones are dropped."""
        now = time.monotonic()
        out: list[SchedRequest] = []
        for rid, lookup in list(self.lookups.items()):
            sreq = lookup.sreq
            if sreq.finished:
                del self.lookups[rid]
                continue
            all_in = lookup.held == 0 or (lookup.held and len(lookup.ok) >= len(self.ranks))
            if not (all_in or lookup.refused or now >= lookup.deadline):
                continue
            del self.lookups[rid]
            if lookup.held is None:
                self.down_until = now + DOWN_S
                log.warning("the KV store did not answer within %.2fs; computing prompts "
                            "without it for %.0fs", self.timeout_s, DOWN_S)
            hits = self._adopt(lookup, planner) if all_in and lookup.held else 0
            if lookup.held is not None:  # what the store lacks (evicted?) is sent again
                for chain in sreq.store_chains[lookup.first + lookup.held:
                                               lookup.first + lookup.asked]:
                    self.sent.pop(chain, None)
            self.metrics.hits.inc(hits)
            self.metrics.misses.inc(lookup.asked - hits)
            out.append(sreq)
        return out

    def _adopt(self, lookup: _Lookup, planner: Planner) -> int:
        """Take the local run and blocks for the found ones; the blocks imported."""
        sreq, held = lookup.sreq, lookup.held
        assert held
        local = planner._match_prefix(sreq)  # noqa: SLF001 - the admission's own match
        if local != lookup.first:  # the local cache changed meanwhile: keep what it has
            return 0
        if sreq.whole_blocks(local + held, planner.block_size) != local + held:
            return 0  # the store's run ends inside a whole image: computed instead
        blocks = planner.allocator.allocate(held)
        if blocks is None:
            return 0
        sreq.block_table.extend(blocks)
        sreq.reset_computed((local + held) * planner.block_size)
        self.imports.add(sreq, local, ipc.KvImport(sreq.rid, blocks))
        return held

    def take_imports(self, chunks: list[ipc.SeqChunk]) -> list[ipc.KvImport]:
        """The imports of the requests the plan going out (``chunks``) schedules, that
        still hold their blocks."""
        return self.imports.take(chunks)

    def plan(self, planned: PlannedStep,
             requests: dict[str, SchedRequest]) -> ipc.KvStorePlan | None:
        imports = self.take_imports(planned.chunks)
        puts = self.puts(planned, self.block_size)
        return ipc.KvStorePlan(imports, puts) if imports or puts else None

    # ------------------------------------------------------------------ writes
    def puts(self, planned: PlannedStep, block_size: int) -> list[ipc.KvStorePut]:
        """The full blocks this step's chunks complete that were never sent."""
        out = []
        for (sreq, n), chunk in zip(planned.members, planned.chunks):
            if not self._shares(sreq):
                continue
            start = chunk.start_pos
            end = min(start + n, len(sreq.token_ids)) // block_size
            if end <= start // block_size:
                continue
            chains = store_chains(sreq, end, block_size)
            blocks, hashes = [], []
            for i in range(start // block_size, end):
                if chains[i] not in self.sent:
                    self.sent[chains[i]] = None
                    blocks.append(sreq.block_table[i])
                    hashes.append(chains[i])
            while len(self.sent) > MAX_SENT:
                self.sent.popitem(last=False)
            if blocks:
                out.append(ipc.KvStorePut(sreq.rid, blocks, hashes))
        return out
