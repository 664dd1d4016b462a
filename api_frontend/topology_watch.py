"""The frontend's view of every process in the topology, from the launchers' NodeStatus.

Each node's launcher publishes which of its children are alive; this subscribes to all
of them, so /health can name a dead process on any machine within one status interval,
and requests owned by a detokenizer that died are failed instead of left hanging.
An engine replica a launcher reports lost (its scheduler or a rank died while other
replicas serve) is a degradation, not a problem: its stopped processes are left out of
``problems`` and ``on_replica_lost`` fails its requests.
"""

from __future__ import annotations

import asyncio
import time
from typing import Callable

import zmq
import zmq.asyncio

from cluster.process_config import FrontendConfig
from protocol.health import NodeStatus
from protocol.transport import Receiver


class TopologyWatch:
    def __init__(self, ctx: zmq.asyncio.Context, cfg: FrontendConfig,
                 on_lost: Callable[[str, int, str], None],
                 on_failed: Callable[[str], None],
                 on_replica_lost: Callable[[int, str], None] = lambda r, why: None) -> None:
        self.nodes = list(cfg.nodes)
        self.stale_s = cfg.supervision.heartbeat_stale_s
        self._sub: Receiver = Receiver(ctx, cfg.addresses.node_status, NodeStatus,
                                       bind=False, kind=zmq.SUB)
        self._on_lost = on_lost        # (role, index, why): its requests' state is gone
        self._on_failed = on_failed    # the topology is stopping after a fatal death
        self._on_replica_lost = on_replica_lost  # (replica, why): it left rotation
        self.lost_replicas: dict[int, str] = {}
        self.status: dict[str, tuple[NodeStatus, float]] = {}
        self._deaths: dict[tuple[str, str, int], int] = {}  # deaths seen per process
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        self._task = asyncio.create_task(self._run())

    def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()

    async def _run(self) -> None:
        while True:  # the Receiver itself drops frames it cannot decode
            self._update(await self._sub.recv_async())

    def _update(self, msg: NodeStatus) -> None:
        previous = self.status.get(msg.node)
        self.status[msg.node] = (msg, time.monotonic())
        for replica, why in msg.lost_replicas.items():
            if replica not in self.lost_replicas:
                self.lost_replicas[replica] = why
                self._on_replica_lost(replica, why)
        for child in msg.children:
            # one death each: the status saying it is dead, or (if that one was missed)
            # the restart count; a process waiting out its restart backoff dies once
            key = (msg.node, child.role, child.index)
            deaths = child.restarts + (0 if child.alive else 1)
            seen = self._deaths.get(key)
            self._deaths[key] = max(deaths, seen or 0)
            if seen is not None and deaths > seen:
                self._on_lost(child.role, child.index,
                              f"{child.role}[{child.index}] on node {msg.node} exited "
                              f"(code {child.exit_code})")
        if msg.state == "failed" and (previous is None or previous[0].state != "failed"):
            self._on_failed(msg.problem or f"node {msg.node} failed")

    def problems(self) -> list[str]:
        """Everything that keeps the topology from being whole, in words."""
        now = time.monotonic()
        out = []
        for node in self.nodes:
            entry = self.status.get(node)
            if entry is None:
                out.append(f"no status from node {node!r} yet (its launcher is not "
                           "running or not reachable)")
                continue
            status, received = entry
            age = now - received
            if age > self.stale_s:
                out.append(f"node {node!r} has been silent for {age:.1f}s")
                continue
            if status.state in ("failed", "draining"):
                out.append(f"node {node!r} is {status.state}"
                           + (f": {status.problem}" if status.problem else ""))
            for child in status.children:
                # a dead KV store costs prompt-cache misses only: the replicas serve on
                if not child.alive and child.replica not in status.lost_replicas \
                        and child.role != "kv_store":
                    out.append(f"{child.role}[{child.index}] on node {node!r} is not "
                               f"running (last exit code {child.exit_code}, "
                               f"{child.restarts} restarts)")
        return out

    def failed(self) -> str | None:
        for status, _ in self.status.values():
            if status.state == "failed":
                return status.problem or f"node {status.node} failed"
        return None
