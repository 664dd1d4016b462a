"""Start a Candor topology and supervise it; also the ``candor`` command line.

    python launch_cluster.py deploy/topologies/single-host.yaml
    python launch_cluster.py deploy/topologies/two-node.yaml --node engine   # per machine
    candor serve --model PATH [--port 8000] [--tokenizer-workers N]
    candor make-tiny-model DIR
    candor keygen DIR                  # CURVE keys for the tcp:// sockets between nodes

Both start paths build a ``Topology``, validate it whole (every problem named), and hand
it to ``launch``: one OS process per role instance of this node, each given its
``ProcessConfig`` as JSON. The launcher owns every child and publishes their liveness
for /health; a dead child is restarted when the topology marks its role restartable,
otherwise the launcher stops the rest and exits non-zero naming the role and exit code.
SIGTERM and SIGINT drain (frontends refuse new work and finish what they hold) and exit
0; children also die with the launcher through PR_SET_PDEATHSIG. The run directory (ipc
sockets, metrics) holds the launcher's pid, so a later launcher removes the directories
of launchers that were killed outright.
"""

from __future__ import annotations

import argparse
import errno
import glob
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass

import msgspec

import zmq

from api_frontend.tool_parsers.resolve import resolve_tool_parser
from cluster.generation_config import GenerationConfigError, sampling_defaults
from cluster.hf_cache import ModelNotFound, resolve_model
from cluster.metrics import ENV as METRICS_ENV
from cluster.metrics import prepare_dir as prepare_metrics_dir
from cluster.metrics import process_exited
from cluster.metrics_view import NodeMetricsInfo, ProcessEntry, write_node_info
from cluster.node_http import serve_node_http
from cluster.process_config import ProcessConfig, ReplicaConfig, process_configs
from cluster.serve_cli import (DEFAULT_MODEL_DIR, ServeArgsError, model_argument,
                               normalize_argv, serve_parser, serve_topology)
from cluster.topology import HttpSpec, NodeSpec, Topology, load_topology
from cluster.topology_check import TopologyError, check_topology
from protocol.health import STATUS_INTERVAL_S, ChildStatus, NodeStatus
from protocol.transport import Sender, sync_context

GRACE_S = 10.0

# Roles that never load a model get one BLAS/tokenizers thread: the cores belong to the
# gpu_worker, which sets its own count.
_LEAN_ENV = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "RAYON_NUM_THREADS": "1",
             "TOKENIZERS_PARALLELISM": "false"}
# torch's CPU allocator puts tensors of 2 MB and up on transparent huge pages (read once,
# at its first allocation). Weights and the KV cache are read block by block every step;
# with 4 KB pages the TLB misses cost ~15% of a 100M-model decode step's GEMMs on CPU
# (measured: 124 -> 106 ms for a 32-row step). An operator's own setting wins.
_WORKER_ENV = {"THP_MEM_ALLOC_ENABLE": "1"}


@dataclass
class Child:
    config: ProcessConfig
    proc: subprocess.Popen
    restarts: int = 0
    last_exit: int | None = None

    @property
    def name(self) -> str:
        return self.config.name

    @property
    def replica(self) -> int | None:
        """The engine replica this process belongs to (None: shared by all)."""
        return self.config.replica if isinstance(self.config, ReplicaConfig) else None

    def status(self) -> ChildStatus:
        code = self.proc.poll()
        return ChildStatus(self.config.role, self.config.index, self.proc.pid, code is None,
                           code if code is not None else self.last_exit, self.restarts,
                           self.replica)


RUN_DIR_PREFIX = "candor-"
PID_FILE = "launcher.pid"
# API keys reach the frontends only, in this variable (see api_frontend/auth.py)
KEYS_ENV = "CANDOR_API_KEYS"
_KEY_ENVS = (KEYS_ENV, "CANDOR_API_KEY", "VLLM_API_KEY")


def _spawn(cfg: ProcessConfig, devices: list[int], api_keys: list[str],
           gpu_workers: list[int]) -> subprocess.Popen:
    """``gpu_workers``: the gpu_worker indexes this node runs, in ``devices``' order."""
    env = {k: v for k, v in os.environ.items() if k not in _KEY_ENVS}
    if cfg.role == "api_frontend" and api_keys:
        env[KEYS_ENV] = "\n".join(api_keys)
    if cfg.role != "gpu_worker":
        env.update(_LEAN_ENV)
    else:
        env = {**_WORKER_ENV, **env}
        if devices:  # one device per rank this node runs, when it lists enough
            mine = [devices[gpu_workers.index(cfg.index)]] \
                if len(devices) >= len(gpu_workers) > 1 else devices
            env["CUDA_VISIBLE_DEVICES"] = ",".join(str(d) for d in mine)
    if cfg.metrics_dir is not None:  # read by prometheus_client when a child imports it
        env[METRICS_ENV] = cfg.metrics_dir
    env.setdefault("PYTHONUNBUFFERED", "1")
    # the environment's own tools first (ninja builds the gpu_worker's CPU decode kernel)
    env["PATH"] = os.path.dirname(sys.executable) + os.pathsep + env.get("PATH", "")
    here = os.path.dirname(os.path.abspath(__file__))
    env["PYTHONPATH"] = here + os.pathsep + env.get("PYTHONPATH", "")
    return subprocess.Popen([sys.executable, "-m", cfg.role, msgspec.json.encode(cfg).decode()],
                            env=env)


def _say(message: str) -> None:
    print(f"candor: {message}", file=sys.stderr, flush=True)


def _check_healthy(http: HttpSpec) -> bool:
    host = "127.0.0.1" if http.host in ("0.0.0.0", "") else http.host
    try:
        with urllib.request.urlopen(f"http://{host}:{http.port}/health", timeout=1) as resp:
            return resp.status == 200
    except (urllib.error.URLError, OSError):
        return False


def _stop(children: list[Child]) -> None:
    for child in children:
        if child.proc.poll() is None:
            child.proc.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + GRACE_S
    for child in children:
        try:
            child.proc.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            child.proc.kill()
            child.proc.wait()


class NodeSupervisor:
    """Runs one node's share of the topology: spawns its children, publishes their
    liveness (NodeStatus) for the frontends' /health, restarts the roles the topology
    marks restartable, and on a fatal death or a signal stops everything in order."""

    def __init__(self, topology: Topology, node: NodeSpec, run_dir: str,
                 api_keys: list[str] | None = None) -> None:
        self.topology = topology
        self.api_keys = api_keys or []
        self.node = node
        self.sup = topology.supervision
        self.metrics_dir = os.path.join(run_dir, "metrics")
        prepare_metrics_dir(self.metrics_dir)
        os.environ[METRICS_ENV] = self.metrics_dir  # before prometheus_client is imported
        self.configs = process_configs(topology, run_dir, node.name, self.metrics_dir)
        self.gpu_workers = node.gpu_workers if node.gpu_workers is not None else \
            list(range(topology.tensor_parallel * topology.replicas))
        index = [n.name for n in topology.effective_nodes()].index(node.name)
        self.status_address = self.configs[0].addresses.node_status[index] if self.configs \
            else None
        self.ctx = sync_context(topology.security)
        self.pub = Sender(self.ctx, self.status_address, bind=True, kind=zmq.PUB)
        self.children: list[Child] = []
        self.state = "starting"
        self.problem: str | None = None
        self.lost_replicas: dict[int, str] = {}  # replica -> why, while others serve on
        self.last_publish = 0.0
        from prometheus_client import Counter, Gauge  # after METRICS_ENV is set
        self.up = Gauge("candor_process_up", "1 while a Candor process runs, 0 after it "
                        "exited (per node, role and instance)", ["node", "role", "index"],
                        multiprocess_mode="livesum", registry=None)
        self.restarts = Counter("candor_process_restarts", "Processes the launcher "
                                "restarted after they died", ["node", "role"], registry=None)

    def write_metrics_info(self) -> None:
        """node.json in the metrics directory: the model's name, the compat mode and
        the pid of every child (and of this launcher), for /metrics' labels and
        process_* series; rewritten whenever a child is restarted."""
        procs = [ProcessEntry(os.getpid(), "launcher", 0)] + [
            ProcessEntry(c.proc.pid, c.config.role, c.config.index) for c in self.children]
        write_node_info(self.metrics_dir, NodeMetricsInfo(
            model_name=self.topology.model.name(), node=self.node.name,
            compat=self.topology.http.metrics_compat, processes=procs))

    def publish(self, force: bool = False) -> None:
        now = time.monotonic()
        if not force and now - self.last_publish < STATUS_INTERVAL_S:
            return
        self.last_publish = now
        self.pub.send(NodeStatus(self.node.name, time.time(), self.state,
                                 [c.status() for c in self.children], self.problem,
                                 dict(self.lost_replicas)))
        for c in self.children:
            self.up.labels(self.node.name, c.config.role, str(c.config.index)).set(
                1 if c.proc.poll() is None else 0)

    def local_problems(self) -> list[str]:
        out = [f"{c.name} is not running (exit code {c.proc.returncode})"
               for c in self.children if c.proc.poll() is not None
               and c.replica not in self.lost_replicas]
        if self.state in ("failed", "draining"):
            out.append(f"node {self.node.name} is {self.state}")
        return out

    def _wait(self, seconds: float, until=lambda: False) -> None:
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline and not until():
            self.publish()
            time.sleep(0.05)

    def _restart(self, child: Child) -> None:
        code = child.proc.returncode
        _say(f"{child.name} exited with code {code}; restarting it "
             f"(restart {child.restarts + 1} of {self.sup.max_restarts})")
        self.publish(force=True)  # the frontends see it dead before it comes back
        process_exited(self.metrics_dir, child.proc.pid)
        child.last_exit = code
        child.restarts += 1
        child.proc = _spawn(child.config, self.node.devices, self.api_keys, self.gpu_workers)
        self.write_metrics_info()
        self.restarts.labels(self.node.name, child.config.role).inc()
        self.publish(force=True)

    def _lose_replicas(self, fatal: list[Child]) -> list[Child]:
        """With several engine replicas, a dead scheduler or rank takes only its replica
        out: the replica's other processes are stopped, the frontends told (NodeStatus),
        and the rest serve on. Returns the deaths that still stop the topology (any
        shared role, or the last replica)."""
        replicas = self.topology.replicas
        if replicas == 1:
            return fatal
        hit = sorted({c.replica for c in fatal if c.replica is not None})
        if not hit or len(set(hit) | set(self.lost_replicas)) >= replicas:
            return fatal
        for r in hit:
            why = "; ".join(f"{c.name} exited with code {c.proc.returncode}"
                            for c in fatal if c.replica == r)
            _say(f"engine replica {r} lost ({why}); stopping its other processes, the "
                 f"other {replicas - len(self.lost_replicas) - 1} replica(s) serve on")
            self.lost_replicas[r] = why
            self.publish(force=True)
            _stop([c for c in self.children if c.replica == r])
        self.publish(force=True)
        return [c for c in fatal if c.replica is None]

    def run(self, stop_requested) -> int:
        """Until a signal (drain, exit 0) or a fatal child death (exit 1)."""
        ranks = self.topology.tensor_parallel * self.topology.replicas
        if "gpu_worker" in self.node.roles and len(self.node.devices) > ranks:
            _say(f"node {self.node.name}: devices {self.node.devices} are listed for "
                 f"{ranks} gpu_worker rank(s); the extra ones stay idle")
        if self.node.metrics_port is not None:
            serve_node_http(self.node.host, self.node.metrics_port, self.metrics_dir,
                            self.local_problems)
        self.children = [Child(cfg, _spawn(cfg, self.node.devices, self.api_keys,
                                           self.gpu_workers)) for cfg in self.configs]
        self.write_metrics_info()
        _say(f"node {self.node.name}: started {len(self.children)} processes: "
             + ", ".join(c.name for c in self.children))
        serves_http = "api_frontend" in self.node.roles
        next_ready_check = 0.0
        exit_code = 0
        while not stop_requested():
            dead = [c for c in self.children if c.proc.poll() is not None
                    and c.replica not in self.lost_replicas]
            fatal = self._lose_replicas(
                [c for c in dead if not (c.config.role in self.sup.restart
                                         and c.restarts < self.sup.max_restarts)])
            dead = [c for c in dead if c.replica not in self.lost_replicas]
            if fatal:
                self.state = "failed"
                self.problem = "; ".join(f"{c.name} on node {self.node.name} exited with "
                                         f"code {c.proc.returncode}" for c in fatal)
                for c in fatal:
                    _say(f"{c.name} exited with code {c.proc.returncode}; stopping the "
                         "topology")
                self.publish(force=True)
                self._wait(self.sup.teardown_delay_s)
                exit_code = 1
                break
            for c in dead:
                self._restart(c)
            if self.state == "starting" and time.monotonic() >= next_ready_check:
                next_ready_check = time.monotonic() + 0.5
                if not serves_http:
                    self.state = "running"
                elif _check_healthy(self.topology.http):
                    self.state = "running"
                    _say(f"ready on http://{self.topology.http.host}:"
                         f"{self.topology.http.port} serving {self.topology.model.name()!r}")
            self.publish()
            time.sleep(0.05)
        else:
            self._drain()
        self._shutdown()
        return exit_code

    def _drain(self) -> None:
        """SIGTERM: frontends refuse new work and finish what they hold, then the rest."""
        self.state = "draining"
        self.publish(force=True)
        frontends = [c for c in self.children if c.config.role == "api_frontend"]
        for c in frontends:
            if c.proc.poll() is None:
                c.proc.send_signal(signal.SIGTERM)
        if frontends:
            _say(f"draining: waiting up to {self.sup.drain_timeout_s:g}s for in-flight "
                 "requests")
        self._wait(self.sup.drain_timeout_s + GRACE_S,
                   until=lambda: all(c.proc.poll() is not None for c in frontends))

    def _shutdown(self) -> None:
        _stop(self.children)
        self.publish(force=True)
        self.pub.close()
        self.ctx.destroy(linger=0)


def _check_chat_template(topology: Topology) -> None:
    """A broken --chat-template fails here, in one line, before any process starts."""
    from tokenization.chat_template import ChatTemplateError
    from tokenization.template_source import load_server_template
    try:
        load_server_template(topology.api.chat_template, topology.api.limits.max_template_bytes)
    except ChatTemplateError as err:
        raise SystemExit("candor: " + " ".join(str(err).split())) from None


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's live process
        return True
    return True


def clean_stale_run_dirs(parent: str | None = None) -> list[str]:
    """Remove run directories whose launcher is gone (killed with -9, or a crash): each
    holds its launcher's pid. A directory without a pid file is left alone (it may be a
    launcher between mkdtemp and writing it, or not ours)."""
    removed = []
    for path in glob.glob(os.path.join(parent or tempfile.gettempdir(),
                                       RUN_DIR_PREFIX + "*")):
        try:
            with open(os.path.join(path, PID_FILE)) as fh:
                pid = int(fh.read().strip())
            if os.stat(path).st_uid != os.getuid():
                continue
        except (OSError, ValueError):
            continue
        if not _pid_alive(pid):
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
    return removed


def _make_run_dir() -> str:
    run_dir = tempfile.mkdtemp(prefix=RUN_DIR_PREFIX)
    partial = os.path.join(run_dir, PID_FILE + ".partial")
    with open(partial, "w") as fh:
        fh.write(f"{os.getpid()}\n")
    os.replace(partial, os.path.join(run_dir, PID_FILE))  # never read half-written
    return run_dir


def check_port_free(http: HttpSpec) -> None:
    """Fail in one line when something already listens on the HTTP port.

    The frontends bind with SO_REUSEPORT so that they can share the port, and a second
    server doing the same would silently split the traffic with the first. This probe
    binds without SO_REUSEPORT, which any existing listener on the port refuses."""
    try:
        infos = socket.getaddrinfo(http.host or None, http.port, type=socket.SOCK_STREAM,
                                   flags=socket.AI_PASSIVE)
    except socket.gaierror as err:
        raise SystemExit(f"candor: cannot resolve http.host {http.host!r}: {err}") from None
    family, kind, proto, _, addr = infos[0]
    with socket.socket(family, kind, proto) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # TIME_WAIT is fine
        try:
            probe.bind(addr)
            probe.listen(1)
        except OSError as err:
            why = "is already in use" if err.errno == errno.EADDRINUSE else f"fails: {err}"
            raise SystemExit(f"candor: port {http.port} on {http.host} {why} (another "
                             "server listens there); choose another --port / http.port") \
                from None


def resolve_api_keys(topology: Topology, flag_keys: list[str]) -> list[str]:
    """Keys from flags, CANDOR_API_KEY / VLLM_API_KEY and ``http.api_key_file``."""
    from api_frontend.auth import collect_keys
    files = [topology.http.api_key_file] if topology.http.api_key_file else []
    try:
        return collect_keys(flag_keys, files, dict(os.environ))
    except OSError as err:
        raise SystemExit(f"candor: cannot read the API key file: {err}") from None


def check_model_config(topology: Topology) -> None:
    """Refuse a checkpoint the gpu_worker cannot serve exactly, in one line naming the
    field and value, before any process starts (the parser is torch-free)."""
    from gpu_worker.model_config import UnsupportedConfig, load_config

    path = topology.model.resolved_path()
    if not os.path.isfile(os.path.join(path, "config.json")):
        return  # another node holds the checkpoint; its launcher checks it
    from gpu_worker.tp_shard import shard_problems
    try:
        cfg = load_config(path)
    except UnsupportedConfig as err:
        raise SystemExit(f"candor: cannot serve {path}: {err}") from None
    problems = shard_problems(cfg, topology.tensor_parallel)
    if problems:
        raise SystemExit(f"candor: cannot split {path} over {topology.tensor_parallel} "
                         f"ranks: {'; '.join(problems)}")


def check_lora_adapters(topology: Topology) -> None:
    """Refuse a --lora-modules adapter the gpu_worker could not serve (not a PEFT LoRA
    directory, DoRA, other target modules, a rank past --max-lora-rank, shapes that do not
    fit the base model), in one line naming it, before any process starts (torch-free)."""
    lora = topology.model.lora
    path = topology.model.resolved_path()
    if not lora.enabled or not lora.modules or not os.path.isfile(os.path.join(path, "config.json")):
        return
    from gpu_worker.lora.peft_files import AdapterError, read_adapter
    from gpu_worker.model_config import load_config

    base = load_config(path)
    for module in lora.modules:
        try:
            read_adapter(module.resolved_path(), base, lora.max_lora_rank)
        except AdapterError as err:
            raise SystemExit(f"candor: cannot serve LoRA adapter {module.name!r}: "
                             + " ".join(str(err).split())) from None


def _usable_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def settle_defaults(topology: Topology, node: NodeSpec) -> Topology:
    """Fill what the operator left to the machine, saying what was chosen and why:
    the gpu_worker's threads (the cores left after this node's other processes; an
    operator's OMP_NUM_THREADS wins) and the sampling defaults of
    ``model.generation_config``. The device and the KV cache size are the gpu_worker's
    to settle (it sees the device and the memory left after loading); it logs them."""
    engine, api = topology.engine, topology.api
    if "gpu_worker" in node.roles and engine.worker_threads is None:
        cores = _usable_cores()
        if os.environ.get("OMP_NUM_THREADS", "").isdigit():
            threads = int(os.environ["OMP_NUM_THREADS"])
            why = "OMP_NUM_THREADS"
        else:
            others = sum(1 for c in process_configs(topology, "run-dir", node.name)
                         if c.role != "gpu_worker")
            threads = max(1, cores - others)
            why = (f"{cores} usable cores less {others} for this node's other processes; "
                   "--worker-threads to choose")
        engine = msgspec.structs.replace(engine, worker_threads=threads)
        _say(f"gpu_worker threads: {threads} ({why})")
    model_dir = topology.model.resolved_path()
    if not api.sampling_defaults.items() and os.path.isdir(model_dir):
        try:
            defaults = sampling_defaults(topology.model.generation_config, model_dir)
        except GenerationConfigError as err:
            raise SystemExit(f"candor: {err}") from None
        if defaults.items():
            _say("sampling defaults for requests that omit them, from "
                 f"{defaults.source}: " + ", ".join(f"{k}={v}" for k, v in
                                                    defaults.items().items()))
        api = msgspec.structs.replace(api, sampling_defaults=defaults)
    return msgspec.structs.replace(topology, engine=engine, api=api)


def launch(topology: Topology, node: str | None = None,
           api_keys: list[str] | None = None) -> int:
    """Run this node's part of the topology until a signal (exit 0, after draining) or a
    child's fatal death (exit 1, naming it)."""
    try:
        check_topology(topology, node)
    except TopologyError as err:
        raise SystemExit("candor: invalid topology:\n  " + "\n  ".join(err.problems)) from None
    check_model_config(topology)
    nodes = topology.effective_nodes()
    if node is None:
        if len(nodes) > 1:
            raise SystemExit(f"candor: this topology has nodes {[n.name for n in nodes]}; "
                             "start each with --node NAME on its machine")
        node = nodes[0].name
    spec = next(n for n in nodes if n.name == node)
    if "gpu_worker" in spec.roles:  # the adapters' files are read where the ranks run
        check_lora_adapters(topology)
    if topology.api.chat_template is not None and "tokenizer_worker" in spec.roles:
        _check_chat_template(topology)  # a refusal stays one line: check before settling
    topology = settle_defaults(topology, spec)
    topology = resolve_tool_parser(topology)
    for path in clean_stale_run_dirs():
        _say(f"removed {path}: its launcher is gone")
    keys = resolve_api_keys(topology, api_keys or [])
    if "api_frontend" in spec.roles:
        check_port_free(topology.http)
    run_dir = _make_run_dir()
    stop_requested = False

    def on_signal(signum, frame):  # noqa: ARG001 - signal handler signature
        nonlocal stop_requested
        stop_requested = True

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    supervisor = None
    try:
        supervisor = NodeSupervisor(topology, spec, run_dir, keys)
        return supervisor.run(lambda: stop_requested)
    finally:
        if supervisor is not None and supervisor.children:
            _stop(supervisor.children)  # idempotent; covers an exception in run()
        shutil.rmtree(run_dir, ignore_errors=True)


# ---------------------------------------------------------------- command line


def cli(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="candor", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)

    sub.add_parser("serve", add_help=False, help="serve a checkpoint directory or a cached "
                   "Hugging Face repo id (vLLM's flags; see candor serve --help)")

    keygen = sub.add_parser("keygen", help="write CURVE keys for the tcp:// sockets "
                            "(security.curve.key_dir)")
    keygen.add_argument("dir")

    tiny = sub.add_parser("make-tiny-model", help="build the deterministic tiny checkpoint")
    tiny.add_argument("dir", nargs="?", default=DEFAULT_MODEL_DIR)
    tiny.add_argument("--if-missing", action="store_true",
                      help="do nothing when DIR already holds a checkpoint")

    launch_p = sub.add_parser("launch", help="start a topology YAML file")
    launch_p.add_argument("topology")
    launch_p.add_argument("--node", default=None)
    launch_p.add_argument("--check", action="store_true")

    sub.add_parser("bench", add_help=False,
                   help="load-test any OpenAI-compatible server (see candor bench --help)")

    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["bench"]:
        from bench.loadgen import main as bench_main
        return bench_main(argv[1:])
    if argv[:1] == ["serve"]:
        return serve(argv[1:])
    args = parser.parse_args(argv)
    if args.command == "keygen":
        write_curve_keys(args.dir)
        print(f"candor: CURVE keys written to {args.dir} (server.key, server.key_secret, "
              "client.key, client.key_secret); name it in security.curve.key_dir")
        return 0
    if args.command == "make-tiny-model":
        if args.if_missing and os.path.isfile(os.path.join(args.dir, "config.json")):
            print(f"candor: tiny model already present in {args.dir}")
            return 0
        from gpu_worker.tiny_model import build_tiny_model
        path = build_tiny_model(args.dir, overwrite=True)
        print(f"candor: tiny model written to {path}")
        return 0
    return main([args.topology] + (["--node", args.node] if args.node else [])
                + (["--check"] if args.check else []))


def serve_args_to_topology(argv: list[str],
                           environ: dict[str, str] | None = None) -> tuple[Topology, argparse.Namespace]:
    """``candor serve`` flags -> (validated topology, parsed flags); a bad flag, an absent
    model or a bad value exits 2 with one message."""
    parser = serve_parser()
    args = parser.parse_args(normalize_argv(argv))
    try:
        given = model_argument(args)
        resolved = resolve_model(given, args.revision, environ)
        if resolved.repo_id is not None:
            _say(f"{given}: the Hugging Face cache snapshot {resolved.revision} at "
                 f"{resolved.path}")
        default_name = given if resolved.repo_id else os.path.basename(
            resolved.path.rstrip("/"))
        return serve_topology(args, resolved.path, default_name, environ), args
    except (ServeArgsError, ModelNotFound) as err:
        parser.error(str(err))
    except msgspec.ValidationError as err:
        parser.error(str(err))
    raise AssertionError("unreachable")


def serve(argv: list[str]) -> int:
    topology, args = serve_args_to_topology(argv)
    if args.log_level is not None:  # read by every child's setup_logging
        os.environ["CANDOR_LOG_LEVEL"] = args.log_level.upper()
    return launch(topology, api_keys=args.api_key)


def write_curve_keys(directory: str) -> None:
    """A server and a client key pair (zmq certificate files); secrets are 0600."""
    import zmq.auth
    os.makedirs(directory, mode=0o700, exist_ok=True)
    for name in ("server", "client"):
        _, secret_file = zmq.auth.create_certificates(directory, name)
        os.chmod(secret_file, 0o600)


def main(argv: list[str] | None = None) -> int:
    """``python launch_cluster.py TOPOLOGY.yaml [--node NAME]``"""
    parser = argparse.ArgumentParser(description="start a Candor topology from YAML")
    parser.add_argument("topology")
    parser.add_argument("--node", default=None,
                        help="start only this node's roles (required when the topology "
                             "has several nodes; the same file is used on every machine)")
    parser.add_argument("--check", action="store_true",
                        help="validate the topology (every node) and exit")
    args = parser.parse_args(argv)
    try:
        topology = load_topology(args.topology)
    except (msgspec.ValidationError, msgspec.DecodeError) as err:
        print(f"candor: invalid topology {args.topology}: {err}", file=sys.stderr)
        return 2
    if args.check:
        try:
            check_topology(topology, args.node)
        except TopologyError as err:
            print(f"candor: invalid topology {args.topology}:\n  "
                  + "\n  ".join(err.problems), file=sys.stderr)
            return 2
        print(f"candor: {args.topology} is valid: nodes "
              f"{[n.name for n in topology.effective_nodes()]}", file=sys.stderr)
        return 0
    try:
        return launch(topology, args.node)
    except SystemExit as exc:
        if isinstance(exc.code, str):
            print(exc.code, file=sys.stderr)
            return 2
        raise


if __name__ == "__main__":
    _SUBCOMMANDS = {"serve", "make-tiny-model", "keygen", "launch", "bench", "-h",
                    "--help"}
    sys.exit(cli() if sys.argv[1:2] and sys.argv[1] in _SUBCOMMANDS else main())
