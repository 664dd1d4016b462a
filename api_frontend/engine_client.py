"""The frontend's side of the ZeroMQ pipeline.

Requests go out to the tokenizer workers (PUSH round-robins across them); every reply
for this process comes back on its own PULL socket, and one reader task routes each
message to the waiting request's queue. The scheduler's heartbeat arrives on a SUB
socket and backs /health. Without its reader tasks this process can only hang, so a
reader that ends for any reason but shutdown ends the process (the launcher sees it).
"""

from __future__ import annotations

import asyncio
import logging
import os
import time

import zmq

from api_frontend.metrics import FrontendMetrics, RequestTimer
from protocol import ipc
from protocol.routing import detokenizer_index
from protocol.topology import ProcessConfig
from protocol.transport import Receiver, Sender, async_context

HEARTBEAT_STALE_S = 2.0
READER_DIED_EXIT = 70  # EX_SOFTWARE: an internal failure the launcher reports
log = logging.getLogger("api_frontend")


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
    def __init__(self, cfg: ProcessConfig, metrics: FrontendMetrics | None = None) -> None:
        self.ctx = async_context(cfg.security)
        a = cfg.addresses
        self.reply_to = a.frontend_results[cfg.index]
        self._results: Receiver = Receiver(self.ctx, self.reply_to, ipc.FrontendInbound)
        self._stats: Receiver = Receiver(self.ctx, a.scheduler_pub, ipc.SchedulerBroadcast,
                                         bind=False, kind=zmq.SUB)
        self._to_tokenizers = Sender(self.ctx, a.tokenizer_in)
        self._to_scheduler = Sender(self.ctx, a.scheduler_in)
        self._queues: dict[str, asyncio.Queue] = {}
        self.stats: ipc.SchedulerStats | None = None
        self.stats_received_at = 0.0
        self._tasks: list[asyncio.Task] = []
        # rid -> submit time, until its first reply: requests the scheduler may not count yet
        self._unanswered: dict[str, float] = {}
        self.metrics = metrics
        self._timers: dict[str, RequestTimer] = {}
        self.finish_reasons: dict[str, str] = {}  # rid -> reason, read by the metrics
        self._num_detok = len(a.detokenizer_in)

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
                    self._unanswered.pop(item.rid, None)
                    queue = self._queues.get(item.rid)
                    if queue is not None:
                        self._observe(item)
                        queue.put_nowait(item)
            else:  # RequestInfo, RenderResult or RequestError: one rid each
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
            self.finish_reasons[item.rid] = item.finish_reason
            del self._timers[item.rid]

    def _observe_error(self, err: ipc.RequestError) -> None:
        timer = self._timers.pop(err.rid, None)
        if timer is not None and timer.tokens > 0 and self.metrics is not None:
            self.metrics.stream_errors.labels(err.code or "none").inc()

    def fail_requests(self, message: str, code: str, detokenizer: int | None = None) -> int:
        """Fail in-flight requests (all, or those a lost detokenizer owned) with a 503
        instead of leaving them to hang; the scheduler frees their KV blocks."""
        failed = 0
        for rid, queue in list(self._queues.items()):
            if detokenizer is not None and detokenizer_index(rid, self._num_detok) != detokenizer:
                continue
            err = ipc.RequestError(rid, 503, message, type="service_unavailable_error",
                                   code=code)
            self._observe_error(err)
            queue.put_nowait(err)
            self._to_scheduler.send(ipc.Abort(rid, "error"))
            failed += 1
        return failed

    @property
    def inflight(self) -> int:
        return len(self._queues)

    async def _read_stats(self) -> None:
        while True:
            self.stats = await self._stats.recv_async()
            self.stats_received_at = time.monotonic()

    def engine_problem(self) -> str | None:
        """None when the step loop's heartbeat is fresh and the worker is loaded."""
        if self.stats is None:
            return "no heartbeat from the scheduler yet"
        age = time.monotonic() - self.stats_received_at
        if age > HEARTBEAT_STALE_S:
            return f"scheduler heartbeat is {age:.1f}s old"
        if not self.stats.worker_ready:
            return "the gpu_worker is still loading the model"
        return None

    def queue_full(self) -> str | None:
        """Why a new request should be shed now (None: admit it).

        Conservative: the scheduler's last reported waiting count plus every request this
        frontend sent since that report that has had no reply yet. The scheduler enforces
        the same bound again on arrival, so a race between frontends still gets a 503.
        """
        stats = self.stats
        if stats is None or not stats.max_waiting:
            return None
        since = self.stats_received_at
        fresh = sum(1 for t in self._unanswered.values() if t >= since)
        if stats.waiting + fresh >= stats.max_waiting:
            return (f"the engine's waiting queue is full ({stats.waiting} waiting, "
                    f"{fresh} on their way, bound {stats.max_waiting}); retry shortly")
        return None

    async def submit(self, req: ipc.GenerateReq | ipc.RenderReq,
                     queue: asyncio.Queue | None = None) -> asyncio.Queue:
        """Send ``req``; its replies arrive on ``queue`` (several rids may share one)."""
        queue = queue if queue is not None else asyncio.Queue()
        self._queues[req.rid] = queue
        is_generation = isinstance(req, ipc.GenerateReq)
        if is_generation:
            self._unanswered[req.rid] = time.monotonic()
        if self.metrics is not None and is_generation and not req.probe:
            self._timers[req.rid] = RequestTimer(self.metrics, time.monotonic())
        await self._to_tokenizers.send(req)
        return queue

    def release(self, rid: str) -> None:
        self._queues.pop(rid, None)
        self._unanswered.pop(rid, None)
        self._timers.pop(rid, None)

    async def abort(self, rid: str, reason: str = "disconnect") -> None:
        self._queues.pop(rid, None)
        self._unanswered.pop(rid, None)
        self._timers.pop(rid, None)
        self.finish_reasons.pop(rid, None)
        await self._to_scheduler.send(ipc.Abort(rid, reason))
