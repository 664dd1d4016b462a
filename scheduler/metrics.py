"""What the scheduler measures, and how its stats become Prometheus metrics.

Events (queue time, step time, worker idle gaps) are observed where they happen; the
state and cumulative counts travel in ``SchedulerStats`` (the heartbeat /health reads)
and ``export`` turns each heartbeat into gauges and counter increments, so the metrics
and the heartbeat never disagree. Files land in the host's multiprocess directory.
"""

from __future__ import annotations

import statistics
import time
from collections import deque

import msgspec
from prometheus_client import Counter, Gauge, Histogram

from cluster.metrics import LATENCY_BUCKETS, STEP_BUCKETS
from protocol import ipc

ABORT_CAUSES = ("disconnect", "stop_string", "error", "request_error", "probe_timeout")


class SchedulerMetrics:
    """The unlabelled series sum over every engine replica's scheduler (one host, one
    scrape); the ``candor_replica_*`` series carry a ``replica`` label for each."""

    def __init__(self, replica: int = 0) -> None:
        g = dict(multiprocess_mode="livesum", registry=None)
        label = str(replica)
        self.by_replica = {
            name: Gauge(f"candor_replica_{name}", f"{what}, per engine replica",
                        ["replica"], **g).labels(label)
            for name, what in (("requests_running", "Requests in the running batch"),
                               ("requests_waiting", "Requests queued in the scheduler"),
                               ("kv_blocks_used", "Paged KV-cache blocks held by requests"),
                               ("kv_blocks_total", "Paged KV-cache blocks the replica's "
                                                   "ranks allocated"),
                               ("prefix_cache_hit_tokens", "Prompt tokens found in the "
                                                           "prefix cache since start"),
                               ("prefix_cache_queried_tokens", "Prompt tokens looked up in "
                                                               "the prefix cache since start"))}
        self.running = Gauge("candor_requests_running", "Requests in the running batch "
                             "(KV blocks held, decoding or prefilling)", **g)
        self.waiting = Gauge("candor_requests_waiting", "Requests queued in the scheduler, "
                             "not yet admitted to the batch", **g)
        self.kv_used = Gauge("candor_kv_blocks_used", "Paged KV-cache blocks held by "
                             "requests", **g)
        self.kv_total = Gauge("candor_kv_blocks_total", "Paged KV-cache blocks the worker "
                              "allocated", **g)
        self.prefix_queried = Counter(
            "candor_prefix_cache_queried_tokens", "Prompt tokens looked up in the prefix "
            "cache", registry=None)
        self.prefix_hits = Counter(
            "candor_prefix_cache_hit_tokens", "Prompt tokens found in the prefix cache "
            "(their prefill was skipped)", registry=None)
        self.preemptions = Counter(
            "candor_preemptions", "Running requests evicted for lack of KV blocks (they "
            "re-queue and recompute)", registry=None)
        self.aborts = Counter(
            "candor_aborts", "Requests stopped before finishing, by cause: disconnect "
            "(client left), stop_string (the detokenizer matched a stop), error (a failed "
            "step: every request in it, or a process holding the request was lost), "
            "request_error (the request's own bad state ended it alone: a constraint that "
            "conflicts with min_tokens, a token its grammar rejects, nothing left to "
            "sample), probe_timeout (a /health/generate probe ran out of time)", ["cause"],
            registry=None)
        self.steps = Counter("candor_scheduler_steps", "Forward steps the scheduler ran",
                             registry=None)
        self.queue_time = Histogram(
            "candor_queue_time_seconds", "Seconds a request waited in the scheduler's queue "
            "before its first step", buckets=LATENCY_BUCKETS, registry=None)
        self.step_time = Histogram(
            "candor_step_duration_seconds", "Seconds from sending a step to the worker to "
            "its result; phase prefill: the step fed prompt tokens, decode: only one new "
            "token per request", ["phase"], buckets=STEP_BUCKETS, registry=None)
        self.worker_idle = Histogram(
            "candor_worker_idle_seconds", "Seconds the worker sat idle between a step's "
            "result and the next step while requests were waiting or running",
            buckets=STEP_BUCKETS, registry=None)
        self.step_phases = Counter(
            "candor_step_phase_seconds", "Wall seconds the step loop spent in each phase, "
            "by phase: sched_* in the scheduler (intake, plan, postprocess, ipc), worker_* in "
            "the gpu_worker's rank 0 (prepare, forward, sample, grammar, send); the worker's "
            "idle gaps are candor_worker_idle_seconds", ["phase"], registry=None)
        self.lora_requests = Gauge(
            "candor_lora_requests", "Requests per LoRA adapter, by state: running (in the "
            "batch) or waiting", ["adapter", "state"], **g)
        self.lora_slots = Gauge(
            "candor_lora_max_adapters", "Distinct LoRA adapters one step may run "
            "(--max-loras); absent while LoRA is off", multiprocess_mode="livemax", registry=None)
        self.spec_drafts = Counter(
            "candor_spec_decode_num_drafts", "Speculative decoding: a request's decode "
            "steps that carried draft tokens", registry=None)
        self.spec_draft_tokens = Counter(
            "candor_spec_decode_num_draft_tokens", "Speculative decoding: draft tokens "
            "verified", registry=None)
        self.spec_accepted_tokens = Counter(
            "candor_spec_decode_num_accepted_tokens", "Speculative decoding: draft tokens "
            "accepted (each one the token the model would have produced)", registry=None)
        self.spec_accepted_per_pos = Counter(
            "candor_spec_decode_num_accepted_tokens_per_pos", "Speculative decoding: "
            "draft tokens accepted, by position in the draft (0 first)", ["position"],
            registry=None)
        self._lora_labels: set[tuple[str, str]] = set()
        self._exported: dict[str, float] = {}

    def _add(self, key: str, counter, total: float) -> None:
        delta = total - self._exported.get(key, 0)
        if delta > 0:
            counter.inc(delta)
        self._exported[key] = total

    def export(self, stats: ipc.SchedulerStats) -> None:
        mine = self.by_replica
        mine["requests_running"].set(stats.running)
        mine["requests_waiting"].set(stats.waiting)
        mine["kv_blocks_used"].set(stats.total_blocks - stats.free_blocks)
        mine["kv_blocks_total"].set(stats.total_blocks)
        mine["prefix_cache_hit_tokens"].set(stats.prefix_cache_hit_tokens)
        mine["prefix_cache_queried_tokens"].set(stats.prefix_cache_queried_tokens)
        self.running.set(stats.running)
        self.waiting.set(stats.waiting)
        self.kv_total.set(stats.total_blocks)
        self.kv_used.set(stats.total_blocks - stats.free_blocks)
        self._add("steps", self.steps, stats.steps)
        self._add("preemptions", self.preemptions, stats.preemptions)
        self._add("prefix_queried", self.prefix_queried, stats.prefix_cache_queried_tokens)
        self._add("prefix_hits", self.prefix_hits, stats.prefix_cache_hit_tokens)
        for cause, total in stats.aborts.items():
            self._add(f"abort:{cause}", self.aborts.labels(cause), total)
        for phase, total in stats.step_phases_s.items():
            self._add(f"phase:{phase}", self.step_phases.labels(phase), total)
        if stats.max_loras:
            self._export_lora(stats)
        self._add("spec_drafts", self.spec_drafts, stats.spec_drafts)
        self._add("spec_draft_tokens", self.spec_draft_tokens, stats.spec_draft_tokens)
        self._add("spec_accepted", self.spec_accepted_tokens, stats.spec_accepted_tokens)
        for pos, total in stats.spec_accepted_per_pos.items():
            self._add(f"spec_pos:{pos}", self.spec_accepted_per_pos.labels(pos), total)

    def _export_lora(self, stats: ipc.SchedulerStats) -> None:
        self.lora_slots.set(stats.max_loras)
        now = {(name, state): n for state, counts in (("running", stats.lora_running),
                                                      ("waiting", stats.lora_waiting))
               for name, n in counts.items()}
        for labels in self._lora_labels - now.keys():  # an adapter with none left: 0
            self.lora_requests.labels(*labels).set(0)
        for labels, n in now.items():
            self.lora_requests.labels(*labels).set(n)
        self._lora_labels = set(now)


class SchedulerPhases(msgspec.Struct):
    """Cumulative wall seconds of the scheduler's own step-loop phases; the loop adds
    perf_counter deltas around work it does anyway (a handful per step)."""

    intake: float = 0.0  # new requests and aborts drained from the inbound socket
    plan: float = 0.0  # Planner.plan and building the StepPlan
    postprocess: float = 0.0  # a result's tokens appended, finishes and frees, outputs queued
    ipc: float = 0.0  # plans sent, results decoded, token batches sent to detokenizers


class SchedulerOps:
    """The scheduler's bookkeeping for operations: cumulative counts for the heartbeat
    and the event-time observations. The step loop calls one method per event."""

    def __init__(self, replica: int = 0) -> None:
        self.metrics = SchedulerMetrics(replica)
        self.preemptions = 0
        self.aborts: dict[str, int] = {cause: 0 for cause in ABORT_CAUSES}
        self._enqueued: dict[str, float] = {}
        self.worker_idle_s = 0.0  # idle between consecutive steps while work was queued
        self.worker_busy_s = 0.0  # inside steps
        self._recent_idle: deque[float] = deque(maxlen=256)
        self.phases = SchedulerPhases()
        self.worker_timings = ipc.WorkerTimings()  # the latest the worker reported

    def enqueued(self, rid: str) -> None:
        self._enqueued[rid] = time.monotonic()

    def forget(self, rid: str) -> None:
        self._enqueued.pop(rid, None)

    def aborted(self, cause: str) -> None:
        self.aborts[cause] = self.aborts.get(cause, 0) + 1

    def step_sent(self, rids: list[str], preempted: int) -> None:
        now = time.monotonic()
        self.preemptions += preempted
        for rid in rids:
            queued = self._enqueued.pop(rid, None)
            if queued is not None:
                self.metrics.queue_time.observe(now - queued)

    def step_done(self, prefill: bool, started: float) -> None:
        """A step came back; ``started``: when the worker began it (monotonic)."""
        self.metrics.step_time.labels("prefill" if prefill else "decode").observe(
            time.monotonic() - started)

    def worker_result(self, idle_s: float, forward_s: float, work_was_queued: bool,
                      timings: ipc.WorkerTimings | None = None) -> None:
        """The worker's own timings for one step: ``idle_s`` is the gap it measured
        between its last result and this plan, which counts only when work was queued;
        ``timings`` its cumulative phases."""
        self.worker_busy_s += forward_s
        if timings is not None:
            self.worker_timings = timings
        if work_was_queued:
            self.worker_idle_s += idle_s
            self._recent_idle.append(idle_s)
            self.metrics.worker_idle.observe(idle_s)

    def worker_idle_ms_p50(self) -> float:
        return 1000 * statistics.median(self._recent_idle) if self._recent_idle else 0.0

    def step_phases_s(self) -> dict[str, float]:
        """Both processes' phases under their ``candor_step_phase_seconds`` labels."""
        return {**{f"sched_{k}": v for k, v in msgspec.structs.asdict(self.phases).items()},
                **{f"worker_{k}": v
                   for k, v in msgspec.structs.asdict(self.worker_timings).items()}}

    def in_flight_s(self, running_since: float | None) -> float:
        return time.monotonic() - running_since if running_since is not None else 0.0
