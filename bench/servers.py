"""Servers under test: start one in its own process group, wait until it is healthy,
warm it up, stop it (the whole group)."""

from __future__ import annotations

import asyncio
import dataclasses
import os
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path

from bench import procstat
from launcher.loadgen import Workload, run

REPO = Path(__file__).resolve().parents[1]
WARMUP = Workload(num_requests=4, concurrency=4, prompt_len=(64, 64), output_len=(8, 8),
                  seed=99)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """``length_by``: how this server is asked for outputs of exact length (``ignore_eos``,
    or ``min_tokens`` where it has no ignore_eos; see ``launcher.loadgen``);
    ``health_path``: the GET that answers 200 once it serves."""

    def __init__(self, name: str, cmd: list[str], env: dict[str, str], port: int,
                 cwd: Path = REPO, log_dir: Path | None = None,
                 length_by: str = "ignore_eos", health_path: str = "/health") -> None:
        self.name, self.cmd, self.env, self.port, self.cwd = name, cmd, env, port, cwd
        self.length_by, self.health_path = length_by, health_path
        self.proc: subprocess.Popen | None = None
        # the roles its tree held once settled after warm-up; anything else in a round
        # (a compiler a kernel build started late) is flagged there
        self.own_roles: set[str] = set()
        log_dir = log_dir or Path(tempfile.mkdtemp(prefix=f"bench-{name}-"))
        self.log_path = log_dir / f"{name}.log"

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def command_line(self) -> str:
        """The command after the interpreter, its port shown as PORT."""
        return shlex.join(["PORT" if a == str(self.port) else a for a in self.cmd[1:]])

    @property
    def pid(self) -> int:
        """The group leader: every process of this server descends from it."""
        assert self.proc is not None
        return self.proc.pid

    def fit(self, workload: Workload) -> Workload:
        """``workload`` as this server is asked for it."""
        return dataclasses.replace(workload, length_by=self.length_by)

    def start(self) -> None:
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(self.cmd, env=self.env, cwd=self.cwd, stdout=log,
                                         stderr=subprocess.STDOUT, start_new_session=True)

    def log_tail(self, lines: int = 30) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""

    def wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited ({self.proc.returncode}); "
                                   f"{self.log_path}:\n{self.log_tail()}")
            try:
                with urllib.request.urlopen(self.url + self.health_path, timeout=2) as r:
                    if r.status == 200:
                        return
            except OSError:
                pass
            time.sleep(1)
        raise TimeoutError(f"{self.name} not healthy after {timeout}s; {self.log_path}:\n"
                           f"{self.log_tail()}")

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)  # the group this script started
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()


def candor_server(model: Path, served_name: str, threads: int | None = None,
                  kv_blocks: int | None = None, extra: list[str] = (), *,
                  name: str = "candor", repo: Path = REPO, python: str = sys.executable,
                  log_dir: Path | None = None) -> Server:
    """``candor serve`` from the checkout ``repo`` with ``python``: float32 and a 2048
    context like the peers; ``threads`` None leaves the worker's thread count to Candor;
    ``extra`` flags go last. PYTHONPATH is that checkout alone, so an inherited one
    cannot mix two commits."""
    port = free_port()
    cmd = [python, "launch_cluster.py", "serve", "--model", str(model),
           "--served-model-name", served_name, "--port", str(port), "--max-model-len",
           "2048", "--dtype", "float32"]
    if threads:
        cmd += ["--worker-threads", str(threads)]
    if kv_blocks:
        cmd += ["--num-kv-blocks", str(kv_blocks)]
    cmd += list(extra)
    env = {**os.environ, "PYTHONPATH": str(repo)}
    return Server(name, cmd, env, port, repo, log_dir)


def llamacpp_server(python: str, gguf: Path, served_name: str, threads: int,
                    context: int, log_dir: Path | None = None) -> Server:
    """llama-cpp-python's OpenAI server (``make bench-peers`` builds its venv) on a GGUF
    file: ``threads`` for decode and prompt alike, a ``context``-token context. It takes
    no token ids and has no ignore_eos: text prompts and ``min_tokens``. It runs one
    request at a time; by default a waiting request cuts the running one's stream short
    (``interrupt_requests``): off, so concurrent requests queue as on any server."""
    port = free_port()
    cmd = [python, "-m", "llama_cpp.server", "--model", str(gguf), "--model_alias", served_name,
           "--host", "127.0.0.1", "--port", str(port), "--n_threads", str(threads),
           "--n_threads_batch", str(threads), "--n_ctx", str(context),
           "--interrupt_requests", "False"]
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    return Server("llamacpp", cmd, env, port, log_dir=log_dir, length_by="min_tokens",
                  health_path="/v1/models")


def start_warm(servers: list[Server], model: str, timeout: float = 600,
               say: Callable[[str], None] = print, warmup: Workload = WARMUP) -> None:
    """Start every server, wait until each is healthy, warm each with ``warmup`` (four
    short requests), then wait until every server's processes are idle (first passes,
    kernel builds and compiles stay out of the counted rounds)."""
    for s in servers:
        s.start()
    for s in servers:
        s.wait_ready(timeout)
        out = asyncio.run(run(s.url, model, s.fit(warmup)))
        if out["errors"]:
            raise RuntimeError(f"{s.name} failed its warm-up: {out.get('first_error')}; "
                               f"{s.log_path}:\n{s.log_tail()}")
    for s in servers:
        waited, busy = wait_settled(s.pid, timeout)
        if busy:
            say(f"{s.name}: waited {waited:.0f}s after warm-up for background work in its "
                f"processes to end ({', '.join(busy)})")
        s.own_roles = set(procstat.cpu_by_role([s.pid]))


def wait_settled(root: int, timeout: float, window_s: float = 1.0,
                 max_cores: float = 0.2) -> tuple[float, list[str]]:
    """Wait until the process tree of ``root`` uses at most ``max_cores`` over a window
    with no request in flight: a server that is still building a kernel (Candor's CPU
    kernels compile on first use, in a thread or a child compiler) or compiling a graph
    would otherwise charge that work to the first rounds. Returns the seconds waited and
    the roles or names of the processes that used the most CPU meanwhile."""
    started = time.monotonic()
    busy: list[str] = []
    while True:
        before = {p.pid: p.cpu_s for p in procstat.tree(root, procstat.processes())}
        time.sleep(window_s)
        after = procstat.tree(root, procstat.processes())
        total = sum(p.cpu_s for p in after) - sum(before.values())
        if total <= max_cores * window_s or time.monotonic() - started > timeout:
            return time.monotonic() - started, busy
        used = sorted(after, key=lambda p: before.get(p.pid, 0.0) - p.cpu_s)
        for p in used[:3]:
            name = procstat.role_of(p.pid, p.name)
            if name not in busy and p.cpu_s > before.get(p.pid, 0.0):
                busy.append(name)
