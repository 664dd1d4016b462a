"""Frontends on several nodes (``api_frontends`` per node, an HTTP port per node): each
prefill or decode pool node serves the OpenAI API itself, as llm-d's pools do, so an
endpoint picker can target either pool. Two launchers on loopback (CURVE between them):
a request entering at either node's port goes prefill -> decode and equals HF greedy;
``--check`` refuses a frontend placed twice or not at all, and an ipc address that a
frontend on another node would have to reach."""

from __future__ import annotations

import random
import socket
import subprocess
import sys

import msgspec
import pytest
from cluster.process_config import process_configs
from cluster.topology import Topology
from launcher.topology_check import TopologyError, check_topology
from tests.support import model_zoo
from tests.support.metrics_text import scrape
from tests.support.polling import wait_until
from tests.support.server import REPO, CandorServer, free_port

MODEL = "tiny-llama"
MAX_NEW = 12


def _free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
            return True
        except OSError:
            return False


def _port_prefix(used: list[str]) -> int:
    """Two digits P such that every port P + suffix (``used``) is free here."""
    for _ in range(200):
        prefix = random.randint(20, 32)
        if all(_free(int(f"{prefix}{s}")) for s in used):
            return prefix
    raise AssertionError("no free port block")


SUFFIXES = ["000", "010", "001", "011", "002", "012", "003", "013", "110", "200", "201",
            "211", "300", "301"]


def _yaml(model_dir, http: tuple[int, int], p: int, keys=None, **overrides: str) -> str:
    addresses = {
        "scheduler_in": f"tcp://{{host}}:{p}0{{r}}0", "scheduler_pub": f"tcp://{{host}}:{p}0{{r}}1",
        "worker_in": f"tcp://{{host}}:{p}0{{r}}2", "worker_out": f"tcp://{{host}}:{p}0{{r}}3",
        "kv_in": f"tcp://{{host}}:{p}1{{r}}{{k}}", "tokenizer_in": f"tcp://{{host}}:{p}2{{i}}0",
        "frontend_results": f"tcp://{{host}}:{p}2{{i}}1", **overrides}
    lines = "\n".join(f"  {k}: \"{v}\"" for k, v in addresses.items())
    curve = f"security: {{curve: {{key_dir: {keys}}}}}\n" if keys else ""
    return f"""
model: {{path: {model_dir}, served_model_name: {MODEL}, max_model_len: 1024}}
replicas: 2
disaggregation: {{prefill_replicas: 1, decode_replicas: 1}}
roles: {{api_frontend: 2}}
http: {{host: 127.0.0.1, port: {http[0]}}}
{curve}nodes:
  - {{name: prefill, host: 127.0.0.1, http_port: {http[0]}, api_frontends: [0],
      gpu_workers: [0],
      roles: [api_frontend, tokenizer_worker, detokenizer, scheduler, gpu_worker],
      status_address: "tcp://{{host}}:{p}300"}}
  - {{name: decode, host: 127.0.0.1, http_port: {http[1]}, api_frontends: [1],
      gpu_workers: [1], roles: [api_frontend, gpu_worker],
      status_address: "tcp://{{host}}:{p}301"}}
addresses:
{lines}
"""


def _topology(text: str) -> Topology:
    return msgspec.yaml.decode(text.encode(), type=Topology)


def _problems(text: str, tmp_path) -> str:
    """The problems named, checked in-process and by ``launch_cluster.py --check``."""
    with pytest.raises(TopologyError) as err:
        check_topology(_topology(text), check_model=False)
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    out = subprocess.run([sys.executable, str(REPO / "launch_cluster.py"), str(path),
                          "--check"], capture_output=True, text=True, cwd=REPO, timeout=60)
    assert out.returncode == 2, out.stderr
    return str(err.value) + "\n" + out.stderr


def test_each_node_runs_its_own_frontends_on_its_own_port(tiny_model_dir):
    topo = _topology(_yaml(tiny_model_dir, (8000, 8001), 25))
    check_topology(topo, check_model=False)
    fronts = {(c.node, c.index, c.http.port) for c in process_configs(topo, "/r")
              if c.role == "api_frontend"}
    assert fronts == {("prefill", 0, 8000), ("decode", 1, 8001)}
    # a frontend's results come back to its own node
    cfg = next(c for c in process_configs(topo, "/r", node="decode") if c.role == "api_frontend")
    assert cfg.addresses.frontend_results == ["tcp://127.0.0.1:25201", "tcp://127.0.0.1:25211"]


@pytest.mark.parametrize("edit, message", [
    (lambda t: t.replace("api_frontends: [1]", "api_frontends: [0]"),
     "the nodes' api_frontends name [0, 0]; they must name each of 0..1 once"),
    (lambda t: t.replace("api_frontends: [1]", "api_frontends: []"),
     "the nodes' api_frontends name [0]; they must name each of 0..1 once"),
    (lambda t: t.replace(", api_frontends: [1]", ""),
     "api_frontend is placed on several nodes ['prefill', 'decode']: each must list its "
     "api_frontends"),
    (lambda t: t.replace("http_port: 8001", "http_port: 8000"),
     "port 8000 on 127.0.0.1 is used by both nodes[prefill].http_port and "
     "nodes[decode].http_port"),
])
def test_frontend_placement_is_checked_naming_the_key(tiny_model_dir, tmp_path, edit,
                                                     message):
    problems = _problems(edit(_yaml(tiny_model_dir, (8000, 8001), 25)), tmp_path)
    assert problems.count(message) == 2, problems


@pytest.mark.parametrize("key, message", [
    ("frontend_results", "frontend_results[1] is 'ipc:///run/frontend-1' (ipc://, one host "
     "only) but node(s) ['prefill'] must reach node 'decode': use tcp://"),
    ("tokenizer_in", "tokenizer_in[0] is 'ipc:///run/tokenizer-0' (ipc://, one host only) "
     "but node(s) ['decode'] must reach node 'prefill'"),
    ("scheduler_pub", "scheduler_pub[0] is 'ipc:///run/scheduler-pub-0' (ipc://, one host "
     "only) but node(s) ['decode'] must reach node 'prefill'"),
])
def test_an_ipc_address_a_frontend_crosses_nodes_for_is_named(tiny_model_dir, tmp_path, key,
                                                             message):
    ipc = {"frontend_results": "ipc://{run_dir}/frontend-{i}",
           "tokenizer_in": "ipc://{run_dir}/tokenizer-{i}",
           "scheduler_pub": "ipc://{run_dir}/scheduler-pub-{r}"}
    text = _yaml(tiny_model_dir, (8000, 8001), 25, **{key: ipc[key]})
    problems = _problems(text, tmp_path)
    assert problems.count(message) == 2, problems


def _sent(srv: CandorServer) -> float:
    return scrape(srv).total("candor_kv_transfer_bytes_total", direction="sent")


def test_either_pool_nodes_frontend_serves_through_prefill_then_decode(
        tiny_model_dir, tmp_path, hf_model):
    keys = tmp_path / "keys"
    gen = subprocess.run([sys.executable, str(REPO / "launch_cluster.py"), "keygen",
                          str(keys)], capture_output=True, text=True, timeout=60)
    assert gen.returncode == 0, gen.stderr
    http = (free_port(), free_port())
    p = _port_prefix(SUFFIXES)
    topo = tmp_path / "pools.yaml"
    topo.write_text(_yaml(tiny_model_dir, http, p, keys=keys))
    decode = CandorServer.from_topology(topo, http[1], node="decode").spawn(
        tmp_path / "decode.log")
    prefill = CandorServer.from_topology(topo, http[0], node="prefill")
    try:
        prefill.start(log_path=tmp_path / "prefill.log")
        wait_until(decode.health, "the decode node's frontend /health to answer 200",
                   until=lambda h: h[0] == 200, timeout=120, interval=0.2)
        for srv in (prefill, decode):
            status, health = srv.health()
            assert status == 200 and health["status"] == "ok", health
            assert set(health["nodes"]) == {"prefill", "decode"}
            assert sorted(health["nodes"]["decode"]) == ["api_frontend[1]", "gpu_worker[1]"]
            assert [(r["replica"], r["role"]) for r in health["replicas"]] == [
                (0, "prefill"), (1, "decode")]
        model, _ = hf_model
        prompts = [[0, 15, 200, 31], list(range(40, 90))]
        for srv in (prefill, decode):  # either entry point: prefill replica, then decode
            for ids in prompts:
                before = _sent(prefill)
                status, body = srv.post_json("/v1/completions", {
                    "model": MODEL, "prompt": ids, "max_tokens": MAX_NEW, "temperature": 0,
                    "ignore_eos": True, "return_token_ids": True})
                assert status == 200, body
                assert body["choices"][0]["token_ids"] == model_zoo.hf_greedy(model, ids,
                                                                              MAX_NEW)
                assert _sent(prefill) > before  # the prompt's KV moved prefill -> decode
    finally:
        assert prefill.stop() == 0
        assert decode.stop() == 0
