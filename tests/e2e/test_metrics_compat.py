"""/metrics reads like vLLM's to the tools built for vLLM: every query of the community
vLLM Grafana dashboard (examples/online_serving/prometheus_grafana/grafana.json, its
expressions copied below) names a series a real scrape of Candor carries, labelled with
the model; every Candor series carries model_name; every role has process_* series; and
the vLLM names mean what vLLM means. Also what the compat view costs a scrape."""

from __future__ import annotations

import glob
import json
import os
import re
import time
import urllib.request

import pytest

from cluster import metrics_view
from tests.support.metrics_text import Scrape, scrape

MODEL = "tiny-llama"

# The community vLLM dashboard's queries ($model_name is its model variable).
VLLM_DASHBOARD = [
    'histogram_quantile(0.99, sum by(le) (rate(vllm:e2e_request_latency_seconds_bucket{model_name="$model_name"}[$__rate_interval])))',
    'rate(vllm:e2e_request_latency_seconds_sum{model_name="$model_name"}[$__rate_interval])\n/\nrate(vllm:e2e_request_latency_seconds_count{model_name="$model_name"}[$__rate_interval])',
    'rate(vllm:prompt_tokens_total{model_name="$model_name"}[$__rate_interval])',
    'rate(vllm:generation_tokens_total{model_name="$model_name"}[$__rate_interval])',
    'histogram_quantile(0.99, sum by(le) (rate(vllm:time_per_output_token_seconds_bucket{model_name="$model_name"}[$__rate_interval])))',
    'rate(vllm:time_per_output_token_seconds_sum{model_name="$model_name"}[$__rate_interval])\n/\nrate(vllm:time_per_output_token_seconds_count{model_name="$model_name"}[$__rate_interval])',
    'vllm:num_requests_running{model_name="$model_name"}',
    'vllm:num_requests_waiting{model_name="$model_name"}',
    'histogram_quantile(0.99, sum by(le) (rate(vllm:time_to_first_token_seconds_bucket{model_name="$model_name"}[$__rate_interval])))',
    'rate(vllm:time_to_first_token_seconds_sum{model_name="$model_name"}[$__rate_interval])\n/\nrate(vllm:time_to_first_token_seconds_count{model_name="$model_name"}[$__rate_interval])',
    'vllm:gpu_cache_usage_perc{model_name="$model_name"}',
    'sum by(le) (increase(vllm:request_prompt_tokens_bucket{model_name="$model_name"}[$__rate_interval]))',
    'sum by(le) (increase(vllm:request_generation_tokens_bucket{model_name="$model_name"}[$__rate_interval]))',
    'sum by(finished_reason) (increase(vllm:request_success_total{model_name="$model_name"}[$__rate_interval]))',
    'rate(vllm:request_queue_time_seconds_sum{model_name="$model_name"}[$__rate_interval])',
    'rate(vllm:request_prefill_time_seconds_sum{model_name="$model_name"}[$__rate_interval])',
    'rate(vllm:request_decode_time_seconds_sum{model_name="$model_name"}[$__rate_interval])',
    'rate(vllm:request_max_num_generation_tokens_sum{model_name="$model_name"}[$__rate_interval])',
    # its model variable
    'label_values({__name__=~"vllm:.*"},model_name)',
]
# Newer vLLM names and common alerts beyond that dashboard.
VLLM_MORE = ["vllm:kv_cache_usage_perc", "vllm:inter_token_latency_seconds_bucket",
             "vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total",
             "vllm:num_preemptions_total", "vllm:request_inference_time_seconds_sum"]
ROLES = ("launcher", "api_frontend", "tokenizer_worker", "scheduler", "gpu_worker",
         "detokenizer")
SERIES = re.compile(r"\bvllm:[a-z0-9_:]+")


def _post(server, path: str, body: dict) -> dict:
    req = urllib.request.Request(server.base_url + path, data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as resp:
        return json.loads(resp.read())


@pytest.fixture(scope="module")
def traffic(server) -> dict:
    """A few finished requests (length and stop), then the scrape before and after."""
    before = scrape(server)
    lengths = 0
    for prompt in ("the cat", "the cat sat", "a dog"):
        out = _post(server, "/v1/completions", {"model": MODEL, "prompt": prompt,
                                                "max_tokens": 4, "temperature": 0})
        lengths += out["choices"][0]["finish_reason"] == "length"
    return {"before": before, "after": scrape(server), "lengths": lengths}


def test_every_dashboard_query_has_data(traffic):
    after: Scrape = traffic["after"]
    names = sorted({n for expr in VLLM_DASHBOARD for n in SERIES.findall(expr)})
    assert len(names) >= 17
    missing = []
    for name in names + VLLM_MORE:
        if name.endswith(":"):  # the model variable's regex
            continue
        if not any(n == name and dict(ls).get("model_name") == MODEL
                   for (n, ls) in after.samples):
            missing.append(name)
    assert not missing, f"dashboard series absent from the scrape: {missing}"
    assert any(n.startswith("vllm:") and dict(ls).get("model_name") == MODEL
               for (n, ls) in after.samples)  # label_values(... model_name) finds it


def test_every_candor_series_carries_model_name(traffic):
    unlabelled = {n for (n, ls) in traffic["after"].samples
                  if n.startswith("candor_") and dict(ls).get("model_name") != MODEL}
    assert not unlabelled


def test_vllm_names_mean_what_vllm_means(traffic):
    before, after = traffic["before"], traffic["after"]
    for candor, vllm in (("candor_prompt_tokens_total", "vllm:prompt_tokens_total"),
                         ("candor_generation_tokens_total", "vllm:generation_tokens_total"),
                         ("candor_time_to_first_token_seconds_count",
                          "vllm:time_to_first_token_seconds_count")):
        assert after.total(vllm) == after.total(candor) > 0
    assert after.total("vllm:generation_tokens_total") - \
        before.total("vllm:generation_tokens_total") == 12
    grew = after.total("vllm:request_success_total", finished_reason="length") - \
        before.total("vllm:request_success_total", finished_reason="length")
    assert grew == traffic["lengths"] == 3
    # abort is 0, not absent, before the first abort (alerts need a series)
    assert ("vllm:request_success_total", (("finished_reason", "abort"),
                                           ("model_name", MODEL))) in after.samples
    usage = after.value("vllm:kv_cache_usage_perc", model_name=MODEL)
    assert 0.0 <= usage <= 1.0
    assert usage == after.value("vllm:gpu_cache_usage_perc", model_name=MODEL)
    assert after.total("vllm:request_prompt_tokens_count") - \
        before.total("vllm:request_prompt_tokens_count") == 3


def test_process_metrics_for_every_role(traffic):
    after = traffic["after"]
    roles = {dict(ls)["role"] for (n, ls) in after.samples
             if n == "process_resident_memory_bytes" and dict(ls).get("model_name") == MODEL}
    assert roles >= set(ROLES)
    worker_rss = after.total("process_resident_memory_bytes", role="gpu_worker")
    assert worker_rss > 50 * 2**20  # torch and the weights
    for name in ("process_cpu_seconds_total", "process_open_fds", "process_start_time_seconds"):
        assert after.total(name, role="scheduler") > 0, name


def test_compat_scrape_cost(server, monkeypatch):
    """The compat view is built at scrape time; measure what it adds (printed; bounded
    loosely so a slow shared box does not fail it)."""
    launcher = server.proc.pid
    (run_dir,) = [os.path.dirname(p) for p in glob.glob("/tmp/candor-*/launcher.pid")
                  if open(p).read().strip() == str(launcher)]
    path = os.path.join(run_dir, "metrics")
    info = metrics_view.read_node_info(path)
    assert info is not None and info.compat == "vllm"

    def timed(compat: str, rounds: int = 20) -> float:
        monkeypatch.setattr(metrics_view, "read_node_info",
                            lambda p: metrics_view.NodeMetricsInfo(
                                model_name=info.model_name, node=info.node, compat=compat,
                                processes=info.processes))
        metrics_view.render_node(path)
        start = time.perf_counter()
        for _ in range(rounds):
            metrics_view.render_node(path)
        return (time.perf_counter() - start) / rounds

    plain, compat = timed("none"), timed("vllm")
    plain, compat = min(plain, timed("none")), min(compat, timed("vllm"))
    print(f"scrape: {plain * 1000:.1f} ms without the vLLM names, {compat * 1000:.1f} ms "
          f"with them (+{(compat - plain) * 1000:.1f} ms)")
    assert compat < 2 * plain + 0.010
