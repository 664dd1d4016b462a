"""The prefill/decode transfer's policies: the scheduler's half of disaggregated
prefill/decode (absent on a colocated replica).

Prefill replica (``PrefillHandoffs``): a request stamped with a decode replica runs here
with one token to generate. Each plan with a chunk of its prompt asks the worker to
export, after the step, the blocks that chunk completed (``KvExport``, in its
``PdTransferPlan``): a prompt
prefilled in several chunks streams its KV while later chunks compute, and the chunk
that samples the first token sends the rest. When the token comes back the
request leaves this replica (its blocks are freed as for any finished request, once the
worker has copied them out) and the decode scheduler is told (``KvHandoff``); a first
token that ends the request (eos, a stop id, max_tokens 1) finishes here instead.

Decode replica (``DecodeIntake``): a handed request waits for its KV, which arrives on
the worker side; every rank reports its shard (``KvReceived``), in either order with the
handoff. All shards in: blocks are allocated and the plan that schedules the request's
first chunk, which feeds the first token at position len(prompt), imports the KV into
them before its forward (``KvImport``, ``pending_imports``). A refused shard, no free
blocks, no KV within the deadline, or an import the worker could not write
(``RequestFailure.recompute``): the request recomputes its prompt here, like a preempted
one (partial KV is never used).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

import msgspec
import zmq

from cluster.metrics import KvTransferMetrics
from cluster.process_config import SchedulerConfig
from protocol import ipc
from protocol.transport import Sender
from scheduler.kv_connectors.base import KvHost, KvPolicy
from scheduler.kv_connectors.pending_imports import PendingImports
from scheduler.planner import PlannedStep, Planner
from scheduler.request import SchedRequest

log = logging.getLogger("scheduler")


class PrefillHandoffs(KvPolicy):
    @classmethod
    def configured(cls, cfg: SchedulerConfig) -> bool:
        return cfg.replica_role == "prefill"

    def __init__(self, ctx: zmq.Context, cfg: SchedulerConfig) -> None:
        self.to_schedulers = [Sender(ctx, a) for a in cfg.addresses.schedulers_in()]
        self.replica = cfg.replica
        self.block_size = cfg.engine.block_size
        self.originals: dict[str, ipc.TokenizedReq] = {}  # rid -> as it arrived
        self.exported: dict[str, int] = {}  # rid -> leading blocks already sent ahead

    def admit(self, req: ipc.TokenizedReq) -> ipc.TokenizedReq:
        """The request this replica runs: its first token only, when it is handed on."""
        if req.decode_replica < 0 or req.max_tokens <= 1:
            return req
        self.originals[req.rid] = req
        return msgspec.structs.replace(req, max_tokens=1)

    def plan(self, planned: PlannedStep,
             requests: dict[str, SchedRequest]) -> ipc.PdTransferPlan | None:
        exports = self.exports(planned.chunks, requests)
        return ipc.PdTransferPlan(exports=exports) if exports else None

    def exports(self, chunks: list[ipc.SeqChunk],
                requests: dict[str, SchedRequest]) -> list[ipc.KvExport]:
        out = []
        for c in chunks:
            req = self.originals.get(c.rid)
            if req is None or requests[c.rid].num_generated:
                continue
            sent = self.exported.get(c.rid, 0)
            if c.sample:
                self.exported.pop(c.rid, None)
                out.append(ipc.KvExport(c.rid, req.decode_replica,
                                        len(req.prompt_token_ids), sent))
                continue
            full = (c.start_pos + len(c.token_ids)) // self.block_size
            if full > sent:  # (a recomputed chunk after preemption sends nothing twice)
                self.exported[c.rid] = full
                out.append(ipc.KvExport(c.rid, req.decode_replica, full * self.block_size,
                                        sent, final=False))
        return out

    def hands_on(self, rid: str, finish_reason: str | None) -> bool:
        """After the first token: whether ``rid`` goes on to a decode replica (it does
        unless that token ended it)."""
        return finish_reason == "length" and rid in self.originals

    def hand_off(self, first_output: ipc.TokenOutput) -> None:
        """Hand the request on; its decode replica emits ``first_output`` (``KvHandoff``)."""
        req = self.originals.pop(first_output.rid)
        self.to_schedulers[req.decode_replica].send(ipc.KvHandoff(req, first_output,
                                                                  self.replica))

    def finished(self, rid: str) -> None:
        self.originals.pop(rid, None)
        self.exported.pop(rid, None)


@dataclass
class _Awaiting:
    handoff: ipc.KvHandoff
    deadline: float  # monotonic


@dataclass
class _Shards:
    at: float  # monotonic time of the first report
    ok: set[int] = field(default_factory=set)
    refused: str | None = None


class DecodeIntake(KvPolicy):
    takes = (ipc.KvHandoff, ipc.KvReceived)

    @classmethod
    def configured(cls, cfg: SchedulerConfig) -> bool:
        return cfg.replica_role == "decode"

    def __init__(self, ctx: zmq.Context, cfg: SchedulerConfig) -> None:
        assert cfg.disaggregation is not None
        self.timeout_s = cfg.disaggregation.transfer_timeout_s
        self.ranks = cfg.tensor_parallel
        self.awaiting: dict[str, _Awaiting] = {}
        self.shards: dict[str, _Shards] = {}  # reports, possibly ahead of the handoff
        self.imports = PendingImports()
        self.metrics = KvTransferMetrics()

    @staticmethod
    def request(msg: ipc.KvHandoff, arrival: int) -> SchedRequest:
        """The handed request as this replica runs it: prompt + first token, one token
        generated; the prompt logprobs were the prefill replica's to send."""
        sampling = msgspec.structs.replace(msg.req.sampling, prompt_logprobs=-1)
        req = msgspec.structs.replace(msg.req, sampling=sampling, decode_replica=-1)
        sreq = SchedRequest(req, arrival)
        sreq.token_ids.append(msg.first_output.token_ids[0])
        sreq.num_generated = 1
        sreq.cached_tokens = msg.first_output.cached_tokens or 0
        return sreq

    def on_message(self, msg: ipc.KvHandoff | ipc.KvReceived, host: KvHost) -> None:
        if isinstance(msg, ipc.KvReceived):
            self.on_received(msg)
            return
        rid = msg.req.rid
        if host.take_early_abort(rid):
            return
        if host.holds(rid):
            log.error("dropped a handoff of %s: that request is already here", rid)
            return
        host.emit_now(msg.first_output)  # before any token of ours (KvHandoff says why)
        self.on_handoff(msg)

    def on_handoff(self, msg: ipc.KvHandoff) -> None:
        self.awaiting[msg.req.rid] = _Awaiting(msg, time.monotonic() + self.timeout_s)

    def on_received(self, msg: ipc.KvReceived) -> None:
        shards = self.shards.setdefault(msg.rid, _Shards(time.monotonic()))
        if msg.ok:
            shards.ok.add(msg.rank)
        elif shards.refused is None:
            shards.refused = msg.reason

    def discard(self, rid: str) -> None:
        """Aborted before it ran here."""
        self.awaiting.pop(rid, None)
        self.shards.pop(rid, None)

    def import_lost(self, sreq: SchedRequest, failure: ipc.RequestFailure) -> None:
        self.metrics.failures.labels("import_lost").inc()

    @property
    def pending(self) -> bool:
        return bool(self.awaiting or self.shards)

    def settle(self, planner: Planner) -> list[SchedRequest]:
        """Handoffs decided now: with their blocks and a queued import, or to recompute
        (a fresh request). Shard reports nobody claims expire."""
        now = time.monotonic()
        out: list[SchedRequest] = []
        for rid, wait in list(self.awaiting.items()):
            shards = self.shards.get(rid)
            if shards is not None and shards.refused is not None:  # (the rank counted it)
                log.warning("%s: KV transfer refused (%s); recomputing the prompt", rid,
                            shards.refused)
            elif shards is not None and len(shards.ok) >= self.ranks:
                n = -(-len(wait.handoff.req.prompt_token_ids) // planner.block_size)
                blocks = planner.allocator.allocate(n)
                if blocks is not None:
                    del self.awaiting[rid], self.shards[rid]
                    sreq = self.request(wait.handoff, 0)
                    sreq.block_table = blocks
                    sreq.num_computed = sreq.num_scheduled = len(wait.handoff.req.prompt_token_ids)
                    # a copy: the table grows (the first decode token) before the plan goes
                    self.imports.add(sreq, 0, ipc.KvImport(rid, list(blocks)))
                    out.append(sreq)
                    continue
                self.metrics.failures.labels("no_free_blocks").inc()
            elif now < wait.deadline:
                continue
            else:
                self.metrics.failures.labels("timeout").inc()
                log.warning("%s: no KV within %.1fs; recomputing the prompt", rid,
                            self.timeout_s)
            del self.awaiting[rid]
            self.shards.pop(rid, None)
            out.append(self.request(wait.handoff, 0))
        for rid in [r for r, s in self.shards.items()
                    if r not in self.awaiting and now - s.at > 2 * self.timeout_s]:
            del self.shards[rid]
        return out

    def plan(self, planned: PlannedStep,
             requests: dict[str, SchedRequest]) -> ipc.PdTransferPlan | None:
        """The imports of the live requests the plan about to go out schedules."""
        imports = self.imports.take(planned.chunks)
        return ipc.PdTransferPlan(imports=imports) if imports else None
