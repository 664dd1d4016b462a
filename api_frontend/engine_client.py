"""The frontend's side of the ZeroMQ pipeline.

Each request goes to one tokenizer worker (the one with the fewest of this frontend's
requests still unanswered, over its own PUSH socket), which is remembered until the
engine has the request (``EngineHas``; a render: until the worker answers): if that
worker dies, exactly its requests are failed, those it already answered with a
``RequestInfo`` but whose ``TokenizedReq`` it never got out included. Every reply for this
process comes back on its own PULL socket, and one reader task routes each message to the
waiting request's queue. The schedulers' heartbeats arrive on a SUB socket and back
/health. Without its reader tasks this process can only hang, so a reader that ends for
any reason but shutdown ends the process (the launcher sees it).

With several engine replicas, each generation request is stamped with the replica the
``ReplicaRouter`` picks among those in rotation (heartbeat fresh, worker loaded, not
lost), by load and prefix affinity; aborts go to that replica, and when a replica is
lost exactly its requests fail. ``stats`` is then the sum over the replicas in rotation.

A topology that serves several models gives each its own replicas, tokenizer workers and
detokenizers (``FrontendConfig.engines``, numbered across models); ``view(i)`` is this
client as model i's routes use it: its requests reach only model i's processes.

Disaggregated (``prefill_replicas`` > 0): a request goes to a prefill replica (by the
same rule, among prefill replicas) and names the decode replica it is handed to (the
least loaded); it belongs to both, so losing either fails it and aborts go to both.
With no prefill replica in rotation a decode replica serves it whole (and the other way
round), so a lost half degrades the deployment instead of stopping it.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
import time
from collections.abc import Callable

import msgspec
import zmq

from api_frontend.errors import ApiError
from api_frontend.metrics import FrontendMetrics, RequestTimer
from api_frontend.replica_router import ReplicaRouter, affinity_text
from cluster.metrics import dropped_messages
from cluster.process_config import FrontendConfig
from protocol import ipc
from protocol.routing import detokenizer_index
from protocol.transport import Receiver, Sender, async_context

READER_DIED_EXIT = 70  # EX_SOFTWARE: an internal failure the launcher reports
log = logging.getLogger("api_frontend")


def combine_stats(current: list[ipc.SchedulerStats],
                  every: list[ipc.SchedulerStats] | None = None) -> ipc.SchedulerStats:
    """One view over several replicas' heartbeats: the state of those ``current`` (in
    rotation) adds up, ages take the worst, and the cumulative counts add up over
    ``every`` replica's last report (default: ``current``), so a replica going stale or
    lost never takes its share of a total back."""
    every = current if every is None else every
    if len(current) == 1 and len(every) == 1:
        return current[0]
    out = {}
    for name in ipc.SchedulerStats.__struct_fields__:
        values = [getattr(r, name) for r in
                  (every if name in ipc.SchedulerStats.CUMULATIVE else current)]
        if name in ("time", "step_in_flight_s", "worker_idle_ms_p50"):
            out[name] = max(values)
        elif name in ("worker_ready", "deterministic"):
            out[name] = all(values)
        elif isinstance(values[0], dict):  # aborts by cause, step phases: key by key
            out[name] = {k: sum(v.get(k, 0) for v in values) for d in values for k in d}
        elif name == "replica":
            out[name] = 0
        elif name in ("worker_device", "worker_dtype", "deterministic_note"):  # the same everywhere
            out[name] = next((v for v in values if v), "")
        elif name == "max_loras":
            out[name] = max(values)
        elif name == "lora_adapters":  # each adapter once, as the first replica lists it
            seen: dict[str, ipc.LoraAdapterInfo] = {}
            for adapters in values:
                for a in adapters:
                    seen.setdefault(a.name, a)
            out[name] = list(seen.values())
        else:
            out[name] = sum(values)
    return ipc.SchedulerStats(**out)


def _exit_if_reader_died(task: asyncio.Task) -> None:
    """Done-callback of a reader task: anything but a cancellation is fatal."""
    if task.cancelled():
        return
    exc = task.exception()
    log.critical("reader task %s stopped (%r); exiting so the launcher notices",
                 task.get_name(), exc, exc_info=exc)
    logging.shutdown()
    os._exit(READER_DIED_EXIT)


class EngineClient:
    def __init__(self, cfg: FrontendConfig, metrics: FrontendMetrics | None = None) -> None:
        self.ctx = async_context(cfg.security, dropped_messages(cfg.role))
        a = cfg.addresses
        self.reply_to = a.frontend_results[cfg.index]
        self._results: Receiver = Receiver(self.ctx, self.reply_to, ipc.FrontendInbound)
        self.replicas = max(1, cfg.replicas)
        self._stats: Receiver = Receiver(self.ctx, a.schedulers_pub(),
                                         ipc.SchedulerBroadcast, bind=False, kind=zmq.SUB)
        self._to_tokenizers = [Sender(self.ctx, addr) for addr in a.tokenizer_in]
        self._encoder = msgspec.msgpack.Encoder()
        # rid -> index of the tokenizer worker holding it, until that worker answers
        self._at_tokenizer: dict[str, int] = {}
        # rid -> that worker, until the engine has the request (EngineHas, or its output)
        self._before_engine: dict[str, int] = {}
        self._tokenizer_load = [0] * len(a.tokenizer_in)
        self._next_tokenizer = itertools.cycle(range(len(a.tokenizer_in)))
        self._to_scheduler = [Sender(self.ctx, addr)
                              for addr in a.schedulers_in()]
        self.router = ReplicaRouter(self.replicas, cfg.router)
        # a replica whose last heartbeat is older than this is out of rotation (/health 503)
        self.heartbeat_stale_s = cfg.supervision.heartbeat_stale_s
        self._replica_of: dict[str, int] = {}  # rid -> replica, while in flight
        self._decode_of: dict[str, int] = {}  # rid -> decode replica (disaggregation)
        self.prefill_replicas = cfg.prefill_replicas
        self._whole_role: str | None = None  # the role serving whole while the other is out
        self._replica_load = [0] * self.replicas  # this frontend's requests in flight
        self._reports: dict[int, tuple[ipc.SchedulerStats, float]] = {}
        self.lost: dict[int, str] = {}  # replica -> why it left rotation for good
        self.started: set[int] = set()  # replicas whose worker reported ready once
        self._queues: dict[str, asyncio.Queue] = {}
        self.stats: ipc.SchedulerStats | None = None
        self.stats_received_at = 0.0
        self._tasks: list[asyncio.Task] = []
        # rid -> submit time, until its first reply: requests the scheduler may not count yet
        self._unanswered: dict[str, float] = {}
        self.metrics = metrics
        self._timers: dict[str, RequestTimer] = {}
        # response x-request-id -> finish reason of a generation just answered; the ops
        # middleware pops it to label candor_http_requests
        self.finish_reasons: dict[str, str] = {}
        # another frontend's question about a stored /v1/responses result, or the answer to
        # ours: handed to the response store's peer link (api_frontend/endpoints/responses)
        self.on_peer_message: Callable[[ipc.StoreQuery | ipc.StoreAnswer], None] | None = None
        self.served = cfg.served()  # every served model's processes
        self._served_by: dict[str, int] = {}  # rid -> the served model it went to

    def view(self, engine: int) -> "EngineView":
        return EngineView(self, engine)
        # the LoRA adapters served before any heartbeat said otherwise (--lora-modules)
        self._start_adapters = {m.name: ipc.LoraAdapterInfo(m.name, m.resolved_path(),
                                                            m.base_model_name or "")
                                for m in cfg.lora.modules} if cfg.lora.enabled else {}

    def start(self) -> None:
        self._tasks = [asyncio.create_task(self._read_results(), name="results"),
                       asyncio.create_task(self._read_stats(), name="stats")]
        for task in self._tasks:
            task.add_done_callback(_exit_if_reader_died)

    async def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        self.ctx.destroy(linger=0)

    async def _read_results(self) -> None:
        while True:
            msg = await self._results.recv_async()
            if isinstance(msg, ipc.TextDeltas):
                for item in msg.items:
                    self._tokenizer_answered(item.rid)
                    self._before_engine.pop(item.rid, None)
                    self._unanswered.pop(item.rid, None)
                    queue = self._queues.get(item.rid)
                    if queue is not None:
                        self._observe(item)
                        queue.put_nowait(item)
            elif isinstance(msg, (ipc.StoreQuery, ipc.StoreAnswer)):
                if self.on_peer_message is not None:
                    self.on_peer_message(msg)
            elif isinstance(msg, ipc.EngineHas):
                self._before_engine.pop(msg.rid, None)
            else:  # RequestInfo, RenderResult or RequestError: one rid each
                self._tokenizer_answered(msg.rid)
                if not isinstance(msg, ipc.RequestInfo):  # (the engine may never get it)
                    self._before_engine.pop(msg.rid, None)
                self._unanswered.pop(msg.rid, None)
                queue = self._queues.get(msg.rid)
                if queue is not None:
                    if isinstance(msg, ipc.RequestError):
                        self._observe_error(msg)
                    queue.put_nowait(msg)

    def _observe(self, item: ipc.TextDelta) -> None:
        timer = self._timers.get(item.rid)
        if timer is None:
            return
        timer.on_delta(item.completion_tokens)
        if item.finish_reason is not None:
            timer.finished(item.prompt_tokens, item.completion_tokens)
            del self._timers[item.rid]

    def _observe_error(self, err: ipc.RequestError) -> None:
        timer = self._timers.pop(err.rid, None)
        if timer is not None and timer.tokens > 0 and self.metrics is not None:
            self.metrics.stream_errors.labels(err.code or "none").inc()

    def _tokenizer_answered(self, rid: str) -> None:
        worker = self._at_tokenizer.pop(rid, None)
        if worker is not None:
            self._tokenizer_load[worker] -= 1

    def _pick_tokenizer(self, among: list[int]) -> int:
        """Fewest unanswered requests first; ties go round-robin."""
        low = min(self._tokenizer_load[i] for i in among)
        for _ in range(len(self._tokenizer_load)):
            i = next(self._next_tokenizer)
            if i in among and self._tokenizer_load[i] == low:
                return i
        return among[0]

    def _detokenizer_of(self, rid: str) -> int | None:
        """The detokenizer (its index in the topology) a request's tokens go through."""
        own = self.served[self._served_by.get(rid, 0)].detokenizers
        return own[detokenizer_index(rid, len(own))] if own else None

    def fail_requests(self, message: str, code: str, detokenizer: int | None = None,
                      tokenizer: int | None = None) -> int:
        """Fail in-flight requests (all, those a lost detokenizer owned, or those a lost
        tokenizer worker had not answered yet or not yet handed to the engine) with a 503
        instead of leaving them to hang; the scheduler frees their KV blocks (or drops
        the request if it arrives after the abort)."""
        failed = 0
        for rid, queue in list(self._queues.items()):
            if detokenizer is not None and self._detokenizer_of(rid) != detokenizer:
                continue
            if tokenizer is not None and tokenizer not in (self._at_tokenizer.get(rid),
                                                           self._before_engine.get(rid)):
                continue
            self._tokenizer_answered(rid)
            self._before_engine.pop(rid, None)
            err = ipc.RequestError(rid, 503, message, type="service_unavailable_error",
                                   code=code)
            self._observe_error(err)
            queue.put_nowait(err)
            self._send_abort(rid, "error")
            failed += 1
        return failed

    def replica_lost(self, replica: int, why: str) -> int:
        """A replica's processes died: it leaves rotation and its requests fail (503)."""
        if replica in self.lost:
            return 0
        self.lost[replica] = why
        mine = [rid for rid, r in self._replica_of.items()
                if r == replica or self._decode_of.get(rid) == replica]
        for rid in mine:
            queue = self._queues.get(rid)
            self._forget_replica(rid)
            if queue is None:
                continue
            self._tokenizer_answered(rid)
            self._before_engine.pop(rid, None)
            err = ipc.RequestError(rid, 503, f"engine replica {replica} was lost while "
                                   f"serving this request ({why}); retry: the other "
                                   "replicas serve on", type="service_unavailable_error",
                                   code="replica_lost")
            self._observe_error(err)
            queue.put_nowait(err)
        self._update_replica_gauges()
        return len(mine)

    def _send_abort(self, rid: str, reason: str) -> None:
        for replica in self._forget_replica(rid):
            self._to_scheduler[replica].send(ipc.Abort(rid, reason))

    def _forget_replica(self, rid: str) -> list[int]:
        """The replicas ``rid`` was sent to (prefill and decode with disaggregation)."""
        replica = self._replica_of.pop(rid, None)
        if replica is None:
            return [0]
        self._replica_load[replica] -= 1
        decode = self._decode_of.pop(rid, None)
        if decode is None:
            return [replica]
        self._replica_load[decode] -= 1
        return [replica, decode]

    def replica_role(self, replica: int) -> str:
        if not self.prefill_replicas:
            return "colocated"
        return "prefill" if replica < self.prefill_replicas else "decode"

    def in_rotation(self) -> list[int]:
        """Replicas that can take a request now."""
        now = time.monotonic()
        return [r for r, (stats, at) in sorted(self._reports.items())
                if r not in self.lost and stats.worker_ready
                and now - at <= self.heartbeat_stale_s]

    def _route(self, req: ipc.GenerateReq | ipc.PoolReq, replicas: list[int]) -> None:
        if self.replicas == 1 or req.probe:  # a probe names the replica it checks
            return
        alive = ([r for r in self.in_rotation() if r in replicas]
                 or [r for r in replicas if r not in self.lost] or replicas[:1])
        loads = [max(self._replica_load[r], (self._reports[r][0].running + self._reports[r][0].waiting)
                     if r in self._reports else 0) for r in range(self.replicas)]
        # a pooling input never reads the prefix cache: no affinity, the least loaded
        keys = [] if isinstance(req, ipc.PoolReq) else self.router.keys(affinity_text(req),
                                                                         req.cache_salt)
        if self.prefill_replicas and isinstance(req, ipc.GenerateReq):
            prefill = [r for r in alive if r < self.prefill_replicas]
            decode = [r for r in alive if r >= self.prefill_replicas]
            if prefill and decode:
                least = min(loads[r] for r in decode)
                req.decode_replica = next(r for r in decode if loads[r] == least)
            self._note_split(prefill, decode)
            alive = prefill or decode
        req.replica, why = self.router.pick(keys, loads, alive)
        if self.metrics is not None:
            self.metrics.routed.labels(str(req.replica), why).inc()

    def _note_split(self, prefill: list[int], decode: list[int]) -> None:
        """A prefill/decode request that the half left serves whole (no replica of the
        other role in rotation) is counted, and the switch each way logged once."""
        whole = None if prefill and decode else "prefill" if prefill else "decode"
        if whole is not None and self.metrics is not None:
            self.metrics.served_whole.labels(whole).inc()
        if whole != self._whole_role:
            if whole is None:
                log.info("prefill and decode replicas both in rotation again: requests "
                         "are split again")
            else:
                log.warning("no %s replica in rotation (heartbeats stale, loading or "
                            "lost): the %s replicas serve requests whole",
                            "decode" if whole == "prefill" else "prefill", whole)
            self._whole_role = whole

    def _update_replica_gauges(self) -> None:
        if self.metrics is None or self.replicas == 1:
            return
        rotation = set(self.in_rotation())
        for r in range(self.replicas):
            self.metrics.replica_up.labels(str(r)).set(1 if r in rotation else 0)

    @property
    def inflight(self) -> int:
        return len(self._queues)

    def tracked(self) -> dict[str, int]:
        """Sizes of the per-request tables; all 0 once every request is answered."""
        return {"queues": len(self._queues), "unanswered": len(self._unanswered),
                "timers": len(self._timers), "finish_reasons": len(self.finish_reasons)}

    def _track(self) -> None:
        if self.metrics is not None:
            self.metrics.inflight.set(len(self._queues))
            for table, size in self.tracked().items():
                self.metrics.request_state.labels(table).set(size)

    async def _read_stats(self) -> None:
        while True:
            report = await self._stats.recv_async()
            self.stats_received_at = now = time.monotonic()
            self._reports[report.replica] = (report, now)
            if report.worker_ready:
                self.started.add(report.replica)
            fresh = [s for r, (s, at) in sorted(self._reports.items())
                     if r not in self.lost and now - at <= self.heartbeat_stale_s]
            self.stats = combine_stats(fresh or [report],
                                       [s for s, _ in self._reports.values()])
            self._update_replica_gauges()
            self._track()  # finish_reasons is popped by the ops middleware, not here

    def replica_report(self) -> list[dict]:
        """Each replica's state for /health (several replicas only)."""
        now = time.monotonic()
        rotation = set(self.in_rotation())
        out = []
        for r in range(self.replicas):
            stats, at = self._reports.get(r, (None, None))
            state = ("lost" if r in self.lost else "serving" if r in rotation
                     else "loading" if stats is not None and not stats.worker_ready
                     else "silent")
            out.append({"replica": r, "role": self.replica_role(r), "state": state,
                        "why": self.lost.get(r),
                        "running": stats.running if stats else None,
                        "waiting": stats.waiting if stats else None,
                        "heartbeat_age_s": round(now - at, 3) if at is not None else None})
        return out

    def _replicas_problem(self, replicas: list[int]) -> str | None:
        """None when at least one of ``replicas`` is in rotation."""
        starting = sorted(set(replicas) - self.started - set(self.lost))
        if starting:  # a deployment is whole before it first says it is healthy
            return f"engine replica(s) {starting} still loading"
        if set(self.in_rotation()) & set(replicas):
            return None
        if set(replicas) <= set(self.lost):
            return "every engine replica was lost: " + "; ".join(
                self.lost[r] for r in replicas)
        return "no engine replica is serving yet (heartbeats missing or workers loading)"

    def engine_problem(self) -> str | None:
        """None when the step loop's heartbeat is fresh and the worker is loaded (with
        several replicas: when at least one replica is in rotation; with several models:
        for each model)."""
        if len(self.served) > 1:
            for served in self.served:
                problem = self._replicas_problem(served.replicas)
                if problem is not None:
                    return f"model {served.names[0]!r}: {problem}"
            return None
        if self.replicas > 1:
            return self._replicas_problem(list(range(self.replicas)))
        if self.stats is None:
            return "no heartbeat from the scheduler yet"
        age = time.monotonic() - self.stats_received_at
        if age > self.heartbeat_stale_s:
            return f"scheduler heartbeat is {age:.1f}s old"
        if not self.stats.worker_ready:
            return "the gpu_worker is still loading the model"
        return None

    def adapters(self) -> dict[str, ipc.LoraAdapterInfo]:
        """The LoRA adapters served now, by name: what the replicas' latest heartbeats
        list (each scheduler sends one at once when its adapters change)."""
        if self.stats is None:
            return self._start_adapters
        return {a.name: a for a in self.stats.lora_adapters}

    async def ask_replicas(self, make: Callable[[str, int], ipc.AdapterLoad | ipc.AdapterUnload],
                           timeout: float, only: list[int] | None = None
                           ) -> tuple[list[int], dict[int, ipc.AdapterReply]]:
        """Send ``make(rid, replica)`` to every replica in rotation (or those ``only``
        names); (the replicas asked, their replies by replica: a replica missing from
        them did not answer in time)."""
        replicas = only if only is not None else self.in_rotation() if self.replicas > 1 else [0]
        queue: asyncio.Queue = asyncio.Queue()
        rids = [f"lora-{os.urandom(8).hex()}-{r}" for r in replicas]
        for rid in rids:
            self._queues[rid] = queue
        replies: dict[int, ipc.AdapterReply] = {}
        try:
            for rid, replica in zip(rids, replicas):
                await self._to_scheduler[replica].send(make(rid, replica))
            deadline = time.monotonic() + timeout
            while len(replies) < len(replicas):
                msg = await asyncio.wait_for(queue.get(), max(0.0, deadline - time.monotonic()))
                if isinstance(msg, ipc.AdapterReply):
                    replies[msg.replica] = msg
        except (asyncio.TimeoutError, TimeoutError):
            pass
        finally:
            for rid in rids:
                self._queues.pop(rid, None)
        return replicas, replies

    def queue_full(self, sequences: int = 1) -> str | None:
        """Why a new request of ``sequences`` queued sequences (n x prompts) should be shed
        now (None: admit it).

        Conservative: the scheduler's last reported waiting count plus every request this
        frontend sent since that report that has had no reply yet. The scheduler enforces
        the same bound again on arrival, so a race between frontends still gets a 503.
        """
        stats = self.stats
        if stats is None or not stats.max_waiting:
            return None
        since = self.stats_received_at
        fresh = sum(1 for t in self._unanswered.values() if t >= since)
        if stats.waiting + fresh + sequences > stats.max_waiting:
            return (f"the engine's waiting queue is full ({stats.waiting} waiting, "
                    f"{fresh} on their way, this request needs {sequences}, bound "
                    f"{stats.max_waiting}); retry shortly")
        return None

    def deterministic(self, rid: str) -> bool | None:
        """Whether the replica serving ``rid`` runs batch-invariant kernels (None: unknown,
        no report from it yet)."""
        report = self._reports.get(self._replica_of.get(rid, -1))
        return report[0].deterministic if report is not None and report[0].worker_ready else None

    async def submit(self, req: ipc.GenerateReq | ipc.RenderReq | ipc.PoolReq,
                     queue: asyncio.Queue | None = None, engine: int = 0) -> asyncio.Queue:
        """Send ``req`` to served model ``engine``'s processes; its replies arrive on
        ``queue`` (several rids may share one).

        The message is encoded before anything is registered, so a request that cannot be
        encoded raises here and leaves nothing behind."""
        served = self.served[engine]
        is_generation = isinstance(req, (ipc.GenerateReq, ipc.PoolReq))
        if is_generation:
            self._route(req, served.replicas)
        try:
            frame = self._encoder.encode(req)
        except (msgspec.EncodeError, OverflowError) as exc:
            raise ApiError(400, f"the request cannot be encoded: {exc}", None,
                           "invalid_value") from None
        queue = queue if queue is not None else asyncio.Queue()
        worker = self._pick_tokenizer(served.tokenizers)
        self._queues[req.rid] = queue
        if engine:
            self._served_by[req.rid] = engine
        self._at_tokenizer[req.rid] = worker
        self._tokenizer_load[worker] += 1
        if is_generation:
            self._before_engine[req.rid] = worker
            self._unanswered[req.rid] = time.monotonic()
            self._replica_of[req.rid] = req.replica
            self._replica_load[req.replica] += 1
            if isinstance(req, ipc.GenerateReq) and req.decode_replica >= 0:
                self._decode_of[req.rid] = req.decode_replica
                self._replica_load[req.decode_replica] += 1
        if self.metrics is not None and isinstance(req, ipc.GenerateReq) and not req.probe:
            self._timers[req.rid] = RequestTimer(self.metrics, time.monotonic())
        try:
            await self._to_tokenizers[worker].sock.send(frame, copy=False)
        except BaseException:  # nothing was sent: nothing may stay registered
            self.release(req.rid)
            raise
        self._track()
        return queue

    def record_finish(self, key: str, reason: str) -> None:
        """The finish reason the ops middleware labels this response's count with."""
        self.finish_reasons[key] = reason

    def release(self, rid: str) -> None:
        self._forget_replica(rid)
        self._served_by.pop(rid, None)
        self._tokenizer_answered(rid)
        self._before_engine.pop(rid, None)
        self._queues.pop(rid, None)
        self._unanswered.pop(rid, None)
        self._timers.pop(rid, None)
        self._track()

    async def abort(self, rid: str, reason: str = "disconnect") -> None:
        replicas = self._forget_replica(rid)
        self.release(rid)
        for replica in replicas:
            await self._to_scheduler[replica].send(ipc.Abort(rid, reason))


class EngineView:
    """The client as one served model's routes use it: ``submit`` reaches that model's
    tokenizer workers and replicas; everything else is the client's."""

    def __init__(self, client: EngineClient, engine: int) -> None:
        self._client = client
        self.engine = engine

    def __getattr__(self, name: str):
        return getattr(self._client, name)

    async def submit(self, req, queue: asyncio.Queue | None = None) -> asyncio.Queue:
        return await self._client.submit(req, queue, engine=self.engine)
