"""What one scrape shows, built at scrape time from the host's multiprocess files, so
no hot path pays for it:

- every Candor series labelled ``model_name`` (the deployment's primary served name),
  as vLLM labels its series, so dashboards filter by model;
- ratios of the node's summed counters (``candor_prefix_cache_hit_ratio``), which no
  process can export itself once several replicas add up;
- vLLM's names with vLLM's meaning (``vllm:num_requests_waiting``,
  ``vllm:kv_cache_usage_perc``, ``vllm:time_to_first_token_seconds`` ...), derived from
  the Candor series, so existing vLLM dashboards, alerts and the Gateway API Inference
  Extension's endpoint picker read Candor unchanged;
- ``vllm:lora_requests_info`` (with LoRA on): vLLM's gauge whose labels name the adapters
  with running and waiting requests and ``max_lora``, its value the time of the stats,
  which the Inference Extension's LoRA-affinity routing reads;
- ``process_*`` (RSS, CPU seconds, open fds, start time) of every process of this node,
  labelled ``role`` and ``index``, read from /proc for the pids the launcher lists.

The launcher writes ``node.json`` (model name, compat mode, the pid of each role
instance) into the metrics directory; the multiprocess collector reads only ``*.db``.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterable

import msgspec

NODE_FILE = "node.json"


class ProcessEntry(msgspec.Struct):
    pid: int
    role: str
    index: int


class NodeMetricsInfo(msgspec.Struct, kw_only=True):
    model_name: str
    node: str
    compat: str = "vllm"  # vllm: also export vLLM's names; none: Candor's only
    processes: list[ProcessEntry] = []


def write_node_info(path: str, info: NodeMetricsInfo) -> None:
    """Whole or not at all: written aside, then renamed over the old one."""
    partial = os.path.join(path, NODE_FILE + ".partial")
    with open(partial, "wb") as fh:
        fh.write(msgspec.json.encode(info))
    os.replace(partial, os.path.join(path, NODE_FILE))


def read_node_info(path: str) -> NodeMetricsInfo | None:
    try:
        with open(os.path.join(path, NODE_FILE), "rb") as fh:
            return msgspec.json.decode(fh.read(), type=NodeMetricsInfo)
    except (OSError, msgspec.DecodeError, msgspec.ValidationError):
        return None


# Candor family -> vLLM families with the same meaning (histograms, counters, gauges)
RENAMED = {
    "candor_requests_running": ("vllm:num_requests_running",),
    "candor_requests_waiting": ("vllm:num_requests_waiting",),
    "candor_time_to_first_token_seconds": ("vllm:time_to_first_token_seconds",),
    # vLLM renamed time_per_output_token to inter_token_latency; dashboards use both
    "candor_inter_token_latency_seconds": ("vllm:inter_token_latency_seconds",
                                           "vllm:time_per_output_token_seconds"),
    "candor_e2e_request_latency_seconds": ("vllm:e2e_request_latency_seconds",),
    "candor_queue_time_seconds": ("vllm:request_queue_time_seconds",),
    "candor_request_prefill_time_seconds": ("vllm:request_prefill_time_seconds",),
    "candor_request_decode_time_seconds": ("vllm:request_decode_time_seconds",),
    "candor_request_inference_time_seconds": ("vllm:request_inference_time_seconds",),
    "candor_request_prompt_tokens": ("vllm:request_prompt_tokens",),
    "candor_request_generation_tokens": ("vllm:request_generation_tokens",),
    "candor_request_max_generation_tokens": ("vllm:request_max_num_generation_tokens",),
    "candor_prompt_tokens": ("vllm:prompt_tokens",),
    "candor_generation_tokens": ("vllm:generation_tokens",),
    "candor_preemptions": ("vllm:num_preemptions",),
    "candor_prefix_cache_queried_tokens": ("vllm:prefix_cache_queries",),
    "candor_prefix_cache_hit_tokens": ("vllm:prefix_cache_hits",),
    # disaggregation: vLLM's NixlConnector times each KV transfer the same way (start of
    # the transfer to the KV usable on the decode side); its vllm:nixl_bytes_transferred
    # is a histogram of bytes per transfer, which Candor does not keep, so it has no alias
    "candor_kv_transfer_seconds": ("vllm:nixl_xfer_time_seconds",),
    "candor_spec_decode_num_drafts": ("vllm:spec_decode_num_drafts",),
    "candor_spec_decode_num_draft_tokens": ("vllm:spec_decode_num_draft_tokens",),
    "candor_spec_decode_num_accepted_tokens": ("vllm:spec_decode_num_accepted_tokens",),
    "candor_spec_decode_num_accepted_tokens_per_pos": (
        "vllm:spec_decode_num_accepted_tokens_per_pos",),
}
# vLLM's finished_reason values; each is exported from the start (0), so a panel or an
# alert on abort shows 0 rather than "no data" before the first one
FINISHED_REASONS = ("stop", "length", "abort")
_FINISH_MAP = {"stop": "stop", "length": "length", "tool_calls": "stop", "abort": "abort"}


def _with_labels(family, extra: dict[str, str], name: str | None = None):
    from prometheus_client.metrics_core import Metric

    out = Metric(name or family.name, family.documentation, family.type, family.unit)
    old = family.name
    for s in family.samples:
        sample_name = s.name if name is None else name + s.name[len(old):]
        out.add_sample(sample_name, {**s.labels, **extra}, s.value, s.timestamp, s.exemplar)
    return out


def _gauge(name: str, doc: str, value: float, labels: dict[str, str]):
    from prometheus_client.metrics_core import GaugeMetricFamily

    g = GaugeMetricFamily(name, doc, labels=list(labels))
    g.add_metric(list(labels.values()), value)
    return g


def _total(families: dict, name: str, sample: str | None = None) -> float:
    family = families.get(name)
    if family is None:
        return 0.0
    return sum(s.value for s in family.samples if s.name == (sample or name))


def derived_families(families: dict, labels: dict[str, str]) -> Iterable:
    """Ratios of this node's summed counters (a ratio per process would add up past 1
    over several replicas)."""
    if "candor_prefix_cache_queried_tokens" not in families:
        return
    queried = _total(families, "candor_prefix_cache_queried_tokens",
                     "candor_prefix_cache_queried_tokens_total")
    hits = _total(families, "candor_prefix_cache_hit_tokens",
                  "candor_prefix_cache_hit_tokens_total")
    yield _gauge("candor_prefix_cache_hit_ratio", "Share of looked-up prompt tokens found "
                 "in the prefix cache since start, over every engine replica of the node "
                 "(0 while the prefix cache is off)", hits / queried if queried else 0.0,
                 labels)


def vllm_families(families: dict, labels: dict[str, str]) -> Iterable:
    """vLLM's view of the Candor families (already labelled)."""
    from prometheus_client.metrics_core import CounterMetricFamily

    for source, targets in RENAMED.items():
        family = families.get(source)
        for target in targets:
            if family is not None:
                yield _with_labels(family, {}, target)
            elif source in ("candor_requests_running", "candor_requests_waiting"):
                yield _gauge(target, "see " + source, 0.0, labels)
    used = _total(families, "candor_kv_blocks_used")
    total = _total(families, "candor_kv_blocks_total")
    usage = used / total if total else 0.0
    for name in ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc"):
        yield _gauge(name, "KV-cache usage: 1 means every block is held (a fraction, "
                     "as vLLM's)", usage, labels)
    finished = {reason: 0.0 for reason in FINISHED_REASONS}
    requests = families.get("candor_http_requests")
    if requests is not None:
        for s in requests.samples:
            reason = _FINISH_MAP.get(s.labels.get("finish_reason", ""))
            if s.name.endswith("_total") and reason is not None:
                finished[reason] += s.value
    success = CounterMetricFamily("vllm:request_success", "Finished requests by "
                                  "finished_reason", labels=[*labels, "finished_reason"])
    for reason, value in finished.items():
        success.add_metric([*labels.values(), reason], value)
    yield success
    if "candor_kv_transfer_seconds" in families:  # disaggregation: every reason summed
        failed = CounterMetricFamily("vllm:nixl_num_failed_transfers", "Failed KV "
                                     "transfers, every reason (see "
                                     "candor_kv_transfer_failures_total)", labels=list(labels))
        failed.add_metric(list(labels.values()), _total(
            families, "candor_kv_transfer_failures", "candor_kv_transfer_failures_total"))
        yield failed
    lora = lora_info(families, labels)
    if lora is not None:
        yield lora


def lora_info(families: dict, labels: dict[str, str]):
    """vLLM's ``vllm:lora_requests_info``: one sample whose labels list the adapters with
    running and with waiting requests (comma-separated, every replica of this host) and
    ``max_lora``, valued the time now; None while LoRA is off."""
    slots = families.get("candor_lora_max_adapters")
    if slots is None or not slots.samples:
        return None
    counts: dict[str, set[str]] = {"running": set(), "waiting": set()}
    requests = families.get("candor_lora_requests")
    for s in requests.samples if requests is not None else ():
        if s.value > 0 and s.labels.get("state") in counts:
            counts[s.labels["state"]].add(s.labels["adapter"])
    return _gauge("vllm:lora_requests_info", "Running stats on LoRA requests (vLLM's): "
                  "adapters with running and waiting requests; the value is the time of "
                  "the stats", time.time(),
                  {**labels, "max_lora": str(int(max(s.value for s in slots.samples))),
                   "waiting_lora_adapters": ",".join(sorted(counts["waiting"])),
                   "running_lora_adapters": ",".join(sorted(counts["running"]))})


def process_families(info: NodeMetricsInfo, labels: dict[str, str]) -> Iterable:
    """process_* for every listed pid that still runs, labelled role and index."""
    from prometheus_client import ProcessCollector

    merged: dict[str, object] = {}
    for entry in info.processes:
        collector = ProcessCollector(namespace="", pid=lambda p=entry.pid: p, registry=None)
        extra = {**labels, "node": info.node, "role": entry.role, "index": str(entry.index)}
        for family in collector.collect():
            if family.name not in merged:
                merged[family.name] = _with_labels(family, extra)
            else:
                merged[family.name].samples.extend(_with_labels(family, extra).samples)
    return merged.values()


class NodeCollector:
    """Everything one scrape of this node returns (see the module docstring)."""

    def __init__(self, path: str) -> None:
        self.path = path

    def collect(self) -> Iterable:
        from prometheus_client.multiprocess import MultiProcessCollector

        info = read_node_info(self.path)
        labels = {"model_name": info.model_name} if info is not None else {}
        families = {f.name: _with_labels(f, labels)
                    for f in MultiProcessCollector(None, path=self.path).collect()}
        yield from families.values()
        yield from derived_families(families, labels)
        if info is None:
            return
        if info.compat == "vllm":
            yield from vllm_families(families, labels)
        yield from process_families(info, labels)


def render_node(path: str) -> tuple[bytes, str]:
    from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

    registry = CollectorRegistry()
    registry.register(NodeCollector(path))
    return generate_latest(registry), CONTENT_TYPE_LATEST
