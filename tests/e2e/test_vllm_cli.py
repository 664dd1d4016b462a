"""`candor serve` takes vLLM's command line where the meaning is the same: the mapping of
each flag onto the topology (unit), the Hugging Face cache lookup, the nearest-flag
message, and two real servers started with vLLM-style command lines from
docs/migrating-from-vllm.md (aliases, CORS, generation-config defaults, KV sizing)."""

from __future__ import annotations

import json
import os
import re
import shutil
import sys
import urllib.request
from pathlib import Path

import pytest

from cluster.generation_config import GenerationConfigError, sampling_defaults
from launcher.hf_cache import ModelNotFound, hub_cache_dir, resolve_model
from launcher.preflight import settle_defaults
from launcher.serve_cli import normalize_argv, parse_size, serve_parser
from launch_cluster import serve_args_to_topology
from tests.support.server import REPO, CandorServer

DOC = REPO / "docs" / "migrating-from-vllm.md"
REV = "0123456789abcdef0123456789abcdef01234567"


def make_hub_cache(root: Path, repo_id: str, checkpoint: Path, gen: dict | None = None) -> Path:
    """The hub cache layout huggingface_hub writes: blobs, a snapshot of symlinks (here:
    copies), refs/main naming the snapshot."""
    repo = root / "hub" / ("models--" + repo_id.replace("/", "--"))
    snap = repo / "snapshots" / REV
    snap.mkdir(parents=True)
    for f in checkpoint.iterdir():
        shutil.copy(f, snap / f.name)
    if gen is not None:
        cfg = json.loads((snap / "generation_config.json").read_text())
        (snap / "generation_config.json").write_text(json.dumps({**cfg, **gen}))
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(REV)
    return snap


def doc_commands(marker: str) -> list[list[str]]:
    """The ``candor serve`` lines of the doc's block tagged ``marker`` (an HTML comment
    before the block), as argv after ``serve``."""
    import shlex

    text = DOC.read_text()
    block = re.search(rf"<!-- {marker} -->\s*```bash\n(.*?)```", text, re.S)
    assert block, f"no block {marker} in {DOC}"
    lines = block.group(1).replace("\\\n", " ").splitlines()
    return [shlex.split(line)[2:] for line in lines if line.startswith("candor serve")]


# ------------------------------------------------------------------ argument mapping


def test_vllm_flags_map_onto_the_topology(tiny_model_dir):
    topo, args = serve_args_to_topology(
        [str(tiny_model_dir), "--served-model-name", "a", "b", "--seed", "7",
         "--gpu-memory-utilization", "0.5", "--no-enable-prefix-caching",
         "--generation-config", "vllm", "--disable-log-requests", "--log-level", "debug",
         "--uvicorn-log-level", "trace", "--allowed-origins", '["http://x.example"]',
         "--dtype", "half", "--max_model_len", "512", "--kv-cache-memory", "2GiB",
         "--api-key", "k1", "--scheduling-policy", "priority"], environ={})
    assert topo.model.names() == ["a", "b"]
    assert topo.model.path == str(tiny_model_dir)
    assert topo.engine.seed == 7 and topo.engine.gpu_memory_utilization == 0.5
    assert topo.engine.enable_prefix_caching is False
    assert topo.engine.kv_cache_memory_mb == 2048
    assert topo.engine.device == "auto"
    assert topo.model.generation_config == "vllm" and topo.model.dtype == "half"
    assert topo.model.max_model_len == 512
    assert topo.http.cors.allowed_origins == ["http://x.example"]
    assert topo.http.server_log_level == "trace" and topo.http.log_requests is False
    assert args.log_level == "debug" and args.api_key == ["k1"]
    assert topo.api.scheduling_policy == "priority"


def test_defaults_and_legacy_spellings(tiny_model_dir):
    topo, _ = serve_args_to_topology(["--model", str(tiny_model_dir), "--no-prefix-caching"],
                                     environ={})
    assert topo.engine.enable_prefix_caching is False
    assert topo.model.names() == [tiny_model_dir.name]  # a directory: its basename
    assert topo.engine.kv_cache_memory_mb is None  # sized by the gpu_worker
    assert topo.api.scheduling_policy == "fcfs"  # arrival order: `priority` is a 400
    topo, _ = serve_args_to_topology([str(tiny_model_dir), "--enable-prefix-caching"],
                                     environ={"VLLM_CPU_KVCACHE_SPACE": "1.5"})
    assert topo.engine.enable_prefix_caching is True
    assert topo.engine.kv_cache_memory_mb == 1536
    assert topo.http.cors.allowed_origins == []


def test_image_limit_flags(tiny_model_dir, capsys):
    """vLLM's --limit-mm-per-prompt (its JSON; vLLM 0.10's {"count": N} too) and Candor's
    byte and pixel limits land in api.limits; another modality may only be 0."""
    topo, _ = serve_args_to_topology(
        [str(tiny_model_dir), "--limit-mm-per-prompt", '{"image": 3, "video": 0}',
         "--max-image-bytes", "2MiB", "--max-image-pixels", "1000000"], environ={})
    limits = topo.api.limits
    assert (limits.max_images_per_prompt, limits.max_image_bytes, limits.max_image_pixels) == \
        (3, 2 << 20, 1_000_000)
    topo, _ = serve_args_to_topology(
        [str(tiny_model_dir), "--limit-mm-per-prompt", '{"image": {"count": 0}}'], environ={})
    assert topo.api.limits.max_images_per_prompt == 0
    with pytest.raises(SystemExit):
        serve_args_to_topology([str(tiny_model_dir), "--limit-mm-per-prompt", '{"audio": 1}'],
                               environ={})
    assert "takes images only; 'audio' can only be 0" in capsys.readouterr().err


def test_media_url_flags(tiny_model_dir, capsys):
    """vLLM's --allowed-media-domains (space- or comma-separated, or JSON) and Candor's
    fetch timeout and redirect count land in api.limits; off by default; a URL where a
    host belongs is refused at start, naming the entry."""
    topo, _ = serve_args_to_topology([str(tiny_model_dir)], environ={})
    assert topo.api.limits.allowed_media_domains == []
    assert topo.api.limits.media_fetch_timeout_s == 10.0
    topo, _ = serve_args_to_topology(
        [str(tiny_model_dir), "--allowed-media-domains", "Images.Example.com,127.0.0.1",
         '["cdn.example.org"]', "--media-fetch-timeout", "2.5", "--media-max-redirects", "0"],
        environ={})
    limits = topo.api.limits
    assert limits.allowed_media_domains == ["images.example.com", "127.0.0.1", "cdn.example.org"]
    assert (limits.media_fetch_timeout_s, limits.media_max_redirects) == (2.5, 0)
    with pytest.raises(SystemExit):
        serve_args_to_topology([str(tiny_model_dir), "--allowed-media-domains",
                                "https://example.com/"], environ={})
    assert "'https://example.com/' is not a host name" in capsys.readouterr().err


def test_allowed_local_media_path(tiny_model_dir, tmp_path, capsys):
    """vLLM's --allowed-local-media-path lands in api.limits as the directory's real path
    (a symlink to it resolved); off by default; a path that is no directory is refused at
    start."""
    topo, _ = serve_args_to_topology([str(tiny_model_dir)], environ={})
    assert topo.api.limits.allowed_local_media_path == ""
    (tmp_path / "media").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "media")
    topo, _ = serve_args_to_topology(
        [str(tiny_model_dir), "--allowed-local-media-path", str(tmp_path / "link")], environ={})
    assert topo.api.limits.allowed_local_media_path == str((tmp_path / "media").resolve())
    with pytest.raises(SystemExit):
        serve_args_to_topology([str(tiny_model_dir), "--allowed-local-media-path",
                                str(tmp_path / "nowhere")], environ={})
    assert "is not a directory" in capsys.readouterr().err


def test_runner_and_its_task_alias(tiny_model_dir, capsys):
    """vLLM's --runner pooling, and --task embed as its older spelling; they must agree;
    a task Candor does not serve names the ones it does."""
    topo, _ = serve_args_to_topology([str(tiny_model_dir)], environ={})
    assert topo.model.runner == "auto" and topo.model.runner_kind() == "generate"
    for flags in (["--runner", "pooling"], ["--task", "embed"], ["--task", "embedding"],
                  ["--task", "embed", "--runner", "pooling"], ["--task", "classify"],
                  ["--task", "score"]):
        topo, _ = serve_args_to_topology([str(tiny_model_dir), *flags], environ={})
        assert topo.model.runner_kind() == "pooling", flags
    for flags, says in ((["--task", "embed", "--runner", "generate"], "give one"),
                        (["--task", "reward"], "auto, generate, embed, classify, score")):
        with pytest.raises(SystemExit):
            serve_args_to_topology([str(tiny_model_dir), *flags], environ={})
        assert says in capsys.readouterr().err


@pytest.mark.parametrize("flags,mode", [((), None), (("--deterministic",), True),
                                        (("--no-deterministic",), False)])
def test_deterministic_is_on_where_supported_required_or_off(tiny_model_dir, flags, mode):
    """Unset: batch-invariant kernels where the device has them; --deterministic: a
    worker without them refuses to start; --no-deterministic: the fast kernels."""
    topo, _ = serve_args_to_topology([str(tiny_model_dir), *flags], environ={})
    assert topo.engine.deterministic is mode


@pytest.mark.parametrize("text,expected", [("4GiB", 4 * 2**30), ("512MiB", 512 * 2**20),
                                           ("2G", 2 * 10**9), ("1024", 1024),
                                           ("1.5 gib", int(1.5 * 2**30))])
def test_parse_size(text, expected):
    assert parse_size(text) == expected


def test_underscored_flags_are_vllms_spelling():
    assert normalize_argv(["--max_model_len=5", "--served_model_name", "a_b", "x_y"]) == \
        ["--max-model-len=5", "--served-model-name", "a_b", "x_y"]


@pytest.mark.parametrize("flag,nearest", [("--gpu-mem-utilization", "--gpu-memory-utilization"),
                                          ("--enable-prefix-cache", "--enable-prefix-caching"),
                                          ("--served-model", "--served-model-name"),
                                          ("--max-num-seq", "--max-num-seqs")])
def test_unknown_flag_names_the_nearest(flag, nearest, capsys):
    with pytest.raises(SystemExit) as exc:
        serve_parser().parse_args([flag, "1"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert f"unknown flag {flag}; did you mean {nearest}?" in err
    assert "docs/migrating-from-vllm.md" in err
    assert "usage:" not in err  # one message, not forty lines of usage


def test_vllm_flag_with_another_home_says_where(capsys):
    with pytest.raises(SystemExit):
        serve_parser().parse_args(["--trust-remote-code"])
    assert "never runs code from a checkpoint" in capsys.readouterr().err


def test_lora_flags_map_onto_the_topology(tiny_model_dir, tmp_path, capsys):
    """vLLM's LoRA flags: --lora-modules as name=path and as JSON, the limits, and the
    runtime-loading switch (flag or VLLM_ALLOW_RUNTIME_LORA_UPDATING)."""
    qv = {"name": "qv", "path": str(tmp_path / "b" / "qv"), "base_model_name": "base"}
    argv = [str(tiny_model_dir), "--enable-lora", "--lora-modules", f"sql={tmp_path}/a/sql",
            json.dumps(qv), "--max-loras", "3", "--max-lora-rank", "32", "--max-cpu-loras", "5"]
    topo, _ = serve_args_to_topology(argv, environ={})
    lora = topo.model.lora
    assert lora.enabled and (lora.max_loras, lora.max_lora_rank, lora.max_cpu_loras) == (3, 32, 5)
    assert [(m.name, m.path, m.base_model_name) for m in lora.modules] == [
        ("sql", f"{tmp_path}/a/sql", None), ("qv", qv["path"], "base")]
    assert not lora.allow_runtime_updates
    assert lora.allowed_roots() == [str(tmp_path / "a"), str(tmp_path / "b")]
    env_on, _ = serve_args_to_topology(argv, environ={"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True"})
    assert env_on.model.lora.allow_runtime_updates
    flag_on, _ = serve_args_to_topology(argv + ["--allow-runtime-lora-updating",
                                                "--lora-allowed-dirs", "/srv/a,/srv/b"], environ={})
    assert flag_on.model.lora.allow_runtime_updates
    assert flag_on.model.lora.allowed_roots() == ["/srv/a", "/srv/b"]
    for bad, says in ((["--lora-modules", "x=/a"], "--lora-modules needs --enable-lora"),
                      (["--enable-lora", "--lora-modules", "no-equals"], "expected NAME=PATH"),
                      (["--enable-lora", "--lora-modules", '{"name": "x"}'], "expected {"),
                      (["--enable-lora", "--max-loras", "0"], "max_loras")):
        with pytest.raises(SystemExit):
            serve_args_to_topology([str(tiny_model_dir), *bad], environ={})
        assert says in capsys.readouterr().err, bad


def test_worker_threads_adaptive_unless_chosen(tiny_model_dir, monkeypatch, capsys):
    """Unset, the worker's governor follows the idle cores (the launcher says so and
    fixes nothing); --worker-threads or OMP_NUM_THREADS fix the count."""
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(16)))
    topo, _ = serve_args_to_topology([str(tiny_model_dir), "--tokenizer-workers", "3"],
                                     environ={})
    node = topo.effective_nodes()[0]
    assert settle_defaults(topo, node).engine.worker_threads is None
    assert "gpu_worker threads: adaptive, 1 to 16 (the cores the other processes leave idle" \
        in capsys.readouterr().err
    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    assert settle_defaults(topo, node).engine.worker_threads is None  # the worker reads it
    assert "gpu_worker threads: 2 (OMP_NUM_THREADS)" in capsys.readouterr().err
    topo, _ = serve_args_to_topology([str(tiny_model_dir), "--worker-threads", "3"],
                                     environ={})
    assert settle_defaults(topo, node).engine.worker_threads == 3


# ------------------------------------------------------------------ the hub cache


def test_repo_id_resolves_from_hf_home(tmp_path, tiny_model_dir):
    snap = make_hub_cache(tmp_path, "org/tiny", tiny_model_dir)
    got = resolve_model("org/tiny", environ={"HF_HOME": str(tmp_path)})
    assert Path(got.path) == snap and got.repo_id == "org/tiny" and got.revision == REV
    # HF_HUB_CACHE wins over HF_HOME, as in huggingface_hub
    assert hub_cache_dir({"HF_HOME": "/nope", "HF_HUB_CACHE": str(tmp_path / "hub")}) == \
        str(tmp_path / "hub")
    topo, _ = serve_args_to_topology(["org/tiny"], environ={"HF_HOME": str(tmp_path)})
    assert topo.model.names() == ["org/tiny"]  # vLLM's default served name: MODEL as given


def test_absent_repo_id_names_where_it_looked(tmp_path):
    with pytest.raises(ModelNotFound) as exc:
        resolve_model("org/absent", environ={"HF_HUB_CACHE": str(tmp_path / "cache")})
    message = str(exc.value)
    assert str(tmp_path / "cache" / "models--org--absent") in message
    assert "does not download" in message
    with pytest.raises(ModelNotFound, match="not a directory"):
        resolve_model("/no/such/dir", environ={})


def test_absent_model_is_one_line_from_the_cli(tmp_path):
    import subprocess
    out = subprocess.run([sys.executable, str(REPO / "launch_cluster.py"), "serve",
                          "org/absent"], capture_output=True, text=True, timeout=60,
                         env={**os.environ, "HF_HOME": str(tmp_path)}, cwd=REPO)
    assert out.returncode == 2
    assert "models--org--absent" in out.stderr and "Traceback" not in out.stderr


def test_generation_config_modes(tmp_path, tiny_model_dir):
    snap = make_hub_cache(tmp_path, "org/g", tiny_model_dir,
                          {"temperature": 0.6, "top_p": 0.9, "top_k": 20, "do_sample": True})
    d = sampling_defaults("auto", str(snap))
    assert d.items() == {"temperature": 0.6, "top_p": 0.9, "top_k": 20}
    assert "generation_config.json" in d.source
    assert sampling_defaults("vllm", str(snap)).items() == {}
    assert sampling_defaults("none", str(snap)).items() == {}
    assert sampling_defaults(str(snap), str(tiny_model_dir)).items()["top_k"] == 20
    assert sampling_defaults("auto", str(tiny_model_dir)).items() == {}  # no sampling keys
    with pytest.raises(GenerationConfigError, match="no generation_config.json"):
        sampling_defaults(str(tmp_path), str(tiny_model_dir))


# ------------------------------------------------------------------ real servers


def _post(srv: CandorServer, path: str, body: dict, headers: dict | None = None):
    req = urllib.request.Request(srv.base_url + path, data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json",
                                          **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=60) as resp:
            return resp.status, json.loads(resp.read()), dict(resp.headers)
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read()), dict(err.headers)


def _server_from_doc(argv: list[str], env: dict[str, str]) -> CandorServer:
    srv = CandorServer("unused", env=env)
    srv.cmd = [sys.executable, str(REPO / "launch_cluster.py"), "serve", *argv,
               "--port", str(srv.port)]
    return srv


@pytest.fixture(scope="module")
def hub_server(tmp_path_factory, tiny_model_dir):
    """The doc's first CPU command line, a repo id from the HF cache, greedy by the
    checkpoint's generation_config.json."""
    home = tmp_path_factory.mktemp("hf-home")
    make_hub_cache(home, "candor-test/tiny-llama", tiny_model_dir,
                   {"temperature": 0.0, "top_k": 5})
    (argv,) = doc_commands("cpu-hub")
    srv = _server_from_doc(argv, {"HF_HOME": str(home)}).start()
    yield srv
    assert srv.stop() == 0


def test_served_model_name_aliases(hub_server):
    status, body = hub_server.get("/v1/models")
    assert status == 200
    assert [m["id"] for m in json.loads(body)["data"]] == ["tiny-llama", "tiny"]
    for name in ("tiny-llama", "tiny"):
        status, out, _ = _post(hub_server, "/v1/completions",
                               {"model": name, "prompt": "hello", "max_tokens": 3})
        assert status == 200 and out["model"] == name  # the name the client used
    status, out, _ = _post(hub_server, "/v1/completions",
                           {"model": "candor-test/tiny-llama", "prompt": "x", "max_tokens": 1})
    assert status == 404 and "'tiny'" in out["error"]["message"]


def test_generation_config_defaults_apply_and_are_reported(hub_server):
    body = {"model": "tiny", "prompt": "the cat", "max_tokens": 8}
    _, first, _ = _post(hub_server, "/v1/completions", body)
    _, second, _ = _post(hub_server, "/v1/completions", body)
    _, greedy, _ = _post(hub_server, "/v1/completions", {**body, "temperature": 0})
    assert first["choices"][0]["text"] == second["choices"][0]["text"] == \
        greedy["choices"][0]["text"]
    notes = {n["field"]: n for n in first["candor"]["defaults"]}
    assert notes["temperature"]["to"] == 0.0 and notes["top_k"]["to"] == 5
    assert "generation_config.json" in notes["temperature"]["reason"]
    # a field the client sent is its own, and not reported as a default
    assert "temperature" not in {n["field"] for n in greedy["candor"].get("defaults", [])}


def test_cors_preflight_and_headers(hub_server):
    req = urllib.request.Request(
        hub_server.base_url + "/v1/chat/completions", method="OPTIONS",
        headers={"Origin": "http://ui.example", "Access-Control-Request-Method": "POST",
                 "Access-Control-Request-Headers": "authorization, content-type"})
    with urllib.request.urlopen(req, timeout=10) as resp:
        assert resp.status == 204
        assert resp.headers["Access-Control-Allow-Origin"] == "http://ui.example"
        assert "POST" in resp.headers["Access-Control-Allow-Methods"]
        assert "authorization" in resp.headers["Access-Control-Allow-Headers"]
    _, _, headers = _post(hub_server, "/v1/completions",
                          {"model": "tiny", "prompt": "a", "max_tokens": 1},
                          {"Origin": "http://ui.example"})
    assert headers["Access-Control-Allow-Origin"] == "http://ui.example"
    _, _, headers = _post(hub_server, "/v1/completions",
                          {"model": "tiny", "prompt": "a", "max_tokens": 1},
                          {"Origin": "http://evil.example"})
    assert "Access-Control-Allow-Origin" not in headers


def test_second_doc_command_line_serves(tmp_path, tiny_model_dir):
    """The doc's second CPU line: a directory, vLLM's CPU KV variable, prefix caching
    off, the API's own sampling defaults."""
    (argv,) = doc_commands("cpu-dir")
    argv = [str(tiny_model_dir) if a == "/models/tiny-llama" else a for a in argv]
    srv = _server_from_doc(argv, {"VLLM_CPU_KVCACHE_SPACE": "0.0625"}).start()
    try:
        cfg = json.loads((tiny_model_dir / "config.json").read_text())
        head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
        block_bytes = 2 * cfg["num_hidden_layers"] * 16 * cfg["num_key_value_heads"] * \
            head_dim * 4
        assert srv.engine_stats()["total_blocks"] == 64 * 2**20 // block_bytes - 1
        status, out, _ = _post(srv, "/v1/completions",
                               {"model": "tiny-llama", "prompt": "hello", "max_tokens": 2})
        assert status == 200 and "defaults" not in out["candor"]
        status, _, _ = _post(srv, "/v1/completions",
                             {"model": "tiny-llama", "prompt": "hello", "max_tokens": 2})
        from tests.support.metrics_text import scrape
        from tests.support.polling import wait_until

        # prefix counters are exported with the heartbeat that carries both requests' steps
        after = wait_until(lambda: scrape(srv), "a heartbeat after both requests' four steps",
                           until=lambda s: s.total("candor_scheduler_steps_total") >= 4)
        assert after.total("candor_prefix_cache_queried_tokens_total") == 0
    finally:
        assert srv.stop() == 0


def test_bench_says_why_requests_failed(capsys):
    """`candor bench` against a port where nothing listens: every request fails, and the
    table says why, counted by reason."""
    from launcher.loadgen import main as bench_main
    from tests.support.server import free_port

    code = bench_main(["--base-url", f"http://127.0.0.1:{free_port()}", "--num-requests",
                       "3", "--concurrency", "3", "--prompt-len", "4", "--output-len", "2"])
    out = capsys.readouterr().out
    assert code == 1
    assert "why 3 requests failed:" in out
    assert re.search(r"\s3 x .*(Connect|refused)", out), out


def test_weight_loading_and_kv_allocation_report_progress(tiny_model_dir, caplog, monkeypatch):
    """Periodic lines with percent and MB/s while weights load and the KV cache is
    allocated (interval 0 here, so every tensor and layer logs), and a final line."""
    import logging

    from gpu_worker import progress
    from gpu_worker.model_runner import ModelRunner

    monkeypatch.setattr(progress.Progress.__init__, "__defaults__", (0.0, None))
    with caplog.at_level(logging.INFO, logger="gpu_worker.progress"):
        ModelRunner(str(tiny_model_dir), num_blocks=64)
    lines = [r.getMessage() for r in caplog.records if r.name == "gpu_worker.progress"]
    loading = [m for m in lines if m.startswith("loading weights")]
    assert len(loading) > 2 and loading[-1].startswith("loading weights done: 100%")
    assert all(re.search(r"\d+% \(\d+ of \d+ MB\) at \d+ MB/s", m) for m in loading)
    assert any(m.startswith("allocating the KV cache done: 100%") for m in lines)
