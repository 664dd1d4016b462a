"""The scheduler's step loop: up to two steps in flight to the worker.

While the worker runs a step, the loop keeps draining new requests and aborts, so
arrivals never wait on HTTP, tokenization or detokenization. Aborts are applied as soon
as a step returns (blocks freed within one step; see ``planner`` for why blocks a later
queued step still writes may be freed).

Keeping the worker busy: right after sending step N the loop plans step N+1 around N's
tokens (``Planner.plan(lookahead=True)``: placeholders for the tokens N samples) and sends
it too, so the worker starts N+1 the moment N ends instead of waiting for a round trip
through the scheduler. When a step returns, the loop updates request state, frees what
finished or was aborted, queues the next plan, and only then ships the tokens to the
detokenizers. The worker reports how long it sat idle before each plan; the heartbeat
publishes the sum and a recent median over steps where work was waiting
(``worker_idle_*``).

A pooling request (``TokenizedReq.pooling``) has no detokenizer leg: its one result, the
worker's pooled vector, goes straight back to the frontend that asked (``Pooled``).

Plans go out on one PUB socket that every tensor-parallel rank subscribes to (XPUB, so
the loop can count the subscriptions): the worker counts as ready once rank 0 reported
its KV capacity and all ranks are subscribed, so no rank misses the first plan. PUB/SUB
may still drop a plan while a subscriber reconnects, so plans are numbered without gaps
and each heartbeat with steps in flight repeats the newest number (``PlanMark``): a rank
that lost one stops instead of computing on (gpu_worker/plan_order.py).

KV that moves between this replica's cache and elsewhere (a prefill replica's transfer
to a decode replica, a shared KV store) is the KV connectors' business
(``kv_connectors``): the loop calls the policies its topology configured at each point of
a request's life and puts their work in each plan's ``kv``, naming none of them.

LoRA adapters (``adapters``) are loaded and dropped on the ranks through the same
socket, numbered in the same sequence as the plans (a rank that lost one stops just the
same); a load is answered to its frontend once rank 0 says every rank holds it, and the
next heartbeat (sent at once) tells every frontend.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from dataclasses import dataclass

import zmq

from cluster.process_config import SchedulerConfig
from protocol import ipc
from protocol.routing import detokenizer_index
from protocol.transport import Receiver, Sender, SenderPool
from scheduler.adapters import AdapterRegistry
from scheduler.block_manager import BlockAllocator
from scheduler.kv_connectors.registry import KvPolicies
from scheduler.metrics import SchedulerOps
from scheduler.planner import PlannedStep, Planner
from scheduler.request import SchedRequest

HEARTBEAT_S = 0.25
# An abort can overtake its request (the client left, or the frontend failed it, while
# the prompt was being tokenized); remember such rids this long so the late request is
# dropped, not run.
EARLY_ABORT_TTL_S = 60.0
MAX_STEPS_IN_FLIGHT = 2  # the one running and the one queued behind it


@dataclass
class InFlight:
    plan: ipc.StepPlan
    planned: PlannedStep
    sent: float  # monotonic time the plan was sent


def _output(rid: str, ids: list[int], reason: str | None, lp: ipc.SampleLogprobs | None,
            cached_tokens: int | None = None,
            failure: ipc.RequestFailure | None = None) -> ipc.TokenOutput:
    """A TokenOutput, carrying the tokens' (and on the first one, the prompt's) logprobs,
    on the first one the prefix-cache hit, and why a request failed on its own. ``ids``
    may be several (kept drafts, then the sampled token; cut where the request ended)."""
    if lp is None:
        return ipc.TokenOutput(rid, ids, reason, cached_tokens=cached_tokens, failure=failure)
    entries = [*lp.accepted, lp.token][:len(ids)]
    return ipc.TokenOutput(rid, ids, reason, cached_tokens=cached_tokens,
                           logprobs=entries if lp.token.token_id >= 0 else None,
                           prompt_logprobs=lp.prompt)


class EngineLoop:
    def __init__(self, cfg: SchedulerConfig, ctx: zmq.Context, log: logging.Logger) -> None:
        self.cfg = cfg
        self.log = log
        a = cfg.addresses
        self.inbound: Receiver = Receiver(ctx, a.scheduler_in, ipc.SchedulerInbound)
        self.from_worker: Receiver = Receiver(ctx, a.worker_out, ipc.WorkerOutbound)
        self.to_worker = Sender(ctx, a.worker_in, bind=True, kind=zmq.XPUB)
        self.to_worker.sock.setsockopt(zmq.XPUB_VERBOSE, 1)
        self.ranks = cfg.tensor_parallel
        self.subscribed = 0  # ranks subscribed to the plans
        self.ready: ipc.WorkerReady | None = None  # rank 0's report, until all subscribed
        self.stats_pub = Sender(ctx, a.scheduler_pub, bind=True, kind=zmq.PUB)
        self.to_detok = [Sender(ctx, addr) for addr in a.detokenizers()]
        self.replies = SenderPool(ctx)
        self.poller = zmq.Poller()
        self.poller.register(self.inbound.sock, zmq.POLLIN)
        self.poller.register(self.from_worker.sock, zmq.POLLIN)
        self.poller.register(self.to_worker.sock, zmq.POLLIN)

        self.planner: Planner | None = None
        self.worker_ready: ipc.WorkerReady | None = None
        self.block_size = cfg.engine.block_size
        self.requests: dict[str, SchedRequest] = {}
        self.pending_aborts: dict[str, str] = {}
        self.early_aborts: dict[str, float] = {}  # rid -> monotonic time of the abort
        self.in_flight: deque[InFlight] = deque()  # oldest (running on the worker) first
        self.last_result = 0.0  # monotonic time the last step came back
        self.step_id = 0  # the last number on the plan socket (plans and adapter messages)
        self.adapter_messages = 0  # of those numbers, the ones adapter messages took
        self.arrivals = 0
        self.last_heartbeat = 0.0
        self.max_waiting = cfg.engine.max_waiting_requests
        self.work_after_last_result = False  # did the worker's last idle gap have work?
        self.ops = SchedulerOps(cfg.replica)
        self.adapters = AdapterRegistry(cfg.lora, cfg.replica)
        # the KV connectors' policies this topology configured (prefill/decode handoff,
        # the shared KV store; none: every call on it is a no-op)
        self.kv = KvPolicies.for_scheduler(ctx, cfg)

    # ------------------------------------------------------------------ helpers
    def _detok_for(self, rid: str) -> Sender:
        return self.to_detok[detokenizer_index(rid, len(self.to_detok))]

    def _reject(self, req: ipc.TokenizedReq, status: int, message: str, param: str | None,
                code: str) -> None:
        kind = "service_unavailable_error" if status == 503 else "invalid_request_error"
        self.replies.send(req.reply_to, ipc.RequestError(req.rid, status, message, type=kind,
                                                         param=param, code=code))

    def _finish(self, sreq: SchedRequest, reason: str, new_ids: list[int],
                batches: dict[int, list[ipc.TokenOutput]],
                cached_tokens: int | None = None,
                logprobs: ipc.SampleLogprobs | None = None,
                failure: ipc.RequestFailure | None = None) -> None:
        """Forget a request the planner finished (finishing it there first if needed)
        and queue its last output."""
        assert self.planner is not None
        if self.requests.pop(sreq.rid, None) is not None and sreq.adapter:
            self._drop_adapter(self.adapters.release(sreq.adapter))
        self.planner.finish(sreq)
        self.ops.forget(sreq.rid)
        self.kv.finished(sreq.rid)
        if sreq.req.pooling is None:
            self._emit(sreq, new_ids, reason, logprobs, cached_tokens, batches, failure)
        elif reason == "error":  # (an abort came from the frontend: nobody waits)
            failure = failure or ipc.RequestFailure(
                "engine_error", "the engine failed the step that pooled this input")
            self.replies.send(sreq.req.reply_to, failure.error(sreq.rid))

    def _emit(self, sreq: SchedRequest, ids: list[int], reason: str | None,
              lp: ipc.SampleLogprobs | None, cached: int | None,
              batches: dict[int, list[ipc.TokenOutput]],
              failure: ipc.RequestFailure | None = None) -> None:
        sender = self._detok_for(sreq.rid)
        out = _output(sreq.rid, ids, reason, lp, cached, failure)
        if sreq.spec_drafted:  # the request's speculation so far, for its report
            out.spec_drafted, out.spec_accepted = sreq.spec_drafted, sreq.spec_accepted
        batches.setdefault(id(sender), []).append(out)

    def _flush(self, batches: dict[int, list[ipc.TokenOutput]]) -> None:
        for sender in self.to_detok:
            outputs = batches.get(id(sender))
            if outputs:
                sender.send(ipc.TokenBatch(outputs))

    # ------------------------------------------------------------------ adapters
    def _adapter_number(self) -> int:
        """The next number of the plan socket's sequence, for an adapter message."""
        self.step_id += 1
        self.adapter_messages += 1
        return self.step_id

    def _drop_adapter(self, adapter_id: int | None) -> None:
        if adapter_id is not None:
            self.to_worker.send(ipc.DropAdapter(self._adapter_number(), adapter_id))
            self.last_heartbeat = 0.0  # every frontend learns of it with the next beat

    def _on_adapter_request(self, msg: ipc.AdapterLoad | ipc.AdapterUnload) -> None:
        if self.planner is None:
            self.replies.send(msg.reply_to, ipc.AdapterReply(
                msg.rid, self.cfg.replica, 503, "the engine is still loading", code="not_ready"))
        elif isinstance(msg, ipc.AdapterUnload):
            reply, drop = self.adapters.unload(msg)
            self.replies.send(msg.reply_to, reply)
            self._drop_adapter(drop)
            self.last_heartbeat = 0.0
        else:
            adapter, refusal = self.adapters.start_load(msg)
            if refusal is not None:
                self.replies.send(msg.reply_to, refusal)
            else:
                self.to_worker.send(ipc.LoadAdapter(self._adapter_number(), adapter.adapter_id,
                                                    adapter.info.name, adapter.info.path))

    def _on_adapter_loaded(self, msg: ipc.AdapterLoaded) -> None:
        load, reply, drop = self.adapters.finish_load(msg)
        if load is None:
            return
        self._drop_adapter(drop)
        self.last_heartbeat = 0.0
        self._heartbeat(time.monotonic())  # the frontends hear of it before its 200
        self.replies.send(load.reply_to, reply)
        self.log.info("LoRA adapter %r from %s: %s", load.name, load.path,
                      msg.error or f"loaded as id {msg.adapter_id}")

    # ------------------------------------------------------------------ inbound
    def _count_subscriptions(self) -> None:
        while True:
            try:
                frame = self.to_worker.sock.recv(zmq.NOBLOCK)
            except zmq.Again:
                break
            if frame[:1] == b"\x01":
                self.subscribed += 1
            elif frame[:1] == b"\x00":
                self.subscribed -= 1
        if self.ready is not None and self.planner is None and self.subscribed >= self.ranks:
            self._on_worker_ready(self.ready)

    def _on_worker_ready(self, msg: ipc.WorkerReady) -> None:
        self.ready = msg
        if self.subscribed < self.ranks:
            return  # a rank's subscription is still on its way: it would miss plans
        eng = self.cfg.engine
        self.block_size = msg.block_size
        self.worker_ready = msg
        self.planner = Planner(BlockAllocator(msg.num_blocks), msg.block_size,
                               eng.max_num_seqs, eng.max_num_batched_tokens,
                               enable_prefix_caching=eng.enable_prefix_caching,
                               max_loras=self.cfg.lora.max_loras if self.adapters.enabled else 0,
                               speculative=eng.speculative_config,
                               whole_prompts=msg.bidirectional)
        self.kv.worker_ready(msg)
        self.log.info("worker ready: %d KV blocks of %d tokens, %d rank(s)", msg.num_blocks,
                      msg.block_size, self.ranks)
        if eng.speculative_config is not None and not msg.deterministic:
            self.log.warning("speculative decoding without batch-invariant kernels (%s): a "
                             "verify row may round differently from a decode row, so drafts "
                             "can change answers; each response that drafted says so "
                             "(candor.speculative.exact: false)", msg.deterministic_note)

    def _on_tokenized(self, req: ipc.TokenizedReq) -> None:
        assert self.planner is not None
        if self.early_aborts.pop(req.rid, None) is not None:
            return
        if req.rid in self.requests:
            self._reject(req, 400, f"request id {req.rid!r} is already running", None,
                         "duplicate_request_id")
            return
        # a /health/generate probe is never shed for capacity: it checks that the engine
        # serves, and one per frontend and replica is in flight at most
        if self.max_waiting and not req.probe and len(self.planner.waiting) >= self.max_waiting:
            self._reject(req, 503, f"the engine's waiting queue is full ({self.max_waiting} "
                         "requests); retry shortly", None, "queue_full")
            return
        capacity = self.planner.allocator.total * self.block_size
        if req.pooling is not None and len(req.prompt_token_ids) > capacity:
            self._reject(req, 400, f"this input has {len(req.prompt_token_ids)} tokens but "
                         f"this deployment's KV cache holds {capacity}; shorten it", "input",
                         "kv_cache_too_small")
            return
        step_tokens = self.planner.max_num_batched_tokens
        if self.planner.whole_prompts and len(req.prompt_token_ids) > step_tokens:
            self._reject(req, 400, f"this input has {len(req.prompt_token_ids)} tokens but an "
                         f"encoder computes a prompt in one step of at most {step_tokens} "
                         "(max_num_batched_tokens); shorten it", "input", "context_length_exceeded")
            return
        needed = len(req.prompt_token_ids) + req.max_tokens
        if needed > capacity and req.pooling is None:
            self._reject(req, 400,
                         f"this request needs KV cache for {needed} tokens "
                         f"({len(req.prompt_token_ids)} prompt + {req.max_tokens} to "
                         f"generate) but this deployment's KV cache holds {capacity} "
                         "tokens; lower max_tokens or shorten the prompt",
                         "max_tokens", "kv_cache_too_small")
            return
        adapter = 0
        if req.lora is not None:
            adapter = self.adapters.acquire(req.lora)
            if adapter is None:
                served = ", ".join(repr(n) for n in self.adapters.served) or "none"
                self._reject(req, 404, f"The model {req.lora!r} does not exist on this "
                             f"deployment (a LoRA adapter unloaded meanwhile?). Served "
                             f"adapters: [{served}]", "model", "model_not_found")
                return
        if req.pooling is None:
            self._detok_for(req.rid).send(ipc.DetokStart(
                req.rid, req.reply_to, len(req.prompt_token_ids), req.detok,
                req.prompt_token_ids[-8:],
                req.prompt_token_ids if req.detok.return_token_ids else None,
                replica=self.cfg.replica, decode_replica=req.decode_replica))
        # the request no longer depends on its tokenizer worker (ipc.EngineHas)
        self.replies.send(req.reply_to, ipc.EngineHas(req.rid))
        req = self.kv.admit(req)
        sreq = SchedRequest(req, self.arrivals, adapter=adapter)
        if self.kv.park(sreq, self.planner):
            self.requests[sreq.rid] = sreq  # (an abort finds it) queued once answered
            return
        self._enqueue(sreq)

    def _enqueue(self, sreq: SchedRequest) -> None:
        assert self.planner is not None
        sreq.arrival_seq = self.arrivals
        self.arrivals += 1
        self.requests[sreq.rid] = sreq
        self.planner.waiting.push(sreq)  # a /health/generate probe goes to the head
        self.ops.enqueued(sreq.rid)

    # ------------------------------------------------------------------ KvHost
    def take_early_abort(self, rid: str) -> bool:
        return self.early_aborts.pop(rid, None) is not None

    def holds(self, rid: str) -> bool:
        return rid in self.requests

    def emit_now(self, output: ipc.TokenOutput) -> None:
        self._detok_for(output.rid).send(ipc.TokenBatch([output]))

    def _on_kv_message(self, msg) -> None:
        """A KV connector's message (a handoff, a store's answer, a rank's report)."""
        if not self.kv.on_message(msg, self):
            self.log.error("dropped a %s for %s: no KV connector of this replica takes it",
                           type(msg).__name__, getattr(msg, "rid", "?"))
        self._settle_kv()

    def _recompute(self, sreq: SchedRequest, failure: ipc.RequestFailure) -> None:
        """The worker could not write the prompt KV imported for ``sreq`` (or for the
        request whose blocks it shares): the planner finished it, its blocks unwritten
        and uncached; it is queued again as a fresh request that computes its prompt,
        keeping the tokens it already has (a handed-over first token)."""
        self.log.warning("%s: %s; computing its prompt here instead", sreq.rid,
                         failure.message)
        self.kv.import_lost(sreq, failure)
        again = SchedRequest(sreq.req, 0, token_ids=list(sreq.token_ids), adapter=sreq.adapter)
        again.num_generated = sreq.num_generated
        if sreq.num_generated:  # its first token, and the hit reported with it, are out
            again.cached_tokens = sreq.cached_tokens
        self.ops.forget(sreq.rid)
        self._enqueue(again)

    def _settle_kv(self) -> None:
        """Queue the requests whose KV the connectors have decided on (arrived, found, or
        to compute after all: kv_connectors/)."""
        if self.planner is None:
            return
        for sreq in self.kv.settle(self.planner):
            self._enqueue(sreq)

    def _apply_aborts(self, batches: dict[int, list[ipc.TokenOutput]] | None = None) -> None:
        """Finish aborted requests; their outputs go into ``batches`` (flushed here when
        the caller passes none)."""
        if not self.pending_aborts:
            return
        own = batches is None
        batches = {} if batches is None else batches
        now = time.monotonic()
        for rid, reason in self.pending_aborts.items():
            sreq = self.requests.get(rid)
            if sreq is not None:
                self._finish(sreq, "abort", [], batches)
                self.ops.aborted(reason)
                self.log.debug("aborted %s (%s)", rid, reason)
            else:  # it overtook its request (still being tokenized): drop that on arrival
                self.early_aborts[rid] = now
                self.kv.discard(rid)  # or it is handed here, waiting for its KV
        self.pending_aborts.clear()
        for rid in [r for r, t in self.early_aborts.items() if now - t > EARLY_ABORT_TTL_S]:
            del self.early_aborts[rid]
        if own:
            self._flush(batches)

    def _drain_inbound(self) -> None:
        t0 = time.perf_counter()
        while (msg := self.inbound.recv_nowait()) is not None:
            if isinstance(msg, ipc.Abort):
                self.pending_aborts[msg.rid] = msg.reason
            elif isinstance(msg, (ipc.AdapterLoad, ipc.AdapterUnload)):
                self._on_adapter_request(msg)
            elif not isinstance(msg, ipc.TokenizedReq):  # a KV connector's
                self._on_kv_message(msg)
            elif self.planner is None:
                self._reject(msg, 503, "the engine is still loading", None, "not_ready")
            else:
                self._on_tokenized(msg)
        if not self.in_flight:
            self._apply_aborts()
        self.ops.phases.intake += time.perf_counter() - t0

    # ------------------------------------------------------------------ steps
    def _launch_step(self) -> bool:
        """Plan and send another step if fewer than two are in flight; False if nothing
        could run."""
        if self.planner is None or len(self.in_flight) >= MAX_STEPS_IN_FLIGHT:
            return False
        phases = self.ops.phases
        t0 = time.perf_counter()
        planned = self.planner.plan(lookahead=bool(self.in_flight))
        if not planned.chunks:
            phases.plan += time.perf_counter() - t0
            return False
        self.step_id += 1
        plan = ipc.StepPlan(self.step_id, planned.chunks, planned.new_sampling,
                            planned.released, kv=self.kv.plan(planned, self.requests),
                            new_pooling=planned.new_pooling,
                            new_adapters=planned.new_adapters)
        t1 = time.perf_counter()
        self.to_worker.send(plan)
        phases.plan += t1 - t0
        phases.ipc += time.perf_counter() - t1
        self.in_flight.append(InFlight(plan, planned, time.monotonic()))
        self.ops.step_sent([c.rid for c in planned.chunks], len(planned.preempted))
        return True

    def _running_since(self) -> float | None:
        """When the worker started the oldest step in flight (it queues behind the last
        result), or None."""
        return max(self.in_flight[0].sent, self.last_result) if self.in_flight else None

    def _on_result(self, msg: ipc.StepResult | ipc.WorkerError) -> None:
        assert self.in_flight and self.planner is not None
        t0 = time.perf_counter()
        started = self._running_since()
        done = self.in_flight.popleft()
        plan, planned = done.plan, done.planned
        self.last_result = time.monotonic()
        self._step_done(plan, started)
        batches: dict[int, list[ipc.TokenOutput]] = {}
        # aborts first: the planner then drops what this step sampled for them
        self._apply_aborts(batches)
        if isinstance(msg, ipc.WorkerError):
            self.log.error("step %d failed: %s", msg.step_id, msg.message)
            for sreq in self.planner.step_failed(planned):
                self._finish(sreq, "error", [], batches)
                self.ops.aborted("error")
            self._flush(batches)
            return
        self.ops.worker_result(msg.idle_s, msg.forward_s, self.work_after_last_result,
                               msg.timings)
        for s in self.planner.postprocess(planned, msg.sampled, msg.failed,
                                                 msg.accepted, msg.forced, msg.drafts):
            sreq = s.req
            if s.failure is not None and s.failure.recompute:  # its imported KV is lost
                self._recompute(sreq, s.failure)
                continue
            if s.failure is not None:  # its own bad state: it alone ends
                self.log.warning("request %s failed: %s (%s)", sreq.rid, s.failure.message,
                                 s.failure.code)
                self._finish(sreq, "error", [], batches, failure=s.failure)
                self.ops.aborted("request_error")
                continue
            if sreq.req.pooling is not None:  # its one output ends it (max_tokens 1)
                self._finish(sreq, "length", [], batches)
                self.replies.send(sreq.req.reply_to, ipc.Pooled(
                    sreq.rid, msg.pooled[s.row], len(sreq.req.prompt_token_ids)))
                continue
            lp = msg.logprobs[s.row] if msg.logprobs else None
            ids = [*s.drafted, s.token]
            # the hit is reported once, with the request's first token
            cached = sreq.cached_tokens if sreq.num_generated == len(ids) else None
            taker = self.kv.hands_on(sreq.rid, s.finish_reason)
            if taker is not None:
                # it goes on on another replica (a decode one), which emits these tokens
                taker.hand_off(_output(sreq.rid, ids, None, lp, cached))
                self.requests.pop(sreq.rid, None)
                self.ops.forget(sreq.rid)
            elif s.finish_reason is not None:
                self._finish(sreq, s.finish_reason, ids, batches, cached, lp)
            else:
                self._emit(sreq, ids, None, lp, cached, batches)
        phases = self.ops.phases
        phases.postprocess += time.perf_counter() - t0
        # next step first, detokenizer I/O while the worker computes
        self._launch_step()
        self.work_after_last_result = bool(self.planner.running or self.planner.waiting)
        t1 = time.perf_counter()
        self._flush(batches)
        phases.ipc += time.perf_counter() - t1

    def _drain_results(self) -> None:
        phases = self.ops.phases
        while True:
            t0 = time.perf_counter()
            msg = self.from_worker.recv_nowait()
            phases.ipc += time.perf_counter() - t0  # decoding the result
            if msg is None:
                return
            if isinstance(msg, ipc.WorkerReady):
                self._on_worker_ready(msg)
            elif isinstance(msg, ipc.AdapterLoaded):
                self._on_adapter_loaded(msg)
            elif isinstance(msg, (ipc.StepResult, ipc.WorkerError)):
                self._on_result(msg)
            else:  # a KV connector's (KvReceived)
                self._on_kv_message(msg)

    def _step_done(self, plan: ipc.StepPlan, started: float) -> None:
        prefill = any(len(c.token_ids) > 1 or not c.sample for c in plan.seqs)
        self.ops.step_done(prefill, started)

    def _heartbeat(self, now: float) -> None:
        if now - self.last_heartbeat < HEARTBEAT_S:
            return
        self.last_heartbeat = now
        planner = self.planner
        stats = ipc.SchedulerStats(
            time=time.time(),
            running=len(planner.running) if planner else 0,
            waiting=len(planner.waiting) if planner else 0,
            free_blocks=planner.allocator.num_free if planner else 0,
            total_blocks=planner.allocator.total if planner else 0,
            steps=self.step_id - self.adapter_messages, worker_ready=planner is not None,
            worker_device=self.worker_ready.device if self.worker_ready else "",
            worker_dtype=self.worker_ready.dtype if self.worker_ready else "",
            max_waiting=self.max_waiting,
            cached_blocks=planner.allocator.num_cached if planner else 0,
            prefix_hit_blocks=planner.prefix_hit_blocks if planner else 0,
            worker_idle_s=self.ops.worker_idle_s, worker_busy_s=self.ops.worker_busy_s,
            worker_idle_ms_p50=self.ops.worker_idle_ms_p50(),
            preemptions=self.ops.preemptions, aborts=dict(self.ops.aborts),
            prefix_cache_queried_tokens=planner.prefix_queried_tokens if planner else 0,
            prefix_cache_hit_tokens=planner.prefix_hit_tokens if planner else 0,
            step_in_flight_s=self.ops.in_flight_s(self._running_since()),
            step_phases_s=self.ops.step_phases_s(),
            replica=self.cfg.replica,
            deterministic=self.worker_ready.deterministic if self.worker_ready else False,
            deterministic_note=self.worker_ready.deterministic_note if self.worker_ready else "",
            **self._lora_stats(), **self._spec_stats())
        self.stats_pub.send(stats)
        self.ops.metrics.export(stats)
        if self.in_flight or self.adapters.loading:  # a rank that lost the newest plan
            # (or adapter load, which the ranks answer together) notices (plan_order.py)
            self.to_worker.send(ipc.PlanMark(self.step_id))

    def _spec_stats(self) -> dict:
        drafts = self.planner.drafts if self.planner is not None else None
        if drafts is None:
            return {}
        c = drafts.counts
        return dict(spec_drafts=c.drafts, spec_draft_tokens=c.draft_tokens,
                    spec_accepted_tokens=c.accepted_tokens,
                    spec_accepted_per_pos={str(pos): n for pos, n in
                                           enumerate(c.accepted_per_pos)})

    def _lora_stats(self) -> dict:
        """The heartbeat's LoRA fields: adapters served, requests per adapter name."""
        if not self.adapters.enabled:
            return {}
        running: dict[str, int] = {}
        waiting: dict[str, int] = {}
        planner = self.planner
        for queue, counts in ((planner.running if planner else [], running),
                              (planner.waiting if planner else [], waiting)):
            for sreq in queue:
                if sreq.adapter:
                    name = self.adapters.by_id[sreq.adapter].info.name
                    counts[name] = counts.get(name, 0) + 1
        return {"max_loras": self.cfg.lora.max_loras, "lora_adapters": self.adapters.infos(),
                "lora_running": running, "lora_waiting": waiting}

    def run(self, should_stop) -> None:
        stalled = False  # work exists but the last plan was empty: do not spin
        while not should_stop():
            busy = len(self.in_flight) < MAX_STEPS_IN_FLIGHT and self.planner is not None and bool(
                self.planner.running or self.planner.waiting)
            if busy and not stalled:
                timeout = 0
            elif busy and not self.in_flight:
                timeout = 5
            else:  # idle, or waiting for a step in flight (its result wakes the poll)
                timeout = int(HEARTBEAT_S * 1000)
            events = dict(self.poller.poll(timeout))
            if self.to_worker.sock in events:
                self._count_subscriptions()
            if self.from_worker.sock in events:
                self._drain_results()
            if self.inbound.sock in events or busy:
                self._drain_inbound()
            self._settle_kv()  # the connectors' deadlines (transfers, lookups)
            launched = self._launch_step()
            stalled = busy and not launched
            self._heartbeat(time.monotonic())
        self.to_worker.send_nowait(ipc.Shutdown())  # the worker may be gone already
