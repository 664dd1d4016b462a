"""One node's share of a topology, supervised: the launcher's process owner.

``NodeSupervisor`` spawns one OS process per role instance of its node (each given its
``ProcessConfig`` as JSON), publishes their liveness (``NodeStatus``) for the frontends'
/health, restarts the roles the topology marks restartable, takes a lost engine replica
out while the others serve on, and on a fatal death or a signal stops everything in
order. It imports no role: children are ``python -m <role>``.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections import deque
from dataclasses import dataclass

import msgspec

import zmq

from cluster.metrics import ENV as METRICS_ENV
from cluster.metrics import prepare_dir as prepare_metrics_dir
from cluster.metrics import process_exited
from cluster.metrics_view import NodeMetricsInfo, ProcessEntry, write_node_info
from launcher.node_http import serve_node_http
from launcher.orphans import adopt_orphans, kill_orphans
from cluster.process_config import ProcessConfig, ReplicaConfig, process_configs
from cluster.topology import HttpSpec, NodeSpec, Topology
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


class RestartBudget:
    """When one process may come back: at most ``limit`` restarts within ``window_s``;
    the first in a window at once, each further one after twice the previous wait (1 s,
    2 s, 4 s ... up to ``backoff_max_s``). A crash loop is slowed, then stopped; a crash
    now and then never adds up, because restarts older than the window are forgotten."""

    FIRST_BACKOFF_S = 1.0

    def __init__(self, limit: int, window_s: float, backoff_max_s: float) -> None:
        self.limit, self.window_s, self.backoff_max_s = limit, window_s, backoff_max_s
        self._times: deque[float] = deque()

    def recent(self, now: float) -> int:
        """Restarts within the window that ends ``now``."""
        while self._times and now - self._times[0] >= self.window_s:
            self._times.popleft()
        return len(self._times)

    def delay(self, now: float) -> float | None:
        """Seconds to wait before the next restart, or None: the window's limit is spent."""
        n = self.recent(now)
        if n >= self.limit:
            return None
        return 0.0 if n == 0 else min(self.backoff_max_s, self.FIRST_BACKOFF_S * 2 ** (n - 1))

    def spend(self, now: float) -> None:
        self._times.append(now)


@dataclass
class Child:
    config: ProcessConfig
    proc: subprocess.Popen
    budget: RestartBudget | None = None  # None: the role is not restarted
    restarts: int = 0
    last_exit: int | None = None
    restart_at: float | None = None  # monotonic time of a restart waiting out its backoff

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


# API keys reach the frontends only, in this variable (see api_frontend/auth.py)
KEYS_ENV = "CANDOR_API_KEYS"
_KEY_ENVS = (KEYS_ENV, "CANDOR_API_KEY", "VLLM_API_KEY")


# where ``python -m <role>`` finds the packages: the checkout (or site-packages) root
_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


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
    env["PYTHONPATH"] = _ROOT + os.pathsep + env.get("PYTHONPATH", "")
    return subprocess.Popen([sys.executable, "-m", cfg.role, msgspec.json.encode(cfg).decode()],
                            env=env)


def say(message: str) -> None:
    print(f"candor: {message}", file=sys.stderr, flush=True)


def _check_healthy(http: HttpSpec) -> bool:
    host = "127.0.0.1" if http.host in ("0.0.0.0", "") else http.host
    try:
        with urllib.request.urlopen(f"http://{host}:{http.port}/health", timeout=1) as resp:
            return resp.status == 200
    except (urllib.error.URLError, OSError):
        return False


def stop(children: list[Child], tick=lambda: None) -> None:
    """SIGTERM, then SIGKILL past ``GRACE_S``; ``tick`` runs while waiting (a launcher
    that serves on keeps publishing its NodeStatus: a process can take seconds to exit)."""
    for child in children:
        if child.proc.poll() is None:
            child.proc.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + GRACE_S
    for child in children:
        while True:
            try:
                child.proc.wait(timeout=max(0.01, min(0.05, deadline - time.monotonic())))
                break
            except subprocess.TimeoutExpired:
                if time.monotonic() >= deadline:
                    child.proc.kill()
                    child.proc.wait()
                    break
                tick()


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
            list(range(topology.total_gpu_workers))
        index = [n.name for n in topology.effective_nodes()].index(node.name)
        self.status_address = self.configs[0].addresses.node_status[index] if self.configs \
            else None
        self.ctx = sync_context(topology.security)
        self.pub = Sender(self.ctx, self.status_address, bind=True, kind=zmq.PUB)
        self.children: list[Child] = []
        self.state = "starting"
        self.problem: str | None = None
        self.lost_replicas: dict[int, str] = {}  # replica -> why, while others serve on
        self.store_lost = False  # the shared KV store died: the replicas serve on (misses)
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
               and c.replica not in self.lost_replicas
               and c.config.role != "kv_store"]  # serving goes on without it
        if self.state in ("failed", "draining"):
            out.append(f"node {self.node.name} is {self.state}")
        return out

    def _wait(self, seconds: float, until=lambda: False) -> None:
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline and not until():
            self.publish()
            time.sleep(0.05)

    def _kill_orphans(self) -> None:
        """Stop what dead children left running (launcher/orphans.py), saying what."""
        killed = kill_orphans({c.proc.pid for c in self.children})
        if killed:
            say(f"stopped {len(killed)} process(es) that exited children left running "
                "(e.g. a kernel build)")

    def _spawn_children(self) -> None:
        sup = self.sup
        self.children = [
            Child(cfg, _spawn(cfg, self.node.devices, self.api_keys, self.gpu_workers),
                  RestartBudget(sup.max_restarts, sup.restart_window_s,
                                sup.restart_backoff_max_s)
                  if cfg.role in sup.restart else None)
            for cfg in self.configs]
        self.write_metrics_info()

    def _schedule_restart(self, child: Child, now: float) -> bool:
        """A restartable child just died: plan its restart after its backoff. False when
        its budget for the window is spent (the death is then fatal)."""
        budget = child.budget
        delay = budget.delay(now) if budget is not None else None
        if delay is None:
            return False
        code = child.proc.returncode
        child.last_exit = code
        child.restart_at = now + delay
        process_exited(self.metrics_dir, child.proc.pid)  # its live gauges drop out now
        when = "now" if delay == 0 else f"in {delay:g}s"
        say(f"{child.name} exited with code {code}; restarting it {when} (restart "
            f"{budget.recent(now) + 1} of {budget.limit} within {budget.window_s:g}s)")
        self.publish(force=True)  # the frontends see it dead before it comes back
        return True

    def _restart(self, child: Child, now: float) -> None:
        assert child.budget is not None
        child.budget.spend(now)
        child.restart_at = None
        child.restarts += 1
        self._kill_orphans()
        child.proc = _spawn(child.config, self.node.devices, self.api_keys, self.gpu_workers)
        self.write_metrics_info()
        self.restarts.labels(self.node.name, child.config.role).inc()
        self.publish(force=True)

    def _why_fatal(self, child: Child, where: str = "") -> str:
        why = f"{child.name}{where} exited with code {child.proc.returncode}"
        if child.budget is not None and child.budget.limit:
            why += (f" after it was restarted {child.budget.limit} times within "
                    f"{child.budget.window_s:g}s")
        return why

    def _lose_replicas(self, fatal: list[Child]) -> list[Child]:
        """With several engine replicas, a dead scheduler or rank takes only its replica
        out: the replica's other processes are stopped (their gauges leave the node's
        sums), the frontends told (NodeStatus), and the rest serve on. Returns the deaths
        that still stop the topology (any shared role, the last replica, or a process
        that exited with EX_CONFIG: it found the deployment misconfigured, e.g. prefill
        and decode replicas that cannot share KV, which losing a replica would hide)."""
        misconfigured = [c for c in fatal if c.proc.returncode == os.EX_CONFIG]
        if misconfigured:
            return fatal
        hit = sorted({c.replica for c in fatal if c.replica is not None})
        # a model left without any replica stops the topology (each model counts alone)
        groups = {self.topology.group_of_replica(r).index: self.topology.group_of_replica(r)
                  for r in hit}
        if not hit or any(set(g.replica_ids()) <= set(hit) | set(self.lost_replicas)
                          for g in groups.values()):
            return fatal
        replicas = self.topology.total_replicas
        for r in hit:
            why = "; ".join(f"{c.name} exited with code {c.proc.returncode}"
                            for c in fatal if c.replica == r)
            say(f"engine replica {r} lost ({why}); stopping its other processes, the "
                f"other {replicas - len(self.lost_replicas) - 1} replica(s) serve on")
            self.lost_replicas[r] = why
            self.publish(force=True)
            members = [c for c in self.children if c.replica == r]
            stop(members, tick=self.publish)  # the frontends must not hear silence
            self._kill_orphans()
            for c in members:
                process_exited(self.metrics_dir, c.proc.pid)
        self.publish(force=True)
        return [c for c in fatal if c.replica is None]

    def _lose_store(self, dead: list[Child]) -> list[Child]:
        """A dead KV store is never fatal: replicas treat it as misses (said once)."""
        store = [c for c in dead if c.config.role == "kv_store"]
        if store and not self.store_lost:
            self.store_lost = True
            say(f"kv_store exited with code {store[0].proc.returncode}; the replicas serve "
                "on without it (every lookup a miss)")
            process_exited(self.metrics_dir, store[0].proc.pid)
        return [c for c in dead if c.config.role != "kv_store"]

    def _tend(self) -> list[Child]:
        """One look at the children: restart those whose backoff is over, plan restarts
        for restartable deaths, take lost replicas out. Returns the fatal deaths. While
        draining, the frontends' exits are expected and not looked at."""
        now = time.monotonic()
        dead = [c for c in self.children if c.proc.poll() is not None
                and c.replica not in self.lost_replicas
                and not (self.state == "draining" and c.config.role == "api_frontend")]
        dead = self._lose_store(dead)
        fatal = self._lose_replicas(
            [c for c in dead if c.restart_at is None and not self._schedule_restart(c, now)])
        if not fatal:
            for c in dead:
                if c.restart_at is not None and now >= c.restart_at:
                    self._restart(c, now)
        return fatal

    def _fail(self, fatal: list[Child]) -> int:
        """A death the topology cannot survive: say so (the frontends fail every request
        they hold at once), keep the failed state visible a moment, exit 1."""
        self.state = "failed"
        self.problem = "; ".join(self._why_fatal(c, f" on node {self.node.name}")
                                 for c in fatal)
        for c in fatal:
            say(f"{self._why_fatal(c)}; stopping the topology")
        self.publish(force=True)
        self._wait(self.sup.teardown_delay_s)
        return 1

    def run(self, stop_requested) -> int:
        """Until a signal (drain, exit 0) or a fatal child death (exit 1, also when it
        happens during the drain)."""
        ranks = self.topology.total_gpu_workers
        if "gpu_worker" in self.node.roles and len(self.node.devices) > ranks:
            say(f"node {self.node.name}: devices {self.node.devices} are listed for "
                f"{ranks} gpu_worker rank(s); the extra ones stay idle")
        if self.node.metrics_port is not None:
            serve_node_http(self.node.host, self.node.metrics_port, self.metrics_dir,
                            self.local_problems)
        adopt_orphans()  # what a dead child leaves running becomes ours to stop
        self._spawn_children()
        say(f"node {self.node.name}: started {len(self.children)} processes: "
            + ", ".join(c.name for c in self.children))
        serves_http = "api_frontend" in self.node.roles
        next_ready_check = 0.0
        exit_code = 0
        while not stop_requested():
            fatal = self._tend()
            if fatal:
                exit_code = self._fail(fatal)
                break
            if self.state == "starting" and time.monotonic() >= next_ready_check:
                next_ready_check = time.monotonic() + 0.5
                if not serves_http:
                    self.state = "running"
                elif _check_healthy(http := self.topology.http_of(self.node)):
                    self.state = "running"
                    say(f"ready on http://{http.host}:{http.port} serving "
                        f"{self.topology.model.name()!r}")
            self.publish()
            time.sleep(0.05)
        else:
            exit_code = self._drain()
        self._shutdown()
        return exit_code

    def _drain(self) -> int:
        """SIGTERM: frontends refuse new work and finish what they hold, then the rest.
        The children are still tended meanwhile: an engine that dies during the drain
        fails the requests at once and the launcher exits 1."""
        self.state = "draining"
        self.publish(force=True)
        frontends = [c for c in self.children if c.config.role == "api_frontend"]
        for c in frontends:
            if c.proc.poll() is None:
                c.proc.send_signal(signal.SIGTERM)
        if frontends:
            say(f"draining: waiting up to {self.sup.drain_timeout_s:g}s for in-flight "
                "requests")
        deadline = time.monotonic() + self.sup.drain_timeout_s + GRACE_S
        while time.monotonic() < deadline \
                and not all(c.proc.poll() is not None for c in frontends):
            fatal = self._tend()
            if fatal:
                return self._fail(fatal)
            self.publish()
            time.sleep(0.05)
        return 0

    def _shutdown(self) -> None:
        stop(self.children)
        self._kill_orphans()
        self.publish(force=True)
        self.pub.close()
        self.ctx.destroy(linger=0)
