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

from protocol.health import STATUS_INTERVAL_S, ChildStatus, NodeStatus
from protocol.metrics import ENV as METRICS_ENV
from protocol.metrics import prepare_dir as prepare_metrics_dir
from protocol.metrics import process_exited
from protocol.node_http import serve_node_http
from protocol.topology import (HttpSpec, NodeSpec, ProcessConfig, Topology, load_topology,
                               process_configs)
from protocol.topology_check import TopologyError, check_topology
from protocol.transport import Sender, sync_context

GRACE_S = 10.0
DEFAULT_MODEL_DIR = os.path.expanduser(
    os.environ.get("CANDOR_MODEL_DIR", "~/.cache/candor/models/tiny-llama"))

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
        return f"{self.config.role}[{self.config.index}]"

    @property
    def replica(self) -> int | None:
        """The engine replica this process belongs to (None: shared by all)."""
        return self.config.replica if self.config.role in REPLICA_ROLES else None

    def status(self) -> ChildStatus:
        code = self.proc.poll()
        return ChildStatus(self.config.role, self.config.index, self.proc.pid, code is None,
                           code if code is not None else self.last_exit, self.restarts,
                           self.replica)


REPLICA_ROLES = ("scheduler", "gpu_worker")


RUN_DIR_PREFIX = "candor-"
PID_FILE = "launcher.pid"
# API keys reach the frontends only, in this variable (see api_frontend/auth.py)
KEYS_ENV = "CANDOR_API_KEYS"
_KEY_ENVS = (KEYS_ENV, "CANDOR_API_KEY", "VLLM_API_KEY")


def _spawn(cfg: ProcessConfig, devices: list[int], api_keys: list[str],
           gpu_workers: list[int] | None = None) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if k not in _KEY_ENVS}
    if cfg.role == "api_frontend" and api_keys:
        env[KEYS_ENV] = "\n".join(api_keys)
    if cfg.role != "gpu_worker":
        env.update(_LEAN_ENV)
    else:
        env = {**_WORKER_ENV, **env}
        if devices:  # one device per rank this node runs, when it lists enough
            here = gpu_workers if gpu_workers is not None else \
                list(range(cfg.tensor_parallel * cfg.replicas))
            mine = [devices[here.index(cfg.index)]] if len(devices) >= len(here) > 1 \
                else devices
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
        child.proc = _spawn(child.config, self.node.devices, self.api_keys, self.node.gpu_workers)
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
        self.children = [Child(cfg, _spawn(cfg, self.node.devices, self.api_keys, self.node.gpu_workers))
                         for cfg in self.configs]
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
    from tokenizer_worker.chat_template import ChatTemplateError
    from tokenizer_worker.template_source import load_server_template
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
    if topology.api.chat_template is not None and "tokenizer_worker" in spec.roles:
        _check_chat_template(topology)
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


def _serve_topology(args: argparse.Namespace) -> Topology:
    """The flags as a topology, validated by the same constraints as a YAML file."""
    return msgspec.convert({
        "tensor_parallel": args.tensor_parallel_size,
        "replicas": args.data_parallel_size,
        "router": {"policy": args.data_parallel_routing},
        "model": {"path": args.model, "served_model_name": args.served_model_name,
                  "max_model_len": args.max_model_len, "dtype": args.dtype,
                  "load_format": args.load_format},
        "roles": {"api_frontend": args.frontends, "tokenizer_worker": args.tokenizer_workers,
                  "detokenizer": args.detokenizers},
        "engine": {"num_kv_blocks": args.num_kv_blocks, "max_num_seqs": args.max_num_seqs,
                   "max_num_batched_tokens": args.max_num_batched_tokens,
                   "worker_threads": args.worker_threads,
                   "max_waiting_requests": args.max_waiting_requests,
                   "enable_prefix_caching": not args.no_prefix_caching,
                   "device": args.device, "enforce_eager": args.enforce_eager,
                   "fault_token_id": args.fault_token_id},
        "http": {"host": args.host, "port": args.port, "max_body_mb": args.max_body_mb,
                 "keepalive_timeout_s": args.keepalive_timeout_s,
                 "body_read_timeout_s": args.body_read_timeout_s,
                 "api_key_file": args.api_key_file, "protect_ops": args.protect_ops},
        # tokenizer workers hold no state: one that dies (or that its watchdog stops
        # because a request got stuck) comes back, and only its requests fail
        "supervision": {"drain_timeout_s": args.drain_timeout_s,
                        "restart": ["tokenizer_worker"]},
        "api": {"strict": args.strict, "max_tokens_policy": args.max_tokens_policy,
                "chat_template": args.chat_template,
                "allow_request_chat_template": args.allow_request_chat_template,
                "limits": {name: value for name, value in (
                    ("max_n", args.max_n), ("max_logprobs", args.max_logprobs),
                    ("max_prompts", args.max_prompts),
                    ("max_request_share", args.max_request_share)) if value is not None}},
    }, Topology)


def cli(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="candor", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)

    serve = sub.add_parser("serve", help="serve a HF checkpoint directory")
    serve.add_argument("--model", default=DEFAULT_MODEL_DIR)
    serve.add_argument("--served-model-name", default=None)
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=int, default=8000)
    serve.add_argument("--max-model-len", type=int, default=None)
    serve.add_argument("--dtype", default="auto",
                       choices=["auto", "half", "float16", "bfloat16", "float", "float32"],
                       help="auto: the checkpoint's dtype on CUDA, float32 on CPU")
    serve.add_argument("--load-format", default="auto", choices=["auto", "dummy"])
    serve.add_argument("--tensor-parallel-size", "-tp", type=int, default=1,
                       help="gpu_worker ranks sharing the model (torch.distributed: NCCL on "
                            "CUDA, gloo on CPU)")
    serve.add_argument("--data-parallel-size", "-dp", type=int, default=1,
                       help="engine replicas (a scheduler and its ranks each) behind the "
                            "same frontends and tokenizer workers")
    serve.add_argument("--data-parallel-routing", default="cache_aware",
                       choices=["cache_aware", "round_robin"],
                       help="cache_aware: same prompt prefix or cache_salt -> same replica "
                            "unless overloaded, else least loaded")
    serve.add_argument("--frontends", type=int, default=1)
    serve.add_argument("--tokenizer-workers", type=int, default=1)
    serve.add_argument("--detokenizers", type=int, default=1)
    serve.add_argument("--num-kv-blocks", type=int, default=None)
    serve.add_argument("--max-num-seqs", type=int, default=64)
    serve.add_argument("--max-num-batched-tokens", type=int, default=1024)
    serve.add_argument("--worker-threads", type=int, default=None)
    serve.add_argument("--max-waiting-requests", type=int, default=1024,
                       help="waiting-queue bound; past it requests get 503 (0: unbounded)")
    serve.add_argument("--no-prefix-caching", action="store_true")
    serve.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N for the gpu_worker")
    serve.add_argument("--enforce-eager", action="store_true",
                       help="no CUDA graphs for decode steps (they are used only on CUDA with flashinfer)")
    serve.add_argument("--max-body-mb", type=int, default=32)
    serve.add_argument("--fault-token-id", type=int, default=None, help=argparse.SUPPRESS)
    serve.add_argument("--strict", action="store_true",
                       help="every ignored or clamped request field is a 400 naming it")
    serve.add_argument("--max-tokens-policy", default="reject", choices=["reject", "clamp"],
                       help="prompt + max_tokens beyond the context: 400 (reject) or clamp")
    serve.add_argument("--chat-template", default=None, metavar="PATH_OR_TEMPLATE",
                       help="a Jinja chat template (a file, or the template itself) that "
                            "replaces the checkpoint's")
    serve.add_argument("--allow-request-chat-template", action="store_true",
                       help="accept a chat_template field in request bodies")
    serve.add_argument("--max-logprobs", type=int, default=None,
                       help="most logprobs / top_logprobs alternatives per token (default 20); "
                            "other request limits: the topology YAML's api.limits")
    serve.add_argument("--max-n", type=int, default=None, help="most choices per request")
    serve.add_argument("--max-prompts", type=int, default=None,
                       help="most prompts in one /v1/completions request")
    serve.add_argument("--max-request-share", type=float, default=None,
                       help="largest fraction of the waiting queue one request may fill")

    serve.add_argument("--api-key", action="append", default=[],
                       help="require 'Authorization: Bearer KEY' (repeat or comma-separate "
                            "for several; also CANDOR_API_KEY / VLLM_API_KEY)")
    serve.add_argument("--api-key-file", default=None, help="a file of API keys, one a line")
    serve.add_argument("--protect-ops", action="store_true",
                       help="/health, /metrics and /version need an API key too")
    serve.add_argument("--keepalive-timeout-s", type=float, default=75.0,
                       help="close idle connections (and ones that never finish their "
                            "request headers) after this long")
    serve.add_argument("--body-read-timeout-s", type=float, default=60.0,
                       help="a request body must arrive within this long (408)")
    serve.add_argument("--drain-timeout-s", type=float, default=30.0,
                       help="SIGTERM/Ctrl-C: how long in-flight requests may finish")

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
    if args.command == "launch":
        return main([args.topology] + (["--node", args.node] if args.node else [])
                    + (["--check"] if args.check else []))
    try:
        topology = _serve_topology(args)
    except msgspec.ValidationError as err:
        parser.error(str(err))
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
