"""Operations routes and middleware: /metrics, /health, /health/generate, /version,
request counting, the body-read timeout, and draining on SIGTERM.

/health answers from state already in memory (the scheduler's heartbeat and the
launchers' NodeStatus), never through the request pipeline, so it cannot queue behind
traffic. /health/generate does push one token through every role, as a probe that the
tokenizer worker and the scheduler put at the head of their queues.
"""

from __future__ import annotations

import asyncio
import platform
import time

import msgspec
from aiohttp import web

from api_frontend.endpoints.registry import ENDPOINTS
from api_frontend.engine_client import EngineClient
from api_frontend.errors import RETRY_AFTER_S, ApiError
from api_frontend.metrics import FrontendMetrics
from api_frontend.probe import PROBE_KEY, GenerationProbe
from api_frontend.topology_watch import TopologyWatch
from cluster.metrics import render
from cluster.process_config import FrontendConfig
from protocol import ipc
from protocol.version import VERSION

PROBE_TIMEOUT_S = 10.0
FLUSH_S = 1.0  # after the drain limit: time for cut streams to write their last frames
# the routes refused while generation would hang: each endpoint's own
GENERATION_ROUTES = frozenset(endpoint.path for endpoint in ENDPOINTS)


class Ops:
    """Everything the ops routes read; one per frontend process."""

    def __init__(self, cfg: FrontendConfig, engine: EngineClient, watch: TopologyWatch,
                 metrics: FrontendMetrics) -> None:
        self.cfg = cfg
        self.engine = engine
        self.watch = watch
        self.metrics = metrics
        self.draining = False
        self.started = time.time()

    def problems(self) -> list[str]:
        out = []
        if self.draining:
            out.append("this frontend is draining (shutting down)")
        out.extend(self.watch.problems())
        engine = self.engine.engine_problem()
        if engine is not None:
            out.append(engine)
        stats = self.engine.stats
        if stats is not None and stats.step_in_flight_s > self.cfg.supervision.step_stuck_s:
            out.append(f"the gpu_worker has been running one step for "
                       f"{stats.step_in_flight_s:.0f}s")
        return out

    def refuse_generation(self) -> ApiError | None:
        """The 503 a new generation request gets now, if any: the topology cannot serve
        it (it would only hang), or the waiting queue is full (shed before tokenizing)."""
        why = None
        if self.draining:
            why = "this server is shutting down and accepts no new requests"
        elif (failed := self.watch.failed()) is not None:
            why = f"the topology is stopping: {failed}"
        else:
            why = self.engine.engine_problem()
        if why is not None:
            return ApiError(503, why, None, "unavailable", headers={"Retry-After": "5"})
        full = self.engine.queue_full()
        if full is not None:
            return ApiError(503, full, None, "queue_full",
                            headers={"Retry-After": RETRY_AFTER_S})
        return None

    async def drain(self) -> int:
        """Refuse new work, wait for in-flight requests up to the grace period, then
        fail the rest so each stream ends with an error frame and [DONE] (not a cut
        connection). Returns how many were cut."""
        self.draining = True
        deadline = time.monotonic() + self.cfg.supervision.drain_timeout_s
        while self.engine.inflight and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        cut = self.engine.fail_requests(
            f"the server is shutting down and stopped this request at its drain limit "
            f"({self.cfg.supervision.drain_timeout_s:g}s)", "server_shutdown")
        flush_deadline = time.monotonic() + FLUSH_S  # let the handlers write the frames
        while self.engine.inflight and time.monotonic() < flush_deadline:
            await asyncio.sleep(0.02)
        return cut


OPS_KEY = web.AppKey("ops", Ops)


def _route_label(request: web.Request) -> str:
    info = request.match_info
    resource = info.route.resource if info.route is not None else None
    return resource.canonical if resource is not None else "unmatched"


@web.middleware
async def ops_middleware(request: web.Request, handler):
    """Outermost: counts every answer, and refuses generation while it would hang."""
    ops = request.app[OPS_KEY]
    route = _route_label(request)
    if request.method == "POST" and request.path in GENERATION_ROUTES:
        refusal = ops.refuse_generation()
        if refusal is not None:
            ops.metrics.requests.labels(route, "503", "none").inc()
            return refusal.response()
    try:
        response = await handler(request)
    except (asyncio.CancelledError, ConnectionResetError):
        # the client went away: cancelled while waiting, or a write hit a closed socket
        ops.metrics.requests.labels(route, "499", "abort").inc()
        raise
    finish = ops.engine.finish_reasons.pop(response.headers.get("x-request-id", ""), "none")
    ops.metrics.requests.labels(route, str(response.status), finish).inc()
    return response


async def metrics_route(request: web.Request) -> web.Response:
    ops = request.app[OPS_KEY]
    if ops.cfg.metrics_dir is None:
        raise ApiError(503, "metrics are off: this frontend was started without the "
                       "launcher's metrics directory", None, "metrics_unavailable")
    body, content_type = await asyncio.get_running_loop().run_in_executor(
        None, render, ops.cfg.metrics_dir)
    return web.Response(body=body, headers={"Content-Type": content_type})


async def health_route(request: web.Request) -> web.Response:
    ops = request.app[OPS_KEY]
    problems = ops.problems()
    if problems:
        ops.metrics.probes.labels("health", "fail").inc()
        raise ApiError(503, "unhealthy: " + "; ".join(problems), None, "unhealthy")
    ops.metrics.probes.labels("health", "ok").inc()
    nodes = {name: [f"{c.role}[{c.index}]" for c in status.children]
             for name, (status, _) in ops.watch.status.items()}
    body = {"status": "ok", "engine": _stats_dict(ops.engine.stats), "nodes": nodes}
    if ops.engine.replicas > 1:  # serving, perhaps without every replica
        replicas = ops.engine.replica_report()
        body["replicas"] = replicas
        if any(r["state"] != "serving" for r in replicas):
            body["status"] = "degraded"
    return web.json_response(body)


def _stats_dict(stats: ipc.SchedulerStats | None) -> dict | None:
    if stats is None:
        return None
    return {f: msgspec.to_builtins(getattr(stats, f)) for f in stats.__struct_fields__}


async def health_generate_route(request: web.Request) -> web.Response:
    """One real token through tokenizer, scheduler, worker and detokenizer, on every
    engine replica in rotation; concurrent callers share one round
    (``GenerationProbe``). 503 when any replica probed fails, naming it."""
    ops = request.app[OPS_KEY]
    timeout = PROBE_TIMEOUT_S
    if "timeout" in request.query:
        try:
            timeout = min(60.0, max(0.1, float(request.query["timeout"])))
        except ValueError:
            raise ApiError(400, "timeout must be a number of seconds", "timeout",
                           "invalid_value") from None
    problems = ops.problems()
    if problems:
        ops.metrics.probes.labels("generate", "fail").inc()
        raise ApiError(503, "unhealthy: " + "; ".join(problems), None, "unhealthy")
    probed = await request.app[PROBE_KEY].check(timeout)
    if not probed.results:  # every replica left rotation since problems() was read
        ops.metrics.probes.labels("generate", "fail").inc()
        raise ApiError(503, "unhealthy: no engine replica is in rotation to probe", None,
                       "unhealthy")
    failures = probed.failures()
    outcome = failures[0].outcome if failures else "ok"
    ops.metrics.probes.labels("generate", outcome).inc()
    several = ops.engine.replicas > 1
    if failures:
        what = "; ".join((f"replica {r.replica}: " if several else "") + r.message
                         for r in failures)
        if all(r.outcome == "timeout" for r in failures):
            raise ApiError(503, f"generation probe got {what}", None, "probe_timeout")
        raise ApiError(503, f"generation probe failed: {what}", None, "probe_failed")
    if not several:
        (result,) = probed.results
        return web.json_response({"status": "ok", "tokens": result.tokens,
                                  "latency_s": result.latency_s})
    replicas = [{"replica": r.replica, "status": "ok", "tokens": r.tokens,
                 "latency_s": r.latency_s} for r in probed.results]
    replicas += [{"replica": r, "status": f"not probed: {state}"}
                 for r, state in probed.skipped.items()]
    return web.json_response({"status": "degraded" if probed.skipped else "ok",
                              "replicas": sorted(replicas, key=lambda r: r["replica"])})


async def live_route(request: web.Request) -> web.Response:
    """Liveness: this frontend's event loop answers HTTP. It says nothing about the
    engine (a loading or restarting engine is /health's 503), so a kubelet that probes it
    restarts only a frontend that is really stuck."""
    return web.json_response({"status": "live"})


async def version_route(request: web.Request) -> web.Response:
    ops = request.app[OPS_KEY]
    return web.json_response({
        "version": VERSION, "model": ops.cfg.served_model_name,
        "python": platform.python_version(), "node": ops.cfg.node,
        "frontend": ops.cfg.index, "started": int(ops.started),
        # what --device / --dtype (auto by default) resolved to on the gpu_worker
        "device": stats.worker_device if (stats := ops.engine.stats) else None,
        "dtype": stats.worker_dtype if stats else None})


def install_ops(app: web.Application, ops: Ops) -> None:
    """Mount the ops routes (replacing the plain /health) and the counting middleware."""
    app[OPS_KEY] = ops
    app[PROBE_KEY] = GenerationProbe(ops.engine)
    app.middlewares.insert(0, ops_middleware)
    app.router.add_get("/metrics", metrics_route)
    app.router.add_get("/health", health_route)
    app.router.add_get("/live", live_route)
    app.router.add_get("/health/generate", health_generate_route)
    app.router.add_get("/version", version_route)
