"""Prometheus plumbing shared by every role: one scrape per host covers every process.

Why multiprocess mode rather than shipping stats to the frontend: each process records
its own events where they happen (the scheduler its queue and step times, a frontend its
requests), with no extra messages on the hot path and no aggregation code of ours. The
launcher gives each node a fresh directory (``PROMETHEUS_MULTIPROC_DIR``, set in the
children's environment before they import the library) and deletes it at stop; a scrape
of any frontend, or of the launcher's ``metrics_port``, merges every file in it. Each
frontend counts only the requests it served, so with several frontends the merged
counters are the true totals, whichever frontend is scraped. Gauges choose how to merge
across processes (``livesum``/``livemax``) and the launcher marks a dead child's files so
its gauges drop out. Across hosts, each node has its own directory and is scraped on its
own: scheduler metrics come from the node that runs the scheduler.
"""

from __future__ import annotations

import os
import shutil

# prometheus_client is imported inside the functions below: it picks its (multiprocess
# or in-memory) value class once, at import, and the launcher imports this module
# before it sets ENV for itself.

ENV = "PROMETHEUS_MULTIPROC_DIR"

# Latency buckets in seconds: sub-millisecond CPU steps up to multi-minute generations.
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0,
                   10.0, 30.0, 60.0, 120.0, 300.0)
# Token counts per request: 1 to 128k, roughly x2.5 apart (vLLM's 1-2-5 series)
TOKEN_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000,
                 100000, 200000)
STEP_BUCKETS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0,
                5.0)


def prepare_dir(path: str) -> str:
    """A fresh, empty directory: stale files from an earlier run would add up."""
    shutil.rmtree(path, ignore_errors=True)
    os.makedirs(path)
    return path


def process_exited(path: str, pid: int) -> None:
    """Drop a dead process's live gauges (its counters and histograms stay counted)."""
    from prometheus_client.multiprocess import mark_process_dead

    mark_process_dead(pid, path)


def dropped_messages(role: str):
    """What counts one undecodable frame a ``Receiver`` of this ``role``'s process
    dropped (``protocol.transport``), as ``candor_ipc_dropped_messages_total{role}``."""
    from prometheus_client import Counter

    return Counter("candor_ipc_dropped_messages", "Messages a process received but could "
                   "not decode and dropped (garbage, a stranger, a version mismatch); the "
                   "process logs which socket", ["role"], registry=None).labels(role).inc


class KvTransferMetrics:
    """Prompt KV moved between replicas (disaggregation); each side counts its own:
    bytes sent (prefill) and received (decode), the transfer time on arrival, and every
    transfer that failed, by reason (the decode side then recomputes the prompt). One
    instance per process: two would write over each other's multiprocess values."""

    def __init__(self) -> None:
        from prometheus_client import Counter, Histogram

        self.bytes = Counter("candor_kv_transfer_bytes", "Prompt KV bytes moved between "
                             "replicas, by direction (sent | received)", ["direction"],
                             registry=None)
        self.seconds = Histogram("candor_kv_transfer_seconds", "From a prefill rank "
                                 "starting a KV export to the decode rank holding it, checked",
                                 buckets=LATENCY_BUCKETS, registry=None)
        self.failures = Counter("candor_kv_transfer_failures", "KV transfers that failed "
                                "(the decode replica recomputed the prompt), by reason",
                                ["reason"], registry=None)


class KvStoreMetrics:
    """The shared KV store's resident bytes per tier (its own process)."""

    def __init__(self) -> None:
        from prometheus_client import Counter, Gauge

        self.bytes = Gauge("candor_kv_store_bytes", "Bytes of KV blocks the shared KV store "
                           "holds, by tier (memory | disk)", ["tier"], registry=None,
                           multiprocess_mode="livesum")
        self.written = Counter("candor_kv_store_written_blocks", "KV blocks written into "
                               "the shared KV store (ones it did not hold)", registry=None)
        self.blocks = Gauge("candor_kv_store_blocks", "KV blocks (one TP rank's shard each) "
                            "the shared KV store holds, by tier", ["tier"], registry=None,
                            multiprocess_mode="livesum")


class KvStoreReadMetrics:
    """What a scheduler's lookups in the shared KV store found, in blocks (of the engine's
    block size): a hit is a block imported instead of computed; a miss is a block looked
    up and not served (not held, the store dead or slow, the import refused)."""

    def __init__(self) -> None:
        from prometheus_client import Counter

        self.hits = Counter("candor_kv_store_hits", "Prompt KV blocks served from the "
                            "shared KV store (blocks, not tokens)", registry=None)
        self.misses = Counter("candor_kv_store_misses", "Prompt KV blocks looked up in the "
                              "shared KV store and computed instead (blocks, not tokens)",
                              registry=None)



def render(path: str) -> tuple[bytes, str]:
    """The exposition text of every process that wrote into ``path``, labelled with the
    model, plus vLLM's names and per-role process metrics (cluster/metrics_view.py)."""
    from cluster.metrics_view import render_node

    return render_node(path)
