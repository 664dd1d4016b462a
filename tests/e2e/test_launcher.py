"""Supervision through real processes: clean SIGTERM, a dead child stops the topology,
no orphans, lean roles without torch, and topology files that fail loudly."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import msgspec
import pytest

from cluster.process_config import process_configs
from cluster.topology import load_topology
from tests.support.polling import wait_until
from tests.support.server import REPO, CandorServer, pid_alive, role_of

LEAN_ROLES = ("api_frontend", "tokenizer_worker", "scheduler", "detokenizer")


def _rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def _maps_torch(pid: int) -> bool:
    return "libtorch" in Path(f"/proc/{pid}/maps").read_text()


def test_sigterm_stops_every_child_and_exits_zero(tiny_model_dir, capsys):
    srv = CandorServer(tiny_model_dir, "--tokenizer-workers", "2").start()
    children = srv.children()
    roles = sorted(role_of(p) for p in children)
    assert roles == sorted(["api_frontend[0]", "tokenizer_worker[0]", "tokenizer_worker[1]",
                            "scheduler[0]", "gpu_worker[0]", "detokenizer[0]"])
    # lean roles never load torch; each role's RSS is printed (what a role costs)
    for pid in children:
        role = role_of(pid)
        print(f"RSS {role}: {_rss_mb(pid):.0f} MiB")
        assert _maps_torch(pid) == role.startswith("gpu_worker"), f"{role}: torch mapping"
    assert srv.stop() == 0
    wait_until(lambda: not any(pid_alive(p) for p in children),
               "every child gone after a clean stop", timeout=5)


def test_dead_child_stops_the_topology_nonzero(tiny_model_dir):
    srv = CandorServer(tiny_model_dir).start()
    children = srv.children()
    victim = next(p for p in children if role_of(p).startswith("detokenizer"))
    os.kill(victim, signal.SIGKILL)
    assert srv.proc.wait(timeout=30) == 1
    wait_until(lambda: not any(pid_alive(p) for p in children),
               "every child gone after the topology stopped", timeout=5)


def test_children_die_with_a_killed_launcher(tiny_model_dir):
    srv = CandorServer(tiny_model_dir).start()
    children = srv.children()
    roles = {p: role_of(p) for p in children}
    srv.proc.kill()          # SIGKILL: the launcher gets no chance to clean up
    srv.proc.wait()
    wait_until(lambda: [roles[p] for p in children if pid_alive(p)] == [],
               "every child gone after its launcher was killed", timeout=20)


def _processes_in(directory: Path) -> list[str]:
    """Command lines of the processes that run in ``directory`` or name a path in it."""
    out = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode()
            cwd = os.readlink(entry / "cwd")
        except OSError:
            continue
        if str(directory) in cmdline or cwd.startswith(str(directory)):
            out.append(cmdline)
    return out


def test_a_worker_stopped_mid_build_leaves_no_compiler_behind(tiny_model_dir, tmp_path):
    """An empty kernel cache: the gpu_worker compiles its CPU kernels at start-up. A stop
    then (SIGTERM to the launcher, the worker SIGKILLed past its grace) must take ninja and
    the compiler with it: they would outlive the launcher, load the box, and race the next
    build into the same directory."""
    cache = tmp_path / "torch_extensions"
    srv = CandorServer(tiny_model_dir, env={"TORCH_EXTENSIONS_DIR": str(cache)})
    srv.spawn(log_path=tmp_path / "log")
    try:
        wait_until(lambda: [c for c in _processes_in(cache) if "ninja" in c or "c++" in c],
                   "the worker's kernel build running", timeout=120, interval=0.2)
    finally:
        assert srv.stop() == 0
    wait_until(lambda: _processes_in(cache) == [], "no build process left after the stop",
               timeout=10)


def test_build_kernels_leaves_each_kernel_where_a_worker_loads_it():
    """``candor build-kernels`` (make serve and make test run it first) builds under the
    names a gpu_worker computes: same PATH as the launcher gives its children."""
    env = {**os.environ, "PATH": os.path.dirname(sys.executable) + os.pathsep
           + os.environ.get("PATH", "")}
    out = subprocess.run([sys.executable, str(REPO / "launch_cluster.py"), "build-kernels"],
                         env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert len(lines) == 6 and all(": ready (" in line for line in lines), out.stdout
    where = subprocess.run([sys.executable, "-c", (
        "from pathlib import Path\n"
        "from gpu_worker.cpu_extension import build_dir\n"
        "from gpu_worker.attention.cpu_kernel_backend import CFLAGS as A, _SOURCE as a\n"
        "from gpu_worker.models.row_ops import CFLAGS as R, _SOURCE as r\n"
        "from gpu_worker.models.layer_loop import CFLAGS as L, _SOURCE as l\n"
        "for src, flags in ((a, A), (r, R), (l, L)):\n"
        "    name, d = build_dir(src, flags)\n"
        "    print(Path(d) / (name + '.so'))")], env=env, cwd=REPO, capture_output=True,
        text=True, timeout=60)
    assert where.returncode == 0, where.stderr
    for so in where.stdout.split():
        assert Path(so).is_file(), so


def test_topology_yaml_errors_name_the_bad_key(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("model:\n  path: /x\nroles:\n  tokeniser_worker: 2\n")
    with pytest.raises(msgspec.ValidationError, match="tokeniser_worker"):
        load_topology(str(bad))
    out = subprocess.run([sys.executable, str(REPO / "launch_cluster.py"), str(bad)],
                         capture_output=True, text=True, cwd=REPO)
    assert out.returncode == 2 and "tokeniser_worker" in out.stderr


def test_colliding_addresses_are_rejected(tmp_path):
    bad = tmp_path / "collide.yaml"
    bad.write_text("model:\n  path: /x\nroles:\n  tokenizer_worker: 2\n"
                   "addresses:\n  tokenizer_in: ipc://{run_dir}/tok\n")
    with pytest.raises(ValueError, match="collide"):
        process_configs(load_topology(str(bad)), "/tmp/r")


@pytest.mark.parametrize("path", sorted((REPO / "deploy" / "topologies").glob("*.yaml")))
def test_shipped_topologies_are_valid(path):
    topology = load_topology(str(path))
    configs = process_configs(topology, "/tmp/candor-test")
    assert {c.role for c in configs} == {"api_frontend", "tokenizer_worker", "scheduler",
                                         "gpu_worker", "detokenizer"}


def test_each_role_decodes_only_its_own_slice(tmp_path):
    """A child's JSON carries its role's slice of the topology and decodes as that role's
    type only (the role is the tag)."""
    from cluster.lifecycle import read_config
    from cluster.process_config import (DetokenizerConfig, FrontendConfig, SchedulerConfig,
                                        TokenizerConfig, WorkerConfig)

    topo = tmp_path / "t.yaml"
    topo.write_text("model: {path: /m, max_model_len: 64}\ntensor_parallel: 2\nreplicas: 2\n"
                    "supervision: {heartbeat_stale_s: 5.0}\n")
    kinds = {"api_frontend": FrontendConfig, "tokenizer_worker": TokenizerConfig,
             "scheduler": SchedulerConfig, "gpu_worker": WorkerConfig,
             "detokenizer": DetokenizerConfig}
    slices = {"api_frontend": {"http", "api", "supervision", "router", "nodes"},
              "tokenizer_worker": {"api", "max_model_len"}, "detokenizer": {"model_path"},
              "scheduler": {"engine", "replica"}, "gpu_worker": {"engine", "dtype"}}
    unused = {"api_frontend": {"engine"}, "tokenizer_worker": {"http", "engine"},
              "detokenizer": {"api", "http", "engine", "max_model_len"},
              "scheduler": {"http", "api", "model_path"}, "gpu_worker": {"http", "api"}}
    configs = process_configs(load_topology(str(topo)), "/tmp/r")
    for cfg in configs:
        raw = msgspec.json.encode(cfg).decode()
        fields = set(msgspec.json.decode(raw))
        assert fields >= slices[cfg.role] | {"role", "index", "addresses", "security"}
        assert not fields & unused[cfg.role], (cfg.role, fields & unused[cfg.role])
        assert read_config(kinds[cfg.role], [raw]) == cfg
        other = kinds["detokenizer" if cfg.role != "detokenizer" else "scheduler"]
        with pytest.raises(msgspec.ValidationError, match="role"):
            read_config(other, [raw])
    workers = [c for c in configs if c.role == "gpu_worker"]
    assert [(c.replica, c.tp_rank) for c in workers] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    front = next(c for c in configs if c.role == "api_frontend")
    assert front.supervision.heartbeat_stale_s == 5.0 and front.replicas == 2
    # one node: a file store in the private run directory, collectives on loopback
    assert workers[0].tp_address == "file:///tmp/r/tp-rendezvous-0"
    assert workers[2].tp_address == "file:///tmp/r/tp-rendezvous-1"
    assert {c.tp_interface for c in workers} == {"lo"}


def test_two_models_get_their_own_engines_numbered_across_models(tmp_path):
    """``models``: each served model its own replicas, ranks, tokenizer workers and (a
    pooling model: no) detokenizers, numbered across models; the frontend routes to each
    by its indexes; a name may name one model only."""
    from launcher.topology_check import TopologyError, check_topology

    topo = tmp_path / "t.yaml"
    topo.write_text("model: {path: /gen, served_model_name: chat}\nreplicas: 2\n"
                    "models:\n  - model: {path: /emb, served_model_name: [embed, e2], "
                    "runner: pooling}\n    tensor_parallel: 2\n    tokenizer_workers: 2\n")
    topology = load_topology(str(topo))
    configs = process_configs(topology, "/tmp/r")
    workers = [c for c in configs if c.role == "gpu_worker"]
    assert [(c.index, c.model_path, c.runner, c.replica, c.tp_rank) for c in workers] == [
        (0, "/gen", "generate", 0, 0), (1, "/gen", "generate", 1, 0),
        (2, "/emb", "pooling", 2, 0), (3, "/emb", "pooling", 2, 1)]
    assert workers[2].tp_address == workers[3].tp_address == "file:///tmp/r/tp-rendezvous-2"
    schedulers = [c for c in configs if c.role == "scheduler"]
    assert [c.replica for c in schedulers] == [0, 1, 2]
    assert schedulers[2].addresses.detokenizers() == []  # pooling answers the frontend
    assert schedulers[0].addresses.detokenizers() == schedulers[0].addresses.detokenizer_in
    tokenizers = [(c.index, c.model_path) for c in configs if c.role == "tokenizer_worker"]
    assert tokenizers == [(0, "/gen"), (1, "/emb"), (2, "/emb")]
    assert [c.model_path for c in configs if c.role == "detokenizer"] == ["/gen"]
    front = next(c for c in configs if c.role == "api_frontend")
    assert [(e.names, e.runner, e.replicas, e.tokenizers, e.detokenizers)
            for e in front.served()] == [(["chat"], "generate", [0, 1], [0], [0]),
                                         (["embed", "e2"], "pooling", [2], [1, 2], [])]
    clash = tmp_path / "clash.yaml"
    clash.write_text("model: {path: /gen, served_model_name: x}\n"
                     "models:\n  - model: {path: /emb, served_model_name: x, runner: pooling}\n")
    with pytest.raises(TopologyError, match="'x' names two models"):
        check_topology(load_topology(str(clash)))


def test_restart_budget_backs_off_and_forgets_restarts_past_its_window():
    from launcher.supervisor import RestartBudget

    budget = RestartBudget(limit=4, window_s=60, backoff_max_s=3)
    delays = []
    for t in (0.0, 1.0, 2.0, 3.0):
        delays.append(budget.delay(t))
        budget.spend(t)
    assert delays == [0.0, 1.0, 2.0, 3.0]  # doubling, capped at backoff_max_s
    assert budget.delay(4.0) is None  # a fifth within the minute: the topology stops
    assert budget.recent(60.5) == 3 and budget.delay(60.5) == 3.0  # the first has left
    assert budget.recent(200.0) == 0 and budget.delay(200.0) == 0.0  # a crash a day
    assert RestartBudget(limit=0, window_s=60, backoff_max_s=3).delay(0.0) is None
