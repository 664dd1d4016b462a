"""What the frontends count: requests, tokens, latencies as the client sees them,
mid-stream errors and event-loop lag. Written into the host's multiprocess directory
(see protocol/metrics.py); each frontend counts only the requests it served."""

from __future__ import annotations

import asyncio
import time

from prometheus_client import Counter, Gauge, Histogram

from protocol.metrics import LATENCY_BUCKETS

LAG_INTERVAL_S = 0.1


class FrontendMetrics:
    def __init__(self) -> None:
        self.requests = Counter(
            "candor_http_requests", "HTTP requests answered by the frontends, by route "
            "template, status code and finish reason ('none' when no generation finished; "
            "status 499: the client went away first)",
            ["route", "status", "finish_reason"], registry=None)
        self.prompt_tokens = Counter(
            "candor_prompt_tokens", "Prompt tokens of generation requests that produced "
            "output", registry=None)
        self.generation_tokens = Counter(
            "candor_generation_tokens", "Tokens generated for clients (completion tokens)",
            registry=None)
        self.ttft = Histogram(
            "candor_time_to_first_token_seconds", "Seconds from a generation request's "
            "arrival at the frontend to its first output token", buckets=LATENCY_BUCKETS,
            registry=None)
        self.itl = Histogram(
            "candor_inter_token_latency_seconds", "Seconds between consecutive output "
            "tokens of one request, as the frontend received them",
            buckets=LATENCY_BUCKETS, registry=None)
        self.e2e = Histogram(
            "candor_e2e_request_latency_seconds", "Seconds from a generation request's "
            "arrival to its last token, for requests that finished", buckets=LATENCY_BUCKETS,
            registry=None)
        self.stream_errors = Counter(
            "candor_stream_errors", "Streams that failed after the first frame was sent "
            "(answered with an error frame, then [DONE])", ["code"], registry=None)
        self.inflight = Gauge(
            "candor_frontend_inflight_requests", "Requests the frontends are waiting on "
            "the engine for now (each sampled choice of an n>1 request counts; render and "
            "tokenize calls too)", multiprocess_mode="livesum", registry=None)
        self.request_state = Gauge(
            "candor_frontend_request_state_entries", "Entries in a frontend's per-request "
            "tables (reply queues, unanswered submits, latency timers, finish reasons not "
            "yet counted); every one returns to 0 when no request is in flight",
            ["table"], multiprocess_mode="livesum", registry=None)
        self.loop_lag = Gauge(
            "candor_frontend_event_loop_lag_seconds", "How late a 100 ms timer fired on a "
            "frontend's event loop, latest sample (max over frontends)",
            multiprocess_mode="livemax", registry=None)
        self.probes = Counter(
            "candor_health_probes", "Health probes answered, by probe and result",
            ["probe", "result"], registry=None)
        self.routed = Counter(
            "candor_router_requests", "Generation requests sent to each engine replica, by "
            "why: affinity (its prompt prefix or cache_salt lives there), load (least "
            "loaded), round_robin", ["replica", "reason"], registry=None)
        self.replica_up = Gauge(
            "candor_replica_up", "1 while an engine replica is in a frontend's rotation "
            "(heartbeat fresh, worker loaded, not lost)", ["replica"],
            multiprocess_mode="livemin", registry=None)

    async def watch_loop_lag(self) -> None:
        """Runs forever: a timer that fires late means handlers are hogging the loop."""
        loop = asyncio.get_running_loop()
        while True:
            start = loop.time()
            await asyncio.sleep(LAG_INTERVAL_S)
            self.loop_lag.set(max(0.0, loop.time() - start - LAG_INTERVAL_S))


class RequestTimer:
    """Per-request latency bookkeeping, fed one delta at a time."""

    __slots__ = ("metrics", "arrival", "last", "tokens")

    def __init__(self, metrics: FrontendMetrics, arrival_monotonic: float) -> None:
        self.metrics = metrics
        self.arrival = arrival_monotonic
        self.last: float | None = None
        self.tokens = 0

    def on_delta(self, completion_tokens: int) -> None:
        new = completion_tokens - self.tokens
        if new <= 0:
            return
        now = time.monotonic()
        if self.last is None:
            self.metrics.ttft.observe(now - self.arrival)
            new -= 1
        if new > 0 and self.last is not None:
            gap = (now - self.last) / new
            for _ in range(new):
                self.metrics.itl.observe(gap)
        self.last = now
        self.tokens = completion_tokens

    def finished(self, prompt_tokens: int, completion_tokens: int) -> None:
        self.metrics.prompt_tokens.inc(prompt_tokens)
        self.metrics.generation_tokens.inc(completion_tokens)
        self.metrics.e2e.observe(time.monotonic() - self.arrival)
