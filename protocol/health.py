"""Liveness of every process, published by each node's launcher.

The launcher is the one process that sees its children die (it reaps them), so it
publishes a ``NodeStatus`` on its node's ``node_status`` address at every change and
every heartbeat; each frontend subscribes to every node's address, which is how /health
knows about processes on other machines without each role running a heartbeat socket
(the detokenizers subscribe too, to free the state of a lost replica's requests).
"""

from __future__ import annotations

from typing import Literal

import msgspec

NodeState = Literal["starting", "running", "draining", "failed"]
STATUS_INTERVAL_S = 0.25


class ChildStatus(msgspec.Struct, array_like=True):
    role: str
    index: int
    pid: int
    alive: bool
    exit_code: int | None = None  # of the last exit, kept across a restart
    restarts: int = 0
    replica: int | None = None  # the engine replica a scheduler or gpu_worker belongs to


class NodeStatus(msgspec.Struct, tag="node_status", tag_field="msg"):
    """``state`` failed: a child died that may not restart and the node is stopping;
    draining: a SIGTERM arrived and the node's frontends are finishing their work.
    ``lost_replicas``: engine replicas whose processes died while others serve on (the
    node keeps running, degraded); their stopped processes are not problems."""

    node: str
    time: float
    state: NodeState
    children: list[ChildStatus]
    problem: str | None = None
    lost_replicas: dict[int, str] = {}  # replica -> why it was lost
