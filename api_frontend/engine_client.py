"""The frontend's side of the ZeroMQ pipeline.

Requests go out to the tokenizer workers (PUSH round-robins across them); every reply
for this process comes back on its own PULL socket, and one reader task routes each
message to the waiting request's queue. The scheduler's heartbeat arrives on a SUB
socket and backs /health.
"""

from __future__ import annotations

import asyncio
import time

import zmq
import zmq.asyncio

from protocol import ipc
from protocol.topology import ProcessConfig
from protocol.transport import Receiver, Sender

HEARTBEAT_STALE_S = 2.0


class EngineClient:
    def __init__(self, cfg: ProcessConfig) -> None:
        self.ctx = zmq.asyncio.Context()
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

    def start(self) -> None:
        self._tasks = [asyncio.create_task(self._read_results()),
                       asyncio.create_task(self._read_stats())]

    async def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        self.ctx.destroy(linger=0)

    async def _read_results(self) -> None:
        while True:
            msg = await self._results.recv_async()
            if isinstance(msg, ipc.TextDeltas):
                for item in msg.items:
                    queue = self._queues.get(item.rid)
                    if queue is not None:
                        queue.put_nowait(item)
            else:
                queue = self._queues.get(msg.rid)
                if queue is not None:
                    queue.put_nowait(msg)

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

    async def submit(self, req: ipc.GenerateReq | ipc.RenderReq,
                     queue: asyncio.Queue | None = None) -> asyncio.Queue:
        """Send ``req``; its replies arrive on ``queue`` (several rids may share one)."""
        queue = queue if queue is not None else asyncio.Queue()
        self._queues[req.rid] = queue
        await self._to_tokenizers.send(req)
        return queue

    def release(self, rid: str) -> None:
        self._queues.pop(rid, None)

    async def abort(self, rid: str, reason: str = "disconnect") -> None:
        self._queues.pop(rid, None)
        await self._to_scheduler.send(ipc.Abort(rid, reason))
