"""Supervision through real launchers: a killed worker turns /health 503 within a second,
restartable roles come back (their lost requests fail cleanly), SIGTERM drains, several
frontends count each request once, and a two-node topology on loopback serves requests."""

from __future__ import annotations

import json
import os
import signal
import threading
import time
import urllib.request
from pathlib import Path

import pytest

from tests.support.metrics_text import Scrape, scrape
from tests.support.polling import wait_until
from tests.support.server import CandorServer, free_port, role_of

MODEL = "tiny-llama"


def _post(base_url: str, body: dict, timeout: float = 60) -> tuple[int, bytes]:
    req = urllib.request.Request(base_url + "/v1/completions", method="POST",
                                 data=json.dumps({"model": MODEL, **body}).encode(),
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return resp.status, resp.read()
    except urllib.error.HTTPError as err:
        return err.code, err.read()


def _write(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


def _first_503(srv: CandorServer, within: float) -> tuple[float, dict]:
    started = time.monotonic()
    _, body = wait_until(srv.health, "/health to answer 503", until=lambda h: h[0] == 503,
                         timeout=within, interval=0.02)
    return time.monotonic() - started, body


def _pid_of(srv: CandorServer, name: str) -> int:
    return next(p for p in srv.children() if role_of(p) == name)


def test_killed_workers_restart_or_stop_the_topology(tiny_model_dir, tmp_path):
    port = free_port()
    topo = _write(tmp_path / "t.yaml", f"""
model: {{path: {tiny_model_dir}, served_model_name: {MODEL}, max_model_len: 1024}}
roles: {{tokenizer_worker: 2, detokenizer: 1}}
http: {{port: {port}}}
supervision: {{restart: [tokenizer_worker, detokenizer], teardown_delay_s: 3}}
""")
    log = tmp_path / "launcher.log"
    srv = CandorServer.from_topology(topo, port).start(log_path=log)
    try:
        # a stream in flight when its detokenizer dies fails with an error frame
        frames: list[bytes] = []

        def stream() -> None:
            req = urllib.request.Request(
                srv.base_url + "/v1/completions", method="POST",
                data=json.dumps({"model": MODEL, "prompt": "long", "max_tokens": 900,
                                 "ignore_eos": True, "stream": True}).encode(),
                headers={"Content-Type": "application/json"})
            with urllib.request.urlopen(req, timeout=30) as resp:
                frames.extend(line for line in resp if line.strip())

        reader = threading.Thread(target=stream)
        reader.start()
        wait_until(lambda: len(frames) >= 3, "three stream frames", interval=0.01)
        os.kill(_pid_of(srv, "detokenizer[0]"), signal.SIGKILL)
        reader.join(timeout=10)
        assert not reader.is_alive(), "the stream hung after its detokenizer died"
        assert frames[-1] == b"data: [DONE]\n"
        error = json.loads(frames[-2][len(b"data: "):])["error"]
        assert error["code"] == "detokenizer_lost", error
        # the detokenizer is back: healthy again, and requests are served
        wait_until(srv.health, "/health 200 with the detokenizer restarted",
                   until=lambda h: h[0] == 200, timeout=15, interval=0.1)
        status, payload = _post(srv.base_url, {"prompt": "again", "max_tokens": 3})
        assert status == 200, payload
        now = scrape(srv)
        assert now.value("candor_process_restarts_total", node="local",
                         role="detokenizer") == 1
        assert now.value("candor_stream_errors_total", code="detokenizer_lost") == 1
        srv.wait_all_blocks_free()

        # the gpu_worker is not restartable: 503 naming it within a second, then exit 1
        os.kill(_pid_of(srv, "gpu_worker[0]"), signal.SIGKILL)
        took, body = _first_503(srv, within=1.0)
        print(f"/health 503 after {took * 1000:.0f} ms: {body['error']['message']}")
        assert "gpu_worker[0]" in body["error"]["message"]
        assert srv.proc.wait(timeout=30) == 1
    finally:
        srv.stop()
    assert "gpu_worker[0] exited with code -9" in log.read_text()


def test_two_frontends_count_once_then_sigterm_drains(tiny_model_dir):
    srv = CandorServer(tiny_model_dir, "--served-model-name", MODEL, "--frontends", "2",
                       "--tokenizer-workers", "2").start()
    try:
        before = scrape(srv)
        pids = set()
        for i in range(12):
            status, payload = _post(srv.base_url, {"prompt": f"n{i}", "max_tokens": 2})
            assert status == 200, payload
            pids.add(json.loads(srv.get("/version")[1])["frontend"])
        assert len(pids) == 2, "SO_REUSEPORT should spread connections over both frontends"
        for _ in range(4):  # every frontend's scrape shows the same merged totals
            after = scrape(srv)
            assert (after.total("candor_http_requests_total", route="/v1/completions")
                    - before.total("candor_http_requests_total", route="/v1/completions")) \
                == 12
            assert (after.total("candor_generation_tokens_total")
                    - before.total("candor_generation_tokens_total")) == 24

        result: dict = {}

        def long_request() -> None:
            result["status"], result["body"] = _post(
                srv.base_url, {"prompt": "drain me", "max_tokens": 700, "ignore_eos": True})

        worker = threading.Thread(target=long_request)
        worker.start()
        wait_until(srv.engine_stats, "the long request admitted",
                   until=lambda s: s["running"] + s["waiting"] >= 1)
        srv.proc.send_signal(signal.SIGTERM)

        def too_late() -> tuple[int, bytes]:
            """A request that reaches a frontend before its SIGTERM is served; a frontend
            with nothing in flight exits at once (its socket closes under the client)."""
            try:
                return _post(srv.base_url, {"prompt": "too late", "max_tokens": 2})
            except OSError as err:
                return 0, repr(err).encode()

        status, payload = wait_until(too_late, "a new request refused during the drain",
                                     until=lambda r: r[0] == 503)
        assert b"shutting down" in payload, payload
        health, body = srv.health()
        assert health == 503 and "draining" in body["error"]["message"]
        worker.join(timeout=60)
        assert result["status"] == 200, result
        assert json.loads(result["body"])["usage"]["completion_tokens"] == 700
        assert srv.proc.wait(timeout=30) == 0
    finally:
        srv.stop()


def test_two_node_topology_over_loopback_tcp(tiny_model_dir, tmp_path):
    http, metrics = free_port(), free_port()
    ports = [free_port() for _ in range(8)]
    topo = _write(tmp_path / "two-node.yaml", f"""
model: {{path: {tiny_model_dir}, served_model_name: {MODEL}, max_model_len: 1024}}
roles: {{api_frontend: 1, tokenizer_worker: 2, detokenizer: 1}}
http: {{port: {http}}}
nodes:
  - {{name: gateway, host: 127.0.0.1, roles: [api_frontend, tokenizer_worker, detokenizer],
      status_address: "tcp://{{host}}:{ports[6]}"}}
  - {{name: engine, host: 127.0.0.1, roles: [scheduler, gpu_worker], metrics_port: {metrics},
      status_address: "tcp://{{host}}:{ports[7]}"}}
addresses:
  scheduler_in: tcp://{{host}}:{ports[0]}
  scheduler_pub: tcp://{{host}}:{ports[1]}
  worker_in: tcp://{{host}}:{ports[2]}
  worker_out: tcp://{{host}}:{ports[3]}
  tokenizer_in: ipc://{{run_dir}}/tokenizer-{{i}}
  detokenizer_in: tcp://{{host}}:{ports[4]}
  frontend_results: tcp://{{host}}:{ports[5]}
""")
    engine = CandorServer.from_topology(topo, metrics, node="engine").spawn(
        tmp_path / "engine.log")
    gateway = CandorServer.from_topology(topo, http, node="gateway")
    try:
        gateway.start(log_path=tmp_path / "gateway.log")
        status, body = gateway.health()
        assert status == 200 and set(body["nodes"]) == {"gateway", "engine"}
        assert sorted(body["nodes"]["engine"]) == ["gpu_worker[0]", "scheduler[0]"]
        for i in range(3):
            status, payload = _post(gateway.base_url, {"prompt": f"hi {i}", "max_tokens": 4,
                                                       "temperature": 0})
            assert status == 200, payload
        assert engine.get("/health")[0] == 200
        # the engine node's gauges follow its scheduler's heartbeat
        engine_side = wait_until(lambda: scrape(engine), "the engine node's scrape",
                                 until=lambda s: s.value("candor_kv_blocks_total") > 0
                                 and s.total("candor_queue_time_seconds_count") >= 3)
        gateway_side = scrape(gateway)
        assert engine_side.value("candor_kv_blocks_total") > 0
        assert engine_side.total("candor_queue_time_seconds_count") >= 3
        assert "candor_http_requests_total" not in engine_side.sample_names()
        assert gateway_side.total("candor_http_requests_total",
                                  route="/v1/completions", status="200") == 3
        assert gateway_side.total("candor_tokenizer_requests_total") == 3
    finally:
        assert gateway.stop() == 0
        assert engine.stop() == 0


def test_an_engine_node_down_is_named_by_the_gateway(tiny_model_dir, tmp_path):
    """No launcher for a node: /health says which node it has not heard from."""
    http = free_port()
    topo = _write(tmp_path / "half.yaml", f"""
model: {{path: {tiny_model_dir}}}
http: {{port: {http}}}
nodes:
  - {{name: gateway, roles: [api_frontend, tokenizer_worker, detokenizer],
      status_address: "tcp://{{host}}:{free_port()}"}}
  - {{name: engine, roles: [scheduler, gpu_worker],
      status_address: "tcp://{{host}}:{free_port()}"}}
addresses:
  scheduler_in: tcp://{{host}}:{free_port()}
  scheduler_pub: tcp://{{host}}:{free_port()}
  detokenizer_in: tcp://{{host}}:{free_port()}
  frontend_results: tcp://{{host}}:{free_port()}
""")
    gateway = CandorServer.from_topology(topo, http, node="gateway").spawn(
        tmp_path / "gateway.log")
    try:
        status, body = wait_until(gateway.health, "the gateway's /health to answer",
                                  until=lambda h: h[0] != 0, timeout=60, interval=0.2)
        assert status == 503
        assert "node 'engine'" in body["error"]["message"]
        status, payload = _post(gateway.base_url, {"prompt": "x", "max_tokens": 2}, 10)
        assert status == 503, payload  # refused at once, not left to hang
    finally:
        assert gateway.stop() == 0


@pytest.mark.parametrize("scrapes", [20])
def test_scrape_size_and_time_with_the_session_topology(server, scrapes):
    """Bytes and milliseconds of one host scrape, printed; the median stays under 0.5 s."""
    sizes, times = [], []
    for _ in range(scrapes):
        started = time.perf_counter()
        status, body = server.get("/metrics")
        times.append(time.perf_counter() - started)
        sizes.append(len(body))
        assert status == 200
    parsed = Scrape(body.decode())
    times.sort()
    print(f"scrape: {sizes[-1]} bytes, {len(parsed.samples)} samples, median "
          f"{times[len(times) // 2] * 1000:.1f} ms, max {times[-1] * 1000:.1f} ms")
    assert times[len(times) // 2] < 0.5


def _running(srv: CandorServer, name: str) -> int | None:
    """The pid of the child ``name`` once it runs its role (a child just forked still
    shows the launcher's command line), else None."""
    for pid in srv.children():
        try:
            if role_of(pid) == name:
                return pid
        except (OSError, IndexError, ValueError):
            continue
    return None


def _kill_and_time_the_comeback(srv: CandorServer, name: str) -> tuple[float, float]:
    """SIGKILL ``name``; (when its successor started, seconds that took)."""
    old = wait_until(lambda: _running(srv, name), f"{name} running", timeout=30)
    os.kill(old, signal.SIGKILL)
    killed = time.monotonic()
    wait_until(lambda: _running(srv, name) not in (None, old), f"{name} restarted",
               timeout=30, interval=0.02)
    now = time.monotonic()
    return now, now - killed


def test_restarts_back_off_and_their_limit_counts_a_window(tiny_model_dir, tmp_path):
    """A crash loop is slowed (the second restart in a window waits a second, then two
    ...) and stopped after max_restarts within restart_window_s; restarts older than the
    window no longer count, so a role that crashes now and then never uses the limit up."""
    port = free_port()
    topo = _write(tmp_path / "t.yaml", f"""
model: {{path: {tiny_model_dir}, served_model_name: {MODEL}, max_model_len: 1024}}
http: {{port: {port}}}
supervision: {{restart: [detokenizer], max_restarts: 2, restart_window_s: 8}}
""")
    log = tmp_path / "launcher.log"
    srv = CandorServer.from_topology(topo, port).start(log_path=log)
    try:
        first_restart, immediate = _kill_and_time_the_comeback(srv, "detokenizer[0]")
        _, backed_off = _kill_and_time_the_comeback(srv, "detokenizer[0]")
        print(f"first restart after {immediate:.2f}s, second after {backed_off:.2f}s")
        assert backed_off >= 1.0 > immediate
        wait_until(srv.health, "/health 200 with the detokenizer back",
                   until=lambda h: h[0] == 200, timeout=30, interval=0.1)
        # the first restart leaves the window: one more restart is allowed
        time.sleep(max(0.0, first_restart + 8.3 - time.monotonic()))
        _kill_and_time_the_comeback(srv, "detokenizer[0]")
        assert srv.proc.poll() is None
        # a crash loop spends the limit within the window: the topology stops
        for _ in range(3):
            pid = wait_until(lambda: _running(srv, "detokenizer[0]") or srv.proc.poll(),
                             "the detokenizer back, or the launcher gone", timeout=30)
            if srv.proc.poll() is not None:
                break
            os.kill(pid, signal.SIGKILL)
            wait_until(lambda: _running(srv, "detokenizer[0]") != pid or srv.proc.poll(),
                       "the detokenizer reaped", timeout=30, interval=0.02)
        assert srv.proc.wait(timeout=30) == 1
    finally:
        srv.stop()
    assert "restarted 2 times within 8s" in log.read_text()


def test_an_engine_death_during_the_drain_fails_requests_at_once(tiny_model_dir, tmp_path):
    """SIGTERM, then the gpu_worker dies: the requests it held fail at once (not at the
    drain limit) in the error shape, and the launcher exits non-zero."""
    port = free_port()
    topo = _write(tmp_path / "t.yaml", f"""
model: {{path: {tiny_model_dir}, served_model_name: {MODEL}, max_model_len: 2048}}
http: {{port: {port}}}
supervision: {{drain_timeout_s: 90}}
""")
    srv = CandorServer.from_topology(topo, port).start(log_path=tmp_path / "launcher.log")
    try:
        worker = _pid_of(srv, "gpu_worker[0]")
        os.kill(worker, signal.SIGSTOP)  # the requests cannot finish before it dies
        results: list[tuple[int, bytes]] = []
        clients = [threading.Thread(target=lambda i=i: results.append(_post(
            srv.base_url, {"prompt": f"drain {i}", "max_tokens": 2000, "ignore_eos": True},
            timeout=120))) for i in range(2)]
        for t in clients:
            t.start()
        wait_until(srv.engine_stats, "both requests in the engine",
                   until=lambda s: s["running"] + s["waiting"] == 2, timeout=30)
        srv.proc.send_signal(signal.SIGTERM)
        wait_until(srv.health, "/health 503 while draining",
                   until=lambda h: h[0] == 503, timeout=10, interval=0.02)
        os.kill(worker, signal.SIGKILL)
        killed = time.monotonic()
        for t in clients:
            t.join(timeout=20)
        took = time.monotonic() - killed
        assert not any(t.is_alive() for t in clients), "requests hung after the worker died"
        print(f"requests failed {took:.2f}s after the worker died during the drain")
        for status, payload in results:
            assert status == 503, payload
            error = json.loads(payload)["error"]
            assert set(error) == {"message", "type", "param", "code"}
            assert "gpu_worker[0]" in error["message"], error
        assert srv.proc.wait(timeout=30) == 1
    finally:
        srv.stop()


def test_a_full_waiting_queue_does_not_fail_the_generation_probe(tiny_model_dir, tmp_path):
    """The waiting-queue bound sheds requests, never /health/generate: the probe jumps
    the queue, so a busy, healthy engine stays in rotation under load."""
    port = free_port()
    topo = _write(tmp_path / "t.yaml", f"""
model: {{path: {tiny_model_dir}, served_model_name: {MODEL}, max_model_len: 1024}}
http: {{port: {port}}}
engine: {{max_num_seqs: 2, max_waiting_requests: 2}}
""")
    srv = CandorServer.from_topology(topo, port).start(log_path=tmp_path / "launcher.log")
    worker = _pid_of(srv, "gpu_worker[0]")
    try:
        os.kill(worker, signal.SIGSTOP)  # the engine is busy: nothing finishes meanwhile
        results: list[tuple[int, bytes]] = []
        clients = [threading.Thread(target=lambda i=i: results.append(_post(
            srv.base_url, {"prompt": f"busy {i}", "max_tokens": 300, "ignore_eos": True})))
            for i in range(3)]
        for i, t in enumerate(clients):  # one by one: the frontend sheds a burst early
            t.start()
            wait_until(srv.engine_stats, f"{i + 1} request(s) in the engine",
                       until=lambda s: s["running"] + s["waiting"] == i + 1, timeout=30)
        assert srv.engine_stats()["waiting"] == 2  # the stopped worker holds the first
        status, payload = _post(srv.base_url, {"prompt": "one too many", "max_tokens": 2})
        assert status == 503 and json.loads(payload)["error"]["code"] == "queue_full"
        probe: list[tuple[int, bytes]] = []
        prober = threading.Thread(target=lambda: probe.append(
            srv.get("/health/generate?timeout=60", timeout=70)))
        prober.start()
        # the probe waits at the head of the full queue (or, refused, is answered at once)
        wait_until(lambda: probe or srv.engine_stats()["waiting"] == 3,
                   "the probe queued or answered", timeout=30)
        os.kill(worker, signal.SIGCONT)
        prober.join(timeout=70)
        assert probe and probe[0][0] == 200, probe
        for t in clients:
            t.join(timeout=120)
        assert [s for s, _ in results] == [200] * 3
    finally:
        os.kill(worker, signal.SIGCONT)
        assert srv.stop() == 0
