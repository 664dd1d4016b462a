"""A gpu_worker rank's loop (gpu_worker/worker_loop.py) over real sockets, with a real
ModelRunner on the tiny checkpoint: the test plays the scheduler (it publishes the plans
and reads rank 0's answers) and the loop runs a recording KV connector beside the model.

What the loop owes every connector: its load runs inside the step, after the plan's
requests are registered (an import that fails then fails its request: issue 29) and
before the forward; its save runs only after the step's result went out, with the
requests that failed; a plan with work for a connector the rank does not run fails that
step alone, and the loop goes on."""

from __future__ import annotations

from pathlib import Path

import msgspec
import pytest
import zmq

from cluster.process_config import process_configs
from cluster.topology import Topology
from gpu_worker.heap_trim import HeapTrim
from gpu_worker.kv_connectors.base import KvConnector
from gpu_worker.model_runner import ModelRunner
from gpu_worker.worker_loop import WorkerLoop
from launcher.tiny_model import build_tiny_model
from protocol import ipc
from protocol.transport import Receiver, Sender
from tests.support.polling import wait_until

GREEDY = ipc.SamplingParams(temperature=0.0)
PROMPT = [0, 17, 250, 33, 90, 401, 12]


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("tiny") / "model")


class Recording(KvConnector):
    """Reads the P/D transfer's plan entry; records what the runner and the scheduler's
    socket looked like at each hook."""

    plan = ipc.PdTransferPlan
    events: list[tuple] = []
    results: Receiver | None = None  # the test's end of rank 0's answers

    @classmethod
    def configured(cls, cfg) -> bool:
        return True

    def __init__(self, ctx, cfg, runner) -> None:
        self.ticks = 0

    def announce(self, ready: ipc.WorkerReady) -> ipc.WorkerReady:
        return msgspec.structs.replace(ready, kv_namespace=b"recorded")

    def tick(self) -> None:
        self.ticks += 1

    def load(self, runner, work: ipc.PdTransferPlan) -> None:
        for imp in work.imports:
            registered = imp.rid in runner.sampling
            fed = imp.rid in runner.last_sampled
            self.events.append(("load", imp.rid, registered, fed))
            runner.failed[imp.rid] = ipc.RequestFailure("kv_transfer_lost", "lost", 503,
                                                        recompute=True)

    def save(self, runner, work: ipc.PdTransferPlan, failed: dict) -> None:
        answered = self.results.sock.poll(5000)  # the step's result is on its way first
        self.events.append(("save", [e.rid for e in work.exports], sorted(failed), answered))


@pytest.fixture
def rank(tiny_dir, tmp_path):
    topology = msgspec.convert({"model": {"path": str(tiny_dir)}}, Topology)
    cfg = next(c for c in process_configs(topology, str(tmp_path)) if c.role == "gpu_worker")
    ctx = zmq.Context()
    plans = Sender(ctx, cfg.addresses.worker_in, bind=True, kind=zmq.XPUB)
    results: Receiver = Receiver(ctx, cfg.addresses.worker_out, ipc.WorkerOutbound)
    Recording.events, Recording.results = [], results
    trims: list[int] = []
    loop = WorkerLoop(cfg, ModelRunner(str(tiny_dir), num_blocks=16), connectors=(Recording,),
                      heap=HeapTrim(lambda pad: trims.append(pad) or 1))
    loop.trims = trims
    wait_until(lambda: plans.sock.poll(0), "the rank to subscribe to the plans")
    plans.sock.recv()
    try:
        yield loop, plans, results
    finally:
        loop.kv.close()
        loop.ctx.destroy(linger=0)
        ctx.destroy(linger=0)


def _turn(loop: WorkerLoop, plans: Sender, msg) -> bool:
    plans.send(msg)
    return loop.step(timeout_ms=5000)


def test_each_connector_loads_inside_the_step_and_saves_after_its_result(rank):
    loop, plans, results = rank
    loop.announce()
    ready = results.recv(timeout_ms=5000)
    assert isinstance(ready, ipc.WorkerReady) and ready.kv_namespace == b"recorded"

    both = ipc.StepPlan(1, [ipc.SeqChunk("imported", PROMPT, 0, [0], True),
                            ipc.SeqChunk("computed", PROMPT, 0, [1], True)],
                        {"imported": GREEDY, "computed": GREEDY},
                        kv=[ipc.PdTransferPlan(exports=[ipc.KvExport("computed", 1, 7)],
                                               imports=[ipc.KvImport("imported", [0])])])
    assert _turn(loop, plans, both)
    result = results.recv(timeout_ms=5000)
    assert isinstance(result, ipc.StepResult) and result.step_id == 1
    assert result.failed["imported"].recompute and "computed" not in result.failed
    assert result.sampled[0] == -1 and result.sampled[1] >= 0  # the failed row: no token
    assert Recording.events == [
        ("load", "imported", True, False),  # registered, not yet fed
        ("save", ["computed"], ["imported"], True),  # after the result, knowing the failure
    ]
    assert loop.kv.members[0].ticks >= 1


def test_work_for_a_connector_this_rank_does_not_run_fails_that_step_alone(rank):
    loop, plans, results = rank
    plan = ipc.StepPlan(1, [ipc.SeqChunk("a", PROMPT, 0, [0], True)], {"a": GREEDY},
                        kv=[ipc.KvStorePlan(puts=[ipc.KvStorePut("a", [0], [b"h"])])])
    assert _turn(loop, plans, plan)
    error = results.recv(timeout_ms=5000)
    assert isinstance(error, ipc.WorkerError) and error.step_id == 1
    assert "KvStorePlan" in error.message
    again = ipc.StepPlan(2, [ipc.SeqChunk("b", PROMPT, 0, [1], True)], {"b": GREEDY})
    assert _turn(loop, plans, again)
    assert isinstance(results.recv(timeout_ms=5000), ipc.StepResult)
    assert not _turn(loop, plans, ipc.Shutdown())  # the loop's last turn


def test_the_heap_is_trimmed_once_per_idle_spell_after_steps(rank):
    loop, plans, results = rank
    assert loop.step(timeout_ms=10) and loop.trims == []  # idle before any step: nothing
    plan = ipc.StepPlan(1, [ipc.SeqChunk("a", PROMPT, 0, [0], True)], {"a": GREEDY})
    assert _turn(loop, plans, plan)
    assert isinstance(results.recv(timeout_ms=5000), ipc.StepResult)
    assert loop.trims == []  # never between steps
    assert loop.step(timeout_ms=10) and loop.step(timeout_ms=10)
    assert loop.trims == [0]  # the first plan-less turn after it, once
