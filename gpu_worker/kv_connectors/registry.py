"""The KV connectors a gpu_worker rank can run, and the set its topology configured.

A new connector is a module here (a ``KvConnector``), its line in ``CONNECTORS``, its
``StepPlan.kv`` struct in ``protocol/ipc.py`` and its scheduler side
(``scheduler/kv_connectors/``).
"""

from __future__ import annotations

import zmq

from cluster.process_config import WorkerConfig
from gpu_worker.kv_connectors.base import KvConnector
from gpu_worker.kv_connectors.kv_store import StoreClient
from gpu_worker.kv_connectors.pd_transfer import PdTransfer
from protocol import ipc

CONNECTORS: tuple[type[KvConnector], ...] = (PdTransfer, StoreClient)


class KvConnectors:
    """The connectors of one rank, each reached through its entry of a plan's ``kv``."""

    def __init__(self, members: list[KvConnector]) -> None:
        self.members = members
        self.by_plan = {type(m).plan: m for m in members}
        self.polled = [(m, s) for m in members if (s := m.socket()) is not None]

    @classmethod
    def for_worker(cls, ctx: zmq.Context, cfg: WorkerConfig, runner,
                   kinds: tuple[type[KvConnector], ...] = CONNECTORS) -> KvConnectors:
        return cls([c(ctx, cfg, runner) for c in kinds if c.configured(cfg)])

    def _of(self, work) -> KvConnector:
        member = self.by_plan.get(type(work))
        if member is None:  # the scheduler's side and this one disagree on the topology
            raise ValueError(f"the plan has KV work for {type(work).__name__}, a connector "
                             "this rank does not run")
        return member

    def announce(self, ready: ipc.WorkerReady) -> ipc.WorkerReady:
        for m in self.members:
            ready = m.announce(ready)
        return ready

    def tick(self) -> None:
        for m in self.members:
            m.tick()

    def load(self, runner, plan: ipc.StepPlan) -> None:
        for work in plan.kv:
            self._of(work).load(runner, work)

    def save(self, runner, plan: ipc.StepPlan, failed: dict[str, ipc.RequestFailure]) -> None:
        for work in plan.kv:
            self._of(work).save(runner, work, failed)

    def close(self) -> None:
        for m in self.members:
            m.close()
