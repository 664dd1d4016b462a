"""Tensor parallelism on CPU (gloo): two ranks give HF's greedy tokens.

- Runner level, every architecture of the registry: two ranks in one gloo group run the
  same plans (prefill, then run-ahead decode steps that feed ``PLACEHOLDER_TOKEN``) and
  rank 0's tokens equal a single-rank runner's and HF's.
- Through all processes: ``--tensor-parallel-size 2`` serves a dense and an MoE
  checkpoint with HF's greedy tokens, holds the KV cache every rank can hold, and a
  killed rank turns /health 503 within a second and stops the topology.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request

import pytest
import torch
import torch.multiprocessing as mp

from gpu_worker.model_config import load_config
from gpu_worker.plan_order import PLAN_GAP_EXIT
from gpu_worker.tp_shard import ShardError, shard_problems, tp_shard
from protocol.ipc import PLACEHOLDER_TOKEN, SamplingParams, SeqChunk, StepPlan
from tests.support import model_zoo
from tests.support.faults import drop_plan_env
from tests.support.polling import wait_until
from tests.support.server import REPO, CandorServer, free_port, role_of
from tests.support.tp_ranks import leave_group

MAX_NEW = 12
GREEDY = SamplingParams(temperature=0.0)
# every architecture of the zoo (dense, windowed, soft-capped, MoE, fused Phi-3, OLMo 2's
# whole-projection q/k norm, tied and untied heads)
ARCHS = sorted(model_zoo.ARCHS)


def _prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(5)
    return [[0] + torch.randint(6, model_zoo.VOCAB, (n - 1,), generator=g).tolist() for n in (7, 40)]


def _generate(runner, prompts: list[list[int]], n: int,
              adapters: list[int] | None = None) -> list[list[int]]:
    """Greedy ``n`` tokens per prompt: one prefill step, then decode steps planned one
    ahead, as the scheduler does (each feeds the token the previous step sampled as a
    placeholder, and only the block ids new to the worker). ``adapters``: each prompt's
    LoRA adapter id (0: the base model)."""
    bs = runner.block_size
    rids = [f"r{i}" for i in range(len(prompts))]
    tables, sent = [], []
    next_block = 0
    for p in prompts:
        need = -(-(len(p) + n) // bs)
        tables.append(list(range(next_block, next_block + need)))
        next_block += need
        sent.append(0)

    def chunk(i: int, tokens: list[int], pos: int) -> SeqChunk:
        have = -(-(pos + len(tokens)) // bs)
        c = SeqChunk(rids[i], tokens, pos, tables[i][sent[i]:have], True, sent[i])
        sent[i] = have
        return c

    out = [[] for _ in prompts]
    first = runner.execute(StepPlan(0, [chunk(i, p, 0) for i, p in enumerate(prompts)],
                                    {r: GREEDY for r in rids},
                                    new_adapters={r: a for r, a in zip(rids, adapters or []) if a}))
    for i, t in enumerate(first.sampled):
        out[i].append(t)
    for step in range(1, n):
        plan = StepPlan(step, [chunk(i, [PLACEHOLDER_TOKEN], len(p) + step - 1)
                               for i, p in enumerate(prompts)])
        for i, t in enumerate(runner.execute(plan).sampled):
            out[i].append(t)
    return out


def _rank_main(rank: int, size: int, port: int, paths: dict[str, str], results) -> None:
    torch.set_num_threads(1)
    from gpu_worker.distributed import init_ranks
    from gpu_worker.model_runner import ModelRunner

    ranks = init_ranks(rank, size, f"tcp://127.0.0.1:{port}", torch.device("cpu"))
    for arch, path in paths.items():
        runner = ModelRunner(path, num_blocks=64, ranks=ranks)
        tokens = _generate(runner, _prompts(), MAX_NEW)
        if rank == 0:
            results[arch] = (tokens, runner.num_blocks)
    leave_group()


@pytest.fixture(scope="module")
def zoo(tmp_path_factory):
    root = tmp_path_factory.mktemp("tp-zoo")
    return {arch: str(model_zoo.build(arch, root / arch)) for arch in ARCHS}


def test_every_architecture_shards_over_two_ranks_with_hf_greedy_tokens(zoo):
    from gpu_worker.model_runner import ModelRunner

    with mp.Manager() as manager:
        results = manager.dict()
        mp.spawn(_rank_main, args=(2, free_port(), zoo, results), nprocs=2, join=True)
        results = dict(results)
    for arch in ARCHS:
        tokens, blocks = results[arch]
        single = _generate(ModelRunner(zoo[arch], num_blocks=64), _prompts(), MAX_NEW)
        hf = model_zoo.hf_model(zoo[arch])
        expected = [model_zoo.hf_greedy(hf, p, MAX_NEW) for p in _prompts()]
        assert single == expected, arch
        assert tokens == expected, arch
        assert blocks == 64


def test_fewer_kv_heads_than_ranks_replicates_them(zoo):
    """Four ranks over 2 KV heads: each rank keeps the KV head its query head reads."""
    paths = {arch: zoo[arch] for arch in ("qwen3", "mixtral")}
    with mp.Manager() as manager:
        results = manager.dict()
        mp.spawn(_rank_main, args=(4, free_port(), paths, results), nprocs=4, join=True)
        results = dict(results)
    for arch, path in paths.items():
        hf = model_zoo.hf_model(path)
        assert results[arch][0] == [model_zoo.hf_greedy(hf, p, MAX_NEW) for p in _prompts()], arch


def test_shapes_that_do_not_split_are_named(zoo):
    cfg = load_config(zoo["qwen3_moe"])  # 4 heads, 2 KV heads, 4 experts
    assert shard_problems(cfg, 2) == []
    problems = shard_problems(cfg, 3)
    assert any("num_attention_heads=4" in p for p in problems)
    assert any("num_experts=4" in p for p in problems)
    with pytest.raises(ShardError):
        tp_shard(cfg, 0, 3)
    four = tp_shard(cfg, 3, 4)  # fewer KV heads than ranks: each keeps its group's head
    assert (four.heads, four.kv_heads, four.kv_start, four.experts) == (1, 1, 1, 1)


# ---------------------------------------------------------------- through every process


def _complete(srv: CandorServer, model: str, prompt: list[int], n: int) -> list[int]:
    body = {"model": model, "prompt": prompt, "max_tokens": n, "temperature": 0,
            "return_token_ids": True}
    req = urllib.request.Request(srv.base_url + "/v1/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as resp:
        return json.loads(resp.read())["choices"][0]["token_ids"]


@pytest.mark.parametrize("arch", ["qwen3", "qwen3_moe"])
def test_tp2_serves_hf_greedy_tokens_through_all_processes(arch, zoo, tiny_model_dir, tmp_path):
    import shutil

    path = tmp_path / arch
    shutil.copytree(zoo[arch], path)
    for f in tiny_model_dir.iterdir():
        if f.name.startswith("tokenizer") or f.name in ("chat_template.jinja", "special_tokens_map.json"):
            shutil.copy(f, path / f.name)
    hf = model_zoo.hf_model(path)
    srv = CandorServer(path, "--served-model-name", arch, "--tensor-parallel-size", "2",
                       "--num-kv-blocks", "96").start(log_path=tmp_path / "log")
    try:
        names = sorted(role_of(p) for p in srv.children())
        assert names.count("gpu_worker[0]") == 1 and names.count("gpu_worker[1]") == 1
        assert srv.engine_stats()["total_blocks"] == 96
        for prompt in _prompts():
            assert _complete(srv, arch, prompt, MAX_NEW) == model_zoo.hf_greedy(hf, prompt, MAX_NEW)
        srv.wait_all_blocks_free()
    finally:
        assert srv.stop() == 0


def test_a_killed_rank_turns_health_503_and_stops_the_topology(tiny_model_dir, tmp_path):
    log = tmp_path / "log"
    port = free_port()
    topo = tmp_path / "tp2.yaml"  # the teardown delay keeps the 503 observable
    topo.write_text(f"model: {{path: {tiny_model_dir}}}\ntensor_parallel: 2\n"
                    f"http: {{port: {port}}}\nsupervision: {{teardown_delay_s: 3}}\n")
    srv = CandorServer.from_topology(topo, port).start(log_path=log)
    try:
        rank1 = next(p for p in srv.children() if role_of(p) == "gpu_worker[1]")
        os.kill(rank1, signal.SIGKILL)
        health = wait_until(srv.health, "/health 503 within a second of the kill",
                            until=lambda h: h[0] == 503, timeout=1.0, interval=0.02)
        assert "gpu_worker[1]" in health[1]["error"]["message"]
        assert srv.proc.wait(timeout=30) == 1
        assert srv.children() == []  # every other rank and role stopped
    finally:
        srv.stop()
    assert "gpu_worker[1] exited with code -9" in log.read_text()


def test_tp2_split_across_two_nodes_over_loopback_tcp(tiny_model_dir, tmp_path):
    """Two launchers: the gateway node runs every role and rank 0, the other node rank 1;
    the plans reach rank 1 over tcp and the ranks meet at a fixed rendezvous port."""
    http = free_port()
    ports = [free_port() for _ in range(5)]
    topo = tmp_path / "two-node-tp.yaml"
    topo.write_text(f"""
model: {{path: {tiny_model_dir}, served_model_name: tiny, max_model_len: 1024}}
tensor_parallel: 2
http: {{port: {http}}}
nodes:
  - {{name: gateway, host: 127.0.0.1, gpu_workers: [0],
      roles: [api_frontend, tokenizer_worker, detokenizer, scheduler, gpu_worker],
      status_address: "tcp://{{host}}:{ports[0]}"}}
  - {{name: rank1, host: 127.0.0.1, roles: [gpu_worker], gpu_workers: [1],
      status_address: "tcp://{{host}}:{ports[1]}"}}
addresses:
  worker_in: tcp://{{host}}:{ports[2]}
  worker_out: tcp://{{host}}:{ports[3]}
  tp_rendezvous: tcp://{{host}}:{ports[4]}
security: {{tensor_parallel: {{protection: private_network, network: 127.0.0.0/8}}}}
""")
    from cluster.process_config import process_configs
    from cluster.topology import load_topology
    placed = {(c.node, c.role, c.index) for c in process_configs(load_topology(str(topo)), "/r")
              if c.role == "gpu_worker"}
    assert placed == {("gateway", "gpu_worker", 0), ("rank1", "gpu_worker", 1)}
    other = CandorServer.from_topology(topo, free_port(), node="rank1").spawn(tmp_path / "rank1.log")
    gateway = CandorServer.from_topology(topo, http, node="gateway")
    try:
        gateway.start(log_path=tmp_path / "gateway.log")
        status, body = gateway.health()
        assert status == 200 and body["nodes"]["rank1"] == ["gpu_worker[1]"]
        hf = model_zoo.hf_model(tiny_model_dir)
        for prompt in ([0, 15, 200, 31], list(range(40, 90))):
            body = {"model": "tiny", "prompt": prompt, "max_tokens": MAX_NEW, "temperature": 0,
                    "ignore_eos": True, "return_token_ids": True}
            req = urllib.request.Request(gateway.base_url + "/v1/completions",
                                         data=json.dumps(body).encode(),
                                         headers={"Content-Type": "application/json"})
            with urllib.request.urlopen(req, timeout=120) as resp:
                ids = json.loads(resp.read())["choices"][0]["token_ids"]
            assert ids == model_zoo.hf_greedy(hf, prompt, MAX_NEW)
    finally:
        assert gateway.stop() == 0
        other.stop()


def test_ranks_across_nodes_must_be_named_once_with_a_fixed_rendezvous(tiny_model_dir):
    import msgspec

    from cluster.topology import Topology
    from launcher.topology_check import TopologyError, check_topology

    def problems(nodes: list[dict], **addresses) -> str:
        topo = msgspec.convert({"model": {"path": str(tiny_model_dir)}, "tensor_parallel": 2,
                                "nodes": nodes, "addresses": {
                                    "worker_in": "tcp://{host}:7001",
                                    "worker_out": "tcp://{host}:7002", **addresses}}, Topology)
        with pytest.raises(TopologyError) as err:
            check_topology(topo, check_model=False)
        return str(err.value)

    gateway = {"name": "a", "roles": ["api_frontend", "tokenizer_worker", "detokenizer",
                                      "scheduler", "gpu_worker"], "gpu_workers": [0]}
    assert "each must list its gpu_workers" in problems(
        [{**gateway, "gpu_workers": None}, {"name": "b", "host": "10.0.0.2", "roles": ["gpu_worker"]}])
    assert "must name each of 0..1 once" in problems(
        [gateway, {"name": "b", "host": "10.0.0.2", "roles": ["gpu_worker"], "gpu_workers": [0]}],
        tp_rendezvous="tcp://{host}:7003")
    assert "needs a fixed port" in problems(
        [gateway, {"name": "b", "host": "10.0.0.2", "roles": ["gpu_worker"], "gpu_workers": [1]}])


@pytest.mark.parametrize("dropped, max_tokens", [(3, 40), (1, 1)],
                         ids=["gap-seen-at-the-next-plan", "the-last-plan-lost"])
def test_a_rank_that_misses_a_plan_stops_loudly(tiny_model_dir, tmp_path, dropped, max_tokens):
    """Plans reach the ranks over PUB/SUB, which drops messages while a subscriber
    reconnects: here rank 1 never sees plan ``dropped``. It must not compute on (its next
    collective would pair with rank 0's previous one: wrong sums, then a hang at the
    120 s collective timeout): it stops naming the plan it missed (seen from the next
    plan's number, or from the scheduler's mark of the newest plan when no other plan
    comes), the request fails in the error shape within seconds, /health turns 503
    naming the rank and the launcher exits 1."""
    log = tmp_path / "log"
    port = free_port()
    topo = tmp_path / "tp2.yaml"
    topo.write_text(f"model: {{path: {tiny_model_dir}}}\ntensor_parallel: 2\n"
                    f"http: {{port: {port}}}\nsupervision: {{teardown_delay_s: 5}}\n")
    srv = CandorServer.from_topology(topo, port, env=drop_plan_env(1, dropped)).start(
        log_path=log)
    try:
        body = {"model": "tiny-llama", "prompt": [0, 15, 200, 31],
                "max_tokens": max_tokens, "ignore_eos": True}
        req = urllib.request.Request(srv.base_url + "/v1/completions",
                                     data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
        started = time.monotonic()
        with pytest.raises(urllib.error.HTTPError) as failed:
            urllib.request.urlopen(req, timeout=60)
        took = time.monotonic() - started
        error = json.loads(failed.value.read())["error"]
        print(f"failed after {took:.2f}s: {failed.value.code} {error}")
        assert failed.value.code in (500, 503) and set(error) == {"message", "type", "param",
                                                                    "code"}
        assert took < 20
        health = wait_until(srv.health, "/health 503 naming the rank",
                            until=lambda h: h[0] == 503, timeout=5, interval=0.02)
        assert "gpu_worker[1]" in health[1]["error"]["message"]
        assert srv.proc.wait(timeout=30) == 1
    finally:
        srv.stop()
    text = log.read_text()
    assert f"missed step plan {dropped}" in text
    assert f"gpu_worker[1] exited with code {PLAN_GAP_EXIT}; stopping the topology" in text


def _spanning(**security) -> str:
    """Problems of a TP=2 topology whose ranks sit on two nodes (10.0.0.1, 10.0.0.2)."""
    import msgspec

    from cluster.topology import Topology
    from launcher.topology_check import TopologyError, check_topology

    topo = msgspec.convert({
        "model": {"path": "/m"}, "tensor_parallel": 2, "security": security,
        "nodes": [{"name": "a", "host": "10.0.0.1", "gpu_workers": [0],
                   "roles": ["api_frontend", "tokenizer_worker", "detokenizer", "scheduler",
                             "gpu_worker"]},
                  {"name": "b", "host": "10.0.0.2", "roles": ["gpu_worker"], "gpu_workers": [1],
                   "status_address": "tcp://{host}:7004"}],
        "addresses": {"worker_in": "tcp://{host}:7001", "worker_out": "tcp://{host}:7002",
                      "tp_rendezvous": "tcp://{host}:7003",
                      "node_status": "tcp://{host}:7005"}}, Topology)
    try:
        check_topology(topo, check_model=False)
    except TopologyError as err:
        return str(err)
    return ""


def test_ranks_across_nodes_need_their_traffic_protection_declared():
    """The rendezvous store and gloo/NCCL are outside CURVE: ranks that span nodes are
    refused until the topology names a private network or tunnel holding every host."""
    assert "span nodes ['a', 'b']" in _spanning()
    assert "outside CURVE" in _spanning()
    assert _spanning(tensor_parallel={"protection": "private_network",
                                      "network": "10.0.0.0/24", "interface": "eth1"}) == ""
    assert _spanning(tensor_parallel={"protection": "tunnel", "network": "10.0.0.0/8"}) == ""
    outside = _spanning(tensor_parallel={"protection": "tunnel", "network": "10.0.0.0/31"})
    assert "node 'b''s host '10.0.0.2' (10.0.0.2) is outside the declared tunnel network " \
           "10.0.0.0/31" in outside
    assert "node 'a'" not in outside
    assert "security.tensor_parallel.network" in _spanning(
        tensor_parallel={"protection": "tunnel", "network": "10.0.0.0/33"})


def test_cross_node_tp_is_refused_at_check_and_at_start(tmp_path, tiny_model_dir):
    topo = tmp_path / "span.yaml"
    topo.write_text(f"""
model: {{path: {tiny_model_dir}}}
tensor_parallel: 2
nodes:
  - {{name: a, host: 127.0.0.1, gpu_workers: [0],
      roles: [api_frontend, tokenizer_worker, detokenizer, scheduler, gpu_worker]}}
  - {{name: b, host: 127.0.0.2, roles: [gpu_worker], gpu_workers: [1]}}
addresses:
  worker_in: tcp://{{host}}:{free_port()}
  worker_out: tcp://{{host}}:{free_port()}
  tp_rendezvous: tcp://{{host}}:{free_port()}
  node_status: tcp://{{host}}:{free_port()}
""")
    for extra in (["--check"], ["--node", "b"]):
        out = subprocess.run([sys.executable, str(REPO / "launch_cluster.py"), str(topo),
                              *extra], capture_output=True, text=True, timeout=120)
        assert out.returncode == 2 and "outside CURVE" in out.stderr, out.stderr
