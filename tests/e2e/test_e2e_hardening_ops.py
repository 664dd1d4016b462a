"""Internal sockets, API keys and process lifecycle, tried the way an attacker or an
operator would: over the real processes, sockets and signals."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

import msgspec
import pytest
import zmq

from protocol import ipc
from tests.support.metrics_text import scrape
from tests.support.polling import wait_until
from tests.support.server import REPO, CandorServer, free_port, pid_alive

MODEL = "tiny-ops"
KEYS = {"flag": "sk-flag-key", "file": "sk-file-key", "env": "sk-env-key"}


def _request(base: str, path: str, body: dict | None = None, key: str | None = None,
             timeout: float = 20) -> tuple[int, dict, dict]:
    headers = {"Content-Type": "application/json"}
    if key is not None:
        headers["Authorization"] = f"Bearer {key}"
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(base + path, data=data, headers=headers,
                                 method="GET" if body is None else "POST")
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return resp.status, dict(resp.headers), json.loads(resp.read() or b"{}")
    except urllib.error.HTTPError as err:
        raw = err.read()
        return err.code, dict(err.headers), json.loads(raw) if raw else {}


def _configs(srv: CandorServer) -> dict[str, dict]:
    """role[index] -> the ProcessConfig JSON each child got on its command line."""
    out = {}
    for pid in srv.children():
        args = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        cfg = json.loads(args[3])
        out[f"{cfg['role']}[{cfg['index']}]"] = cfg
    return out


def _wait_exit(proc: subprocess.Popen, timeout: float) -> int | None:
    try:
        return proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        return None


def _complete(srv: CandorServer, key: str | None = None, max_tokens: int = 4,
              timeout: float = 20) -> tuple[int, dict]:
    status, _, body = _request(srv.base_url, "/v1/completions",
                               {"model": MODEL, "prompt": "hello", "max_tokens": max_tokens},
                               key=key, timeout=timeout)
    return status, body


@pytest.fixture(scope="module")
def key_file(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("keys") / "api-keys.txt"
    path.write_text(f"# one key a line\n\n{KEYS['file']}\n")
    return path


@pytest.fixture(scope="module")
def srv(tiny_model_dir, key_file, tmp_path_factory):
    log = tmp_path_factory.mktemp("logs") / "ops-server.log"
    server = CandorServer(tiny_model_dir, "--served-model-name", MODEL, "--max-model-len",
                          "1024", "--api-key", KEYS["flag"], "--api-key-file", str(key_file),
                          "--keepalive-timeout-s", "1", "--body-read-timeout-s", "1",
                          env={"CANDOR_API_KEY": KEYS["env"]})
    server.start(log_path=log)
    server.log = log
    yield server
    assert server.stop() == 0


# ------------------------------------------------------------------ malformed messages


def _garbage_frames() -> list[bytes]:
    enc = msgspec.msgpack.encode
    return [b"\x00\xffnot msgpack at all", enc([1, 2, 3]), enc({"msg": "no-such-type"}),
            enc({"msg": "tokenized", "rid": 7, "reply_to": None}),  # wrong field types
            enc({"msg": "deltas", "items": "oops"}), enc({"msg": "abort"}), b""]


def _push(address: str, frames: list[bytes]) -> None:
    ctx = zmq.Context()
    sock = ctx.socket(zmq.PUSH)
    sock.setsockopt(zmq.LINGER, 2000)
    sock.connect(address)
    for frame in frames:
        sock.send(frame)
    sock.close()  # lingers until delivered
    ctx.term()


def test_malformed_messages_are_dropped_and_serving_continues(srv):
    addresses = _configs(srv)["api_frontend[0]"]["addresses"]
    assert _complete(srv, KEYS["flag"])[0] == 200
    _push(addresses["frontend_results"][0], _garbage_frames())
    status, body = _complete(srv, KEYS["flag"], timeout=15)  # hung for ever before
    assert status == 200, body
    _push(addresses["scheduler_in"], _garbage_frames())
    for _ in range(3):
        status, body = _complete(srv, KEYS["flag"], timeout=15)
        assert status == 200, body
    assert srv.health()[0] == 200
    assert srv.proc.poll() is None
    log = srv.log.read_text()
    assert "scheduler[0] WARNING dropped" in log and "undecodable" in log
    assert "api_frontend[0] WARNING dropped" in log
    metrics = scrape(srv)  # ... and counted per role, for an alert
    for role in ("api_frontend", "scheduler"):
        assert metrics.value("candor_ipc_dropped_messages_total", role=role) == \
            len(_garbage_frames()), role


def test_a_dead_reader_task_ends_the_frontend_process():
    """The supervision hook itself: a reader task that fails exits non-zero."""
    code = ("import asyncio\n"
            "from api_frontend.engine_client import _exit_if_reader_died\n"
            "async def reader():\n"
            "    raise RuntimeError('socket gone')\n"
            "async def main():\n"
            "    t = asyncio.create_task(reader())\n"
            "    t.add_done_callback(_exit_if_reader_died)\n"
            "    await asyncio.sleep(5)\n"
            "asyncio.run(main())\n")
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True,
                          text=True, timeout=30)
    assert proc.returncode == 70
    assert "reader task" in proc.stderr and "socket gone" in proc.stderr


# ------------------------------------------------------------------ API keys

PROTECTED = [("POST", "/v1/completions"), ("POST", "/v1/chat/completions"),
             ("POST", "/v1/completions/render"), ("POST", "/v1/chat/completions/render"),
             ("POST", "/tokenize"), ("POST", "/detokenize"), ("GET", "/v1/models"),
             ("GET", f"/v1/models/{MODEL}"), ("GET", "/v1/capabilities"),
             ("GET", "/health/generate"), ("POST", "/v1/embeddings"),
             ("GET", "/tokenizer_info")]


@pytest.mark.parametrize("method,path", PROTECTED)
def test_protected_routes_need_a_key(srv, method, path):
    body = {"model": MODEL, "prompt": "x"} if method == "POST" else None
    for key in (None, "wrong", KEYS["flag"] + "x", ""):
        status, headers, payload = _request(srv.base_url, path, body, key=key)
        assert status == 401, (path, key, payload)
        assert payload["error"]["type"] == "authentication_error"
        assert payload["error"]["code"] == "invalid_api_key"
        assert headers["WWW-Authenticate"].startswith("Bearer")


def test_every_configured_key_works(srv):
    for source, key in KEYS.items():
        status, _, body = _request(srv.base_url, "/v1/models", key=key)
        assert status == 200, (source, body)
    assert _complete(srv, KEYS["file"])[0] == 200
    assert _request(srv.base_url, "/health/generate", key=KEYS["env"])[0] == 200


def test_ops_routes_stay_open_and_leak_nothing(srv):
    for path in ("/health", "/metrics", "/version"):
        assert srv.get(path)[0] == 200, path
    version = json.loads(srv.get("/version")[1])
    assert "pid" not in version
    models = _request(srv.base_url, "/v1/models", key=KEYS["flag"])[2]
    assert models["data"][0]["root"] == MODEL  # not the checkpoint's filesystem path
    caps = json.dumps(_request(srv.base_url, "/v1/capabilities", key=KEYS["flag"])[2])
    cmdlines = b" ".join(Path(f"/proc/{pid}/cmdline").read_bytes()
                         for pid in srv.children())
    for key in KEYS.values():
        assert key not in caps
        assert key.encode() not in cmdlines


def test_protect_ops_and_key_parsing():
    from api_frontend.auth import ApiKeys, collect_keys

    keys = collect_keys(["a, b", "c"], [], {"VLLM_API_KEY": "d", "CANDOR_API_KEY": "e,a"})
    assert keys == ["a", "b", "c", "e", "d"]
    open_ops, closed_ops = ApiKeys(keys, False), ApiKeys(keys, True)
    assert not open_ops.needs_key("/health") and closed_ops.needs_key("/health")
    assert open_ops.needs_key("/v1/models") and closed_ops.needs_key("/metrics")
    assert open_ops.accepts("Bearer d") and open_ops.accepts("bearer  e")
    assert not open_ops.accepts("Bearer ") and not open_ops.accepts("Basic a")
    assert not ApiKeys([], True).needs_key("/v1/models")


# ------------------------------------------------------------------ slow clients


def test_half_sent_request_line_is_closed(srv):
    with socket.create_connection(("127.0.0.1", srv.port), timeout=10) as s:
        s.sendall(b"POST /v1/completions HT")
        started = time.monotonic()
        try:
            data = s.recv(4096)  # b"" when the server closes the connection
        except TimeoutError:
            data = None
        assert data == b"", "the server kept a half-sent request open"
        assert time.monotonic() - started < 5


def test_trickled_body_times_out_with_408(srv):
    with socket.create_connection(("127.0.0.1", srv.port), timeout=10) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: "
                  b"application/json\r\nContent-Length: 100\r\nAuthorization: Bearer "
                  + KEYS["flag"].encode() + b"\r\n\r\n{\"model\":")
        started = time.monotonic()
        reply = b""
        while b"\r\n\r\n" not in reply or not reply.rstrip().endswith(b"}"):
            chunk = s.recv(4096)
            if not chunk:
                break
            reply += chunk
        assert time.monotonic() - started < 5
    head, _, body = reply.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 408"), reply
    assert json.loads(body)["error"]["code"] == "request_timeout"


# ------------------------------------------------------------------ ports and run dirs


def test_busy_port_fails_naming_it_and_cleans_a_killed_launchers_run_dir(srv,
                                                                         tiny_model_dir):
    # a launcher killed with -9 leaves its run directory (its children follow it)
    victim = CandorServer(tiny_model_dir, "--served-model-name", MODEL).start()
    run_dir = os.path.dirname(
        _configs(victim)["scheduler[0]"]["addresses"]["scheduler_in"][len("ipc://"):])
    children = victim.children()
    victim.proc.kill()
    victim.proc.wait()
    wait_until(lambda: not any(pid_alive(p) for p in children),
               "the killed launcher's children to exit", timeout=15, interval=0.1)
    assert os.path.isdir(run_dir)
    # a second server on a busy port: fails in one line naming the port, and cleans up
    second = CandorServer(tiny_model_dir, "--served-model-name", MODEL, port=srv.port)
    second.proc = subprocess.Popen(second.cmd, env=second.env, cwd=REPO,
                                   stderr=subprocess.PIPE, text=True)
    code = _wait_exit(second.proc, 60)
    if code is None:
        second.stop()
    assert code not in (None, 0), "a second server started on a busy port"
    err = second.proc.stderr.read()
    second.proc.stderr.close()
    assert f"port {srv.port}" in err and "in use" in err, err
    assert not os.path.exists(run_dir), "the killed launcher's run dir is still there"
    assert _complete(srv, KEYS["flag"])[0] == 200  # the first keeps serving


def test_run_dir_holds_the_launcher_pid(srv):
    cfg = _configs(srv)["scheduler[0]"]
    run_dir = os.path.dirname(cfg["addresses"]["scheduler_in"][len("ipc://"):])
    assert Path(run_dir, "launcher.pid").read_text().strip() == str(srv.proc.pid)


# ------------------------------------------------------------------ drain and Ctrl-C


def _stream_lines(srv: CandorServer, max_tokens: int, timeout: float = 60):
    body = json.dumps({"model": MODEL, "prompt": "a long story", "max_tokens": max_tokens,
                       "ignore_eos": True, "stream": True}).encode()
    req = urllib.request.Request(srv.base_url + "/v1/completions", data=body,
                                 headers={"Content-Type": "application/json"})
    return urllib.request.urlopen(req, timeout=timeout)


def _read_frames(resp, after_first) -> list[str]:
    frames = []
    for raw in resp:
        line = raw.decode().strip()
        if not line:
            continue
        frames.append(line)
        if len(frames) == 3:
            after_first()
    return frames


class _GroupServer(CandorServer):
    """A launcher in its own session, so a signal to its process group is a Ctrl-C in
    its terminal (and does not reach the test runner)."""

    def spawn(self, log_path=None):
        log = open(log_path, "w") if log_path else None  # noqa: SIM115 - lives with proc
        self.proc = subprocess.Popen(self.cmd, env=self.env, cwd=REPO, stderr=log,
                                     start_new_session=True)
        return self


def test_stream_cut_at_the_drain_limit_ends_with_error_frame_and_done(tiny_model_dir):
    server = CandorServer(tiny_model_dir, "--served-model-name", MODEL, "--max-model-len",
                          "1024", "--drain-timeout-s", "0.3").start()
    try:
        with _stream_lines(server, 1000) as resp:
            frames = _read_frames(resp, lambda: server.proc.send_signal(signal.SIGTERM))
    finally:
        code = server.stop()
    assert code == 0
    assert frames[-1] == "data: [DONE]", frames[-3:]
    error = json.loads(frames[-2][len("data: "):])["error"]
    assert error["code"] == "server_shutdown" and error["type"], error
    assert "drain limit" in error["message"]


def test_ctrl_c_to_the_process_group_drains_the_stream(tiny_model_dir, tmp_path):
    server = _GroupServer(tiny_model_dir, "--served-model-name", MODEL, "--max-model-len",
                          "1024").start(log_path=tmp_path / "launcher.log")
    try:
        with _stream_lines(server, 500) as resp:
            frames = _read_frames(resp, lambda: os.killpg(server.proc.pid, signal.SIGINT))
        code = _wait_exit(server.proc, 60)
    finally:
        server.stop()
    assert frames[-1] == "data: [DONE]"
    last = json.loads(frames[-2][len("data: "):])
    assert "error" not in last, last
    assert last["choices"][0]["finish_reason"] == "length"
    assert code == 0, (tmp_path / "launcher.log").read_text()[-2000:]


# ------------------------------------------------------------------ CURVE across nodes


def _two_node_yaml(model_dir, key_dir: Path, http_port: int) -> str:
    p = [free_port() for _ in range(6)]
    return f"""
model: {{path: {model_dir}, served_model_name: {MODEL}, max_model_len: 1024}}
http: {{host: 127.0.0.1, port: {http_port}}}
security: {{curve: {{key_dir: {key_dir}}}}}
nodes:
  - {{name: gateway, host: 127.0.0.1, roles: [api_frontend, tokenizer_worker, detokenizer],
      status_address: "tcp://{{host}}:{p[0]}"}}
  - {{name: engine, host: 127.0.0.1, roles: [scheduler, gpu_worker],
      status_address: "tcp://{{host}}:{p[1]}"}}
addresses:
  scheduler_in: "tcp://{{host}}:{p[2]}"
  scheduler_pub: "tcp://{{host}}:{p[3]}"
  detokenizer_in: "tcp://{{host}}:{p[4]}"
  frontend_results: "tcp://{{host}}:{p[5]}"
"""


def _inject(scheduler_in: str, reply_dir: str, keys: Path | None) -> bool:
    """Push one well-formed request to the scheduler; True when its tokens come back."""
    from protocol.security import CurveSpec, SecuritySpec
    from protocol.transport import Receiver, Sender, sync_context

    security = SecuritySpec(curve=CurveSpec(key_dir=str(keys))) if keys else None
    ctx = sync_context(security)
    reply_to = f"ipc://{reply_dir}/injected"
    replies: Receiver = Receiver(ctx, reply_to, ipc.FrontendInbound)
    sender = Sender(ctx, scheduler_in)
    try:
        sender.send(ipc.TokenizedReq(
            rid="injected-1", reply_to=reply_to, prompt_token_ids=[1, 2, 3], max_tokens=2,
            sampling=ipc.SamplingParams(temperature=0.0), detok=ipc.DetokParams()))
        return replies.recv(timeout_ms=5000) is not None
    finally:
        ctx.destroy(linger=0)


def test_curve_two_node_topology_serves_and_refuses_plain_clients(tiny_model_dir,
                                                                   tmp_path):
    keys = tmp_path / "keys"
    gen = subprocess.run([sys.executable, str(REPO / "launch_cluster.py"), "keygen",
                          str(keys)], capture_output=True, text=True, timeout=60)
    assert gen.returncode == 0, gen.stderr
    assert oct(os.stat(keys / "server.key_secret").st_mode & 0o777) == "0o600"
    port = free_port()
    topo = tmp_path / "two-node.yaml"
    topo.write_text(_two_node_yaml(tiny_model_dir, keys, port))
    engine = CandorServer.from_topology(topo, port, node="engine").spawn(
        tmp_path / "engine.log")
    gateway = CandorServer.from_topology(topo, port, node="gateway")
    try:
        gateway.start(log_path=tmp_path / "gateway.log")
        assert _complete(gateway)[0] == 200
        scheduler_in = json.loads(
            Path(f"/proc/{engine.children()[0]}/cmdline").read_bytes().split(b"\0")[3]
        )["addresses"]["scheduler_in"]
        with tempfile.TemporaryDirectory(prefix="inject-") as reply_dir:
            assert not _inject(scheduler_in, reply_dir, None), \
                "a plain client got work into the CURVE scheduler socket"
            assert _inject(scheduler_in, reply_dir, keys)  # the same, with the keys
        assert _complete(gateway)[0] == 200
    finally:
        assert gateway.stop() == 0
        engine.stop()


def test_shipped_multi_node_deployments_use_curve():
    import yaml

    from cluster.topology import Topology, load_topology

    deploy = REPO / "deploy"
    two_node = load_topology(str(deploy / "topologies" / "two-node.yaml"))
    assert two_node.security.curve is not None
    docs = list(yaml.safe_load_all((deploy / "kubernetes" / "candor.yaml").read_text()))
    config = next(d for d in docs if d["kind"] == "ConfigMap")
    topology = msgspec.yaml.decode(config["data"]["topology.yaml"], type=Topology)
    key_dir = topology.security.curve.key_dir
    for sts in (d for d in docs if d["kind"] == "StatefulSet"):
        pod = sts["spec"]["template"]["spec"]
        (mount,) = [m for m in pod["containers"][0]["volumeMounts"]
                    if m["mountPath"] == key_dir]
        (volume,) = [v for v in pod["volumes"] if v["name"] == mount["name"]]
        assert volume["secret"]["secretName"] == "candor-zmq-keys"
