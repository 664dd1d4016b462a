"""What a gpu_worker rank's KV connector is: something that moves KV blocks between this
rank's paged cache and somewhere else (another replica, a shared store), steered by its
entry in each ``StepPlan.kv``.

A smaller cousin of vLLM v1's ``KVConnectorBase_V1`` worker side. There the model runner
starts loads before the forward and waits per layer (``start_load_kv`` /
``wait_for_layer_load``), saves per layer and waits once (``save_kv_layer`` /
``wait_for_save``), and polls ``get_finished`` for asynchronous transfers. Candor's step
is not layered that way: a connector loads all of a plan's blocks before the forward
(``load``) and copies what it saves out of the cache after the step (``save``), before
the next plan can reuse the blocks; what arrives meanwhile it takes on its own socket
(``socket`` / ``drain``) and reports to its scheduler itself (``KvReceived``), so nothing
is polled for.
"""

from __future__ import annotations

from typing import ClassVar

import zmq

from cluster.process_config import WorkerConfig
from protocol import ipc


class KvConnector:
    """One connector on one rank. Subclasses name the ``StepPlan.kv`` struct they read
    (``plan``) and override the hooks they need; every hook does nothing by default."""

    plan: ClassVar[type]  # its member of ipc.KvConnectorPlan

    @classmethod
    def configured(cls, cfg: WorkerConfig) -> bool:
        """Whether this rank's topology uses this connector."""
        raise NotImplementedError

    def announce(self, ready: ipc.WorkerReady) -> ipc.WorkerReady:
        """The start-up report, with what the scheduler's side of this connector needs."""
        return ready

    def socket(self) -> zmq.Socket | None:
        """A socket the loop polls beside the plans; ``drain`` runs when it is readable."""
        return None

    def drain(self) -> None:
        """Take what arrived on ``socket`` (never blocks)."""

    def tick(self) -> None:
        """Each loop turn, before the loop waits for the next plan."""

    def load(self, runner, work) -> None:
        """Before the forward, after the plan's requests are registered: write what
        ``work`` imports into the blocks it names. One that cannot be written fails its
        request alone (``runner.failed``, ``RequestFailure.recompute``)."""

    def save(self, runner, work, failed: dict[str, ipc.RequestFailure]) -> None:
        """After the step's result went out: copy out of the cache what ``work`` saves
        (skipping ``failed`` requests), before a later plan can overwrite the blocks."""

    def close(self) -> None:
        """Before the process's ZeroMQ context goes."""
