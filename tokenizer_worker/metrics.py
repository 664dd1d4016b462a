"""What a tokenizer worker counts: its backlog and what became of each request."""

from __future__ import annotations

from prometheus_client import Counter, Gauge


class TokenizerMetrics:
    def __init__(self) -> None:
        self.queue_depth = Gauge(
            "candor_tokenizer_queue_depth", "Requests received by tokenizer workers and "
            "waiting to be templated and tokenized (sum over workers)",
            multiprocess_mode="livesum", registry=None)
        self.requests = Counter(
            "candor_tokenizer_requests", "Requests the tokenizer workers prepared, by "
            "outcome: ok (sent to the scheduler), rejected (400: budget, template, ids), "
            "error (the worker failed)", ["outcome"], registry=None)
