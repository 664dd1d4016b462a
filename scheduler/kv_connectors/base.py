"""The scheduler's half of a KV connector: the policy that decides which blocks move,
when, and what becomes of a request whose KV comes from (or goes to) elsewhere.

The step loop (``engine_loop``) knows no connector by name: it calls these hooks on
every policy its topology configured (``registry``), each a no-op by default. They
follow a request's life, after vLLM v1's ``KVConnectorBase_V1`` scheduler side:

- ``admit`` / ``park``: a new request as this replica runs it (a prefill replica keeps
  its first token only), or held back while its KV is looked up elsewhere (vLLM's
  ``get_num_new_matched_tokens`` answering "asynchronously");
- ``on_message``: what the connector's peers report (a handoff, a lookup's answer, the
  ranks' ``KvReceived``), then ``settle``: the held requests decided now, their blocks
  allocated and an import queued, or to compute their prompt (``update_state_after_alloc``);
- ``plan``: this connector's entry of the step's ``StepPlan.kv`` (``build_connector_meta``);
- ``hands_on`` / ``hand_off`` and ``finished``: a request leaving this replica with its
  KV, or finishing here (``request_finished``); ``discard``: aborted before it arrived;
  ``import_lost``: the worker could not write its imported KV (it recomputes).

A request's import goes out only in the plan that schedules it (``pending_imports``).
"""

from __future__ import annotations

from typing import ClassVar, Protocol

import zmq

from cluster.process_config import SchedulerConfig
from protocol import ipc
from scheduler.planner import PlannedStep, Planner
from scheduler.request import SchedRequest


class KvHost(Protocol):
    """What a policy may ask of the step loop that runs it."""

    def take_early_abort(self, rid: str) -> bool:
        """Whether ``rid`` was aborted before it reached this replica (forgotten now)."""

    def holds(self, rid: str) -> bool:
        """Whether ``rid`` is a request of this replica already."""

    def emit_now(self, output: ipc.TokenOutput) -> None:
        """Send ``output`` to its detokenizer now, ahead of any later token."""


class KvPolicy:
    """One connector's scheduler side; override what it takes part in."""

    # the messages (inbound or from the worker) this policy is handed, to ``on_message``
    takes: ClassVar[tuple[type, ...]] = ()

    @classmethod
    def configured(cls, cfg: SchedulerConfig) -> bool:
        """Whether this replica's topology uses this policy."""
        raise NotImplementedError

    def __init__(self, ctx: zmq.Context, cfg: SchedulerConfig) -> None:
        pass

    def worker_ready(self, ready: ipc.WorkerReady) -> None:
        """Rank 0's start-up report (what the worker side of the connector announced)."""

    def admit(self, req: ipc.TokenizedReq) -> ipc.TokenizedReq:
        """The request as this replica runs it."""
        return req

    def park(self, sreq: SchedRequest, planner: Planner) -> bool:
        """True: ``sreq`` waits here (its KV is looked up elsewhere) until ``settle``
        returns it."""
        return False

    def on_message(self, msg, host: KvHost) -> None:
        """One of the messages of ``takes``."""

    @property
    def pending(self) -> bool:
        """Whether ``settle`` has anything to decide (checked every loop turn)."""
        return False

    def settle(self, planner: Planner) -> list[SchedRequest]:
        """The held requests decided now, to queue (deadlines pass here too)."""
        return []

    def plan(self, planned: PlannedStep,
             requests: dict[str, SchedRequest]) -> ipc.KvConnectorPlan | None:
        """This connector's work in the step about to go out (None: none)."""
        return None

    def hands_on(self, rid: str, finish_reason: str | None) -> bool:
        """After a token: whether ``rid`` leaves this replica, its KV with it."""
        return False

    def hand_off(self, output: ipc.TokenOutput) -> None:
        """Send on the request ``hands_on`` let go, with its last ``output``."""

    def finished(self, rid: str) -> None:
        """``rid`` finished (or was aborted) here."""

    def discard(self, rid: str) -> None:
        """``rid`` was aborted before it became a request of this replica."""

    def import_lost(self, sreq: SchedRequest, failure: ipc.RequestFailure) -> None:
        """The worker could not write the KV imported for ``sreq``: it recomputes."""
