"""The KV connector policies a scheduler can run, and the set its topology configured.

A new connector's scheduler side is a ``KvPolicy`` module here and its line in
``POLICIES`` (its worker side: ``gpu_worker/kv_connectors/``).
"""

from __future__ import annotations

import zmq

from cluster.process_config import SchedulerConfig
from protocol import ipc
from scheduler.kv_connectors.base import KvHost, KvPolicy
from scheduler.kv_connectors.kv_store import StoreReads
from scheduler.kv_connectors.pd_transfer import DecodeIntake, PrefillHandoffs
from scheduler.planner import PlannedStep, Planner
from scheduler.request import SchedRequest

POLICIES: tuple[type[KvPolicy], ...] = (PrefillHandoffs, DecodeIntake, StoreReads)


class KvPolicies:
    """The policies of one replica, called as one (none configured: every call is a
    no-op)."""

    def __init__(self, members: list[KvPolicy]) -> None:
        self.members = members

    @classmethod
    def for_scheduler(cls, ctx: zmq.Context, cfg: SchedulerConfig) -> KvPolicies:
        return cls([p(ctx, cfg) for p in POLICIES if p.configured(cfg)])

    def of(self, kind: type[KvPolicy]) -> KvPolicy:
        """The member of type ``kind`` (tests reach one this way)."""
        return next(m for m in self.members if isinstance(m, kind))

    def worker_ready(self, ready: ipc.WorkerReady) -> None:
        for m in self.members:
            m.worker_ready(ready)

    def admit(self, req: ipc.TokenizedReq) -> ipc.TokenizedReq:
        for m in self.members:
            req = m.admit(req)
        return req

    def park(self, sreq: SchedRequest, planner: Planner) -> bool:
        return any(m.park(sreq, planner) for m in self.members)

    def on_message(self, msg, host: KvHost) -> bool:
        """Hand ``msg`` to the policies that take it; False: none does."""
        taken = False
        for m in self.members:
            if isinstance(msg, m.takes):
                m.on_message(msg, host)
                taken = True
        return taken

    def settle(self, planner: Planner) -> list[SchedRequest]:
        return [s for m in self.members if m.pending for s in m.settle(planner)]

    def plan(self, planned: PlannedStep,
             requests: dict[str, SchedRequest]) -> list[ipc.KvConnectorPlan]:
        return [w for m in self.members if (w := m.plan(planned, requests)) is not None]

    def hands_on(self, rid: str, finish_reason: str | None) -> KvPolicy | None:
        """The policy ``rid`` leaves this replica through after a token, if any."""
        for m in self.members:
            if m.hands_on(rid, finish_reason):
                return m
        return None

    def finished(self, rid: str) -> None:
        for m in self.members:
            m.finished(rid)

    def discard(self, rid: str) -> None:
        for m in self.members:
            m.discard(rid)

    def import_lost(self, sreq: SchedRequest, failure: ipc.RequestFailure) -> None:
        for m in self.members:
            m.import_lost(sreq, failure)
