"""Start and stop a real Candor topology (the launcher and its child processes)."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path

from launcher.orphans import children_of as child_pids  # direct children, from /proc
from tests.support.polling import wait_until

REPO = Path(__file__).resolve().parents[2]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def pid_alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def role_of(pid: int) -> str:
    args = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    return json.loads(args[3])["role"] + f"[{json.loads(args[3])['index']}]"


class CandorServer:
    def __init__(self, model_dir: str | Path, *args: str, port: int | None = None,
                 env: dict[str, str] | None = None) -> None:
        self.port = port or free_port()
        self.cmd = [sys.executable, str(REPO / "launch_cluster.py"), "serve", "--model",
                    str(model_dir), "--port", str(self.port), *args]
        self.env = {**os.environ, **(env or {})}
        self.cwd = REPO
        self.proc: subprocess.Popen | None = None

    @classmethod
    def from_topology(cls, path: str | Path, port: int, node: str | None = None,
                      env: dict[str, str] | None = None) -> "CandorServer":
        """A launcher started from a YAML file (``--node`` for one node of several)."""
        srv = cls("unused", port=port, env=env)
        srv.cmd = [sys.executable, str(REPO / "launch_cluster.py"), str(path)]
        if node is not None:
            srv.cmd += ["--node", node]
        return srv

    def post_json(self, path: str, body: dict, timeout: float = 120) -> tuple[int, dict]:
        """(status, decoded body) of a JSON POST; an error status is returned, not raised."""
        req = urllib.request.Request(self.base_url + path, data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=timeout) as resp:
                return resp.status, json.loads(resp.read())
        except urllib.error.HTTPError as err:
            return err.code, json.loads(err.read() or b"{}")

    def spawn(self, log_path: str | Path | None = None) -> "CandorServer":
        """Start without waiting (a node that serves no HTTP)."""
        log = open(log_path, "w") if log_path else None  # noqa: SIM115 - lives with proc
        self.proc = subprocess.Popen(self.cmd, env=self.env, cwd=self.cwd, stderr=log)
        return self

    def get(self, path: str, timeout: float = 5) -> tuple[int, bytes]:
        try:
            with urllib.request.urlopen(self.base_url + path, timeout=timeout) as resp:
                return resp.status, resp.read()
        except urllib.error.HTTPError as err:
            return err.code, err.read()
        except (urllib.error.URLError, OSError):
            return 0, b""

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout: float = 180, log_path: str | Path | None = None) -> "CandorServer":
        self.spawn(log_path)

        def healthy() -> bool:
            if self.proc.poll() is not None:
                raise RuntimeError(f"launcher exited with {self.proc.returncode}")
            return self.health()[0] == 200

        try:
            wait_until(healthy, "the server's /health to answer 200", timeout=timeout,
                       interval=0.2)
        except AssertionError:
            self.stop()
            raise
        return self

    def health(self) -> tuple[int, dict]:
        try:
            with urllib.request.urlopen(self.base_url + "/health", timeout=2) as resp:
                return resp.status, json.loads(resp.read())
        except urllib.error.HTTPError as err:
            return err.code, json.loads(err.read() or b"{}")
        except (urllib.error.URLError, OSError):
            return 0, {}

    def engine_stats(self) -> dict:
        status, body = self.health()
        assert status == 200, body
        return body["engine"]

    def wait_all_blocks_free(self, timeout: float = 10, what: str = "the engine at rest",
                             until: Callable[[dict], bool] = lambda stats: True) -> dict:
        """Stats from a heartbeat sent at rest (every KV block free, nothing running,
        waiting or on the worker: KV accounting settles within a few steps) for which
        ``until`` holds; its cumulative counters include every request answered so far."""
        return wait_until(
            self.engine_stats, f"{what} (every KV block free, no request running, waiting "
            "or on the worker)",
            until=lambda s: (s["free_blocks"] == s["total_blocks"] and s["running"] == 0
                             and s["waiting"] == 0 and s["step_in_flight_s"] == 0 and until(s)),
            timeout=timeout, interval=0.1)

    def children(self) -> list[int]:
        assert self.proc is not None
        return child_pids(self.proc.pid)

    def stop(self, timeout: float = 30) -> int:
        if self.proc is None:
            return 0
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode
