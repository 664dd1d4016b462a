"""The frontend's EngineClient over real sockets, with its clock in the test's hands:
the topology's ``supervision.heartbeat_stale_s`` decides when a scheduler's heartbeat
is too old for /health and for routing."""

from __future__ import annotations

import asyncio
import time
from types import SimpleNamespace

import msgspec
import pytest
import zmq
import zmq.asyncio

from api_frontend import engine_client
from api_frontend.engine_client import EngineClient
from cluster.process_config import FrontendConfig
from cluster.topology import ResolvedAddresses, SupervisionSpec
from protocol import ipc


@pytest.mark.parametrize("replicas", [1, 2])
async def test_a_configured_heartbeat_stale_s_takes_effect(tmp_path, monkeypatch, replicas):
    clock = SimpleNamespace(now=100.0)
    monkeypatch.setattr(engine_client, "time", SimpleNamespace(monotonic=lambda: clock.now))
    pubs = [f"ipc://{tmp_path}/pub-{r}" for r in range(replicas)]
    cfg = FrontendConfig(
        index=0, model_path="/m", served_model_name="m", replicas=replicas,
        supervision=SupervisionSpec(heartbeat_stale_s=5.0),
        addresses=ResolvedAddresses(
            scheduler_in=f"ipc://{tmp_path}/in-0", scheduler_pub=pubs[0],
            worker_in="", worker_out="", tokenizer_in=[f"ipc://{tmp_path}/tok"],
            detokenizer_in=[f"ipc://{tmp_path}/detok"],
            frontend_results=[f"ipc://{tmp_path}/front"],
            replica_scheduler_in=[f"ipc://{tmp_path}/in-{r}" for r in range(replicas)],
            replica_scheduler_pub=pubs))
    ctx = zmq.asyncio.Context()
    schedulers = [ctx.socket(zmq.PUB) for _ in pubs]
    for sock, addr in zip(schedulers, pubs):
        sock.bind(addr)
    client = EngineClient(cfg)
    client.start()
    try:
        deadline = time.monotonic() + 10
        while len(client.in_rotation()) < replicas:  # a SUB joins a little after connecting
            assert time.monotonic() < deadline, "no heartbeat arrived"
            for r, sock in enumerate(schedulers):
                await sock.send(msgspec.msgpack.encode(ipc.SchedulerStats(
                    0.0, 0, 0, 8, 8, 0, True, replica=r)))
            await asyncio.sleep(0.02)
        assert client.engine_problem() is None
        clock.now += 3.0  # past the default 2 s, within the configured 5 s
        assert client.in_rotation() == list(range(replicas))
        assert client.engine_problem() is None
        clock.now += 3.0
        assert client.in_rotation() == []
        problem = client.engine_problem()
        assert problem is not None and ("6.0s old" in problem if replicas == 1
                                        else "no engine replica is serving" in problem)
    finally:
        await client.close()
        for sock in schedulers:
            sock.close(linger=0)
        ctx.destroy(linger=0)


def test_combined_stats_add_dict_fields_key_by_key():
    """/health over replicas sums aborts and step phases per key (a dict field summed
    as a whole would kill the frontend's heartbeat reader)."""
    a = ipc.SchedulerStats(0.0, 1, 0, 8, 8, 3, True, aborts={"disconnect": 1},
                           step_phases_s={"worker_forward": 1.0, "sched_plan": 0.5})
    b = ipc.SchedulerStats(0.0, 2, 0, 8, 8, 4, True, replica=1, aborts={"error": 2},
                           step_phases_s={"worker_forward": 2.0})
    both = engine_client.combine_stats([a, b])
    assert both.step_phases_s == {"worker_forward": 3.0, "sched_plan": 0.5}
    assert both.aborts == {"disconnect": 1, "error": 2}
    assert (both.running, both.steps) == (3, 7)


def test_combined_stats_add_speculation_counts_per_position():
    a = ipc.SchedulerStats(0.0, 1, 0, 8, 8, 3, True, spec_drafts=2, spec_draft_tokens=6,
                           spec_accepted_tokens=3, spec_accepted_per_pos={"0": 2, "1": 1})
    b = ipc.SchedulerStats(0.0, 1, 0, 8, 8, 3, True, replica=1, spec_drafts=1,
                           spec_draft_tokens=3, spec_accepted_tokens=1,
                           spec_accepted_per_pos={"0": 1})
    both = engine_client.combine_stats([a, b])
    assert (both.spec_drafts, both.spec_draft_tokens, both.spec_accepted_tokens) == (3, 9, 4)
    assert both.spec_accepted_per_pos == {"0": 3, "1": 1}


async def test_a_lost_tokenizer_worker_fails_what_the_engine_does_not_have_yet(tmp_path):
    """A request stays its tokenizer worker's until the engine has it (``EngineHas``), not
    just until the worker's RequestInfo: a worker killed between the two leaves a request
    nothing else will answer. When the worker is known dead, that request fails (503
    tokenizer_lost, aborted at the scheduler); one the engine has, or another worker's,
    goes on."""
    tok = [f"ipc://{tmp_path}/tok-{i}" for i in range(2)]
    cfg = FrontendConfig(
        index=0, model_path="/m", served_model_name="m",
        addresses=ResolvedAddresses(
            scheduler_in=f"ipc://{tmp_path}/in-0", scheduler_pub=f"ipc://{tmp_path}/pub",
            worker_in="", worker_out="", tokenizer_in=tok,
            detokenizer_in=[f"ipc://{tmp_path}/detok"],
            frontend_results=[f"ipc://{tmp_path}/front"]))
    ctx = zmq.asyncio.Context()
    workers = [ctx.socket(zmq.PULL) for _ in tok]
    for sock, addr in zip(workers, tok):
        sock.bind(addr)
    scheduler = ctx.socket(zmq.PULL)
    scheduler.bind(cfg.addresses.scheduler_in)
    client = EngineClient(cfg)
    client.start()
    answers = ctx.socket(zmq.PUSH)  # as the tokenizer workers and the scheduler reply
    answers.connect(cfg.addresses.frontend_results[0])
    try:
        def req(rid: str) -> ipc.GenerateReq:
            return ipc.GenerateReq(rid, client.reply_to, ipc.SamplingParams(), ipc.DetokParams(),
                                   prompt="hi")

        queues = {rid: await client.submit(req(rid)) for rid in ("info-only", "other", "held")}
        at = {}  # rid -> the worker it went to
        for i, sock in enumerate(workers):
            while await sock.poll(500):
                at[msgspec.msgpack.decode(await sock.recv(), type=ipc.TokenizerInbound).rid] = i
        assert at["info-only"] == at["held"] != at["other"], at
        for msg in (ipc.RequestInfo("info-only", 2), ipc.RequestInfo("held", 2),
                    ipc.EngineHas("held"), ipc.RequestInfo("other", 2)):
            await answers.send(msgspec.msgpack.encode(msg))
        for rid in ("info-only", "held", "other"):
            assert isinstance(await asyncio.wait_for(queues[rid].get(), 5), ipc.RequestInfo)
        await asyncio.sleep(0.1)  # (EngineHas puts nothing on the queue: let it be read)
        assert client.fail_requests("request lost: tokenizer_worker exited", "tokenizer_lost",
                                    tokenizer=at["info-only"]) == 1
        err = queues["info-only"].get_nowait()
        assert isinstance(err, ipc.RequestError) and (err.status, err.code) == (503, "tokenizer_lost")
        assert queues["held"].empty() and queues["other"].empty()
        abort = msgspec.msgpack.decode(await asyncio.wait_for(scheduler.recv(), 5),
                                       type=ipc.SchedulerInbound)
        assert isinstance(abort, ipc.Abort) and abort.rid == "info-only"
    finally:
        await client.close()
        ctx.destroy(linger=0)
