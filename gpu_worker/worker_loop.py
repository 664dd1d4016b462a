"""One gpu_worker rank's loop: take the next plan, run it, answer; a step per turn.

The loop owns this rank's sockets (the plans it subscribes to, rank 0's results) and what
lives between steps: the plan order check, the idle clock, the thread governor, the heap
trim once it goes idle (``heap_trim``) and the KV connectors the topology configured (``kv_connectors``). The connectors steer
themselves by their entry of each plan's ``kv``; the loop only gives them their turns:
their sockets are polled beside the plans, their loads run inside the step (after its
requests are registered, before the forward) and their saves right after the result
went out, before the next plan can reuse the blocks.
"""

from __future__ import annotations

import logging
import os
import time
import traceback

import zmq

from cluster.lifecycle import StopFlag
from cluster.metrics import dropped_messages
from cluster.process_config import WorkerConfig
from gpu_worker.heap_trim import HeapTrim
from gpu_worker.kv_connectors.base import KvConnector
from gpu_worker.kv_connectors.registry import CONNECTORS, KvConnectors
from gpu_worker.plan_order import PLAN_GAP_EXIT, PlanGap, PlanOrder
from protocol import ipc
from protocol.transport import Receiver, Sender, sync_context

log = logging.getLogger(__name__)

POLL_MS = 200  # how long one turn waits for a plan before it checks the stop flag


class WorkerLoop:
    def __init__(self, cfg: WorkerConfig, runner, governor=None,
                 connectors: tuple[type[KvConnector], ...] = CONNECTORS,
                 heap: HeapTrim | None = None) -> None:
        self.rank = cfg.tp_rank
        self.heap = heap or HeapTrim.for_this_process()
        self.runner = runner
        self.governor = governor  # None: the thread count is fixed
        self.ctx = sync_context(cfg.security, dropped_messages(cfg.role))
        self.plans: Receiver = Receiver(self.ctx, cfg.addresses.worker_in, ipc.WorkerInbound,
                                        bind=False, kind=zmq.SUB)
        self.results = Sender(self.ctx, cfg.addresses.worker_out) if self.rank == 0 else None
        self.kv = KvConnectors.for_worker(self.ctx, cfg, runner, connectors)
        runner.load_kv = self.kv.load
        self.poller: zmq.Poller | None = None  # the plans beside the connectors' sockets
        if self.kv.polled:
            self.poller = zmq.Poller()
            self.poller.register(self.plans.sock, zmq.POLLIN)
            for _, sock in self.kv.polled:
                self.poller.register(sock, zmq.POLLIN)
        self.order = PlanOrder()
        self.last_sent = time.perf_counter()

    def answer(self, msg) -> None:
        """Rank 0 answers the scheduler; the other ranks stay silent."""
        if self.results is not None:
            self.results.send(msg)

    def announce(self) -> None:
        runner = self.runner
        self.answer(self.kv.announce(ipc.WorkerReady(
            runner.num_blocks, runner.block_size, runner.max_model_len,
            device=str(runner.device), dtype=str(runner.dtype).removeprefix("torch."),
            deterministic=runner.deterministic,
            deterministic_note=runner.deterministic_note,
            bidirectional=runner.config.encoder is not None)))

    def run(self, stop: StopFlag) -> None:
        self.announce()
        try:
            while not stop.is_set() and self.step():
                pass
        finally:
            self.kv.close()
            self.ctx.destroy(linger=0)

    # ------------------------------------------------------------------ one turn
    def step(self, timeout_ms: int = POLL_MS) -> bool:
        """Wait up to ``timeout_ms`` for the next message and act on it; False: stop."""
        msg = self._next(timeout_ms)
        if msg is None:
            self.heap.idle()  # a turn without a plan: the last step's buffers go back
            return True
        if isinstance(msg, ipc.Shutdown):
            return False
        try:
            if isinstance(msg, ipc.PlanMark):
                self.order.check(msg)
                return True
            self.order.accept(msg)
        except PlanGap as gap:  # computing on would pair collectives of different steps
            log.critical("rank %d %s; stopping so the topology does not compute on",
                         self.rank, gap)
            logging.shutdown()
            os._exit(PLAN_GAP_EXIT)
        if isinstance(msg, (ipc.LoadAdapter, ipc.DropAdapter)):
            self._on_adapter(msg)
        else:
            self._execute(msg)
        return True

    def _next(self, timeout_ms: int):
        """The next plan-socket message (None after ``timeout_ms``); the connectors take
        what reaches theirs meanwhile."""
        self.kv.tick()
        if self.poller is None:
            return self.plans.recv(timeout_ms=timeout_ms)
        events = dict(self.poller.poll(timeout_ms))
        for connector, sock in self.kv.polled:
            if sock in events:
                connector.drain()
        return self.plans.recv_nowait() if self.plans.sock in events else None

    def _execute(self, plan: ipc.StepPlan) -> None:
        runner, governor = self.runner, self.governor
        idle = time.perf_counter() - self.last_sent
        try:
            if governor is not None:
                governor.before_step(sum(len(s.token_ids) for s in plan.seqs))
            result = runner.execute(plan)
            self.heap.stepped()
            if governor is not None:
                governor.after_step(result.forward_s)
            result.idle_s = idle
            sending = time.perf_counter()
            self.answer(result)
            if plan.kv:  # copied out before the next plan can reuse the blocks
                self.kv.save(runner, plan, result.failed)
            self.last_sent = time.perf_counter()
            runner.timings.send += self.last_sent - sending  # reported with the next result
        except Exception:  # a failed step fails its requests, not the process
            log.exception("step %d failed", plan.step_id)
            self.answer(ipc.WorkerError(plan.step_id, traceback.format_exc(limit=3)))
            self.last_sent = time.perf_counter()

    def _on_adapter(self, msg: ipc.LoadAdapter | ipc.DropAdapter) -> None:
        """Register or drop a LoRA adapter on this rank (every rank agrees on a load's
        outcome before rank 0 answers it)."""
        from gpu_worker.lora.peft_files import AdapterError

        adapters = self.runner.adapters
        if adapters is None:  # the scheduler only sends these with LoRA enabled
            if isinstance(msg, ipc.LoadAdapter):
                self.answer(ipc.AdapterLoaded(msg.adapter_id, "LoRA is not enabled on this "
                                              "engine"))
            return
        if isinstance(msg, ipc.DropAdapter):
            adapters.drop(msg.adapter_id)
            return
        try:
            adapters.register(msg.adapter_id, msg.name, msg.path)
        except AdapterError as err:
            self.answer(ipc.AdapterLoaded(msg.adapter_id, str(err)))
            return
        self.answer(ipc.AdapterLoaded(msg.adapter_id))
