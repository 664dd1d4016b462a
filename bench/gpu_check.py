"""The GPU checks behind ``bench/gpu_check.sh``, one stage per subcommand, each writing JSON.

- ``warm``: build flashinfer's JIT kernels for the shapes below (so later stages do not
  each pay the compile), and print each start-up self-check's error against SDPA.
- ``parity``: ModelRunner on CUDA vs HF transformers on CUDA, greedy. Free-running
  tokens (first divergence per prompt) and teacher-forced logits (HF's tokens fed back:
  max |logit difference| per step, argmax agreement). Models: the tiny one (head_dim 16:
  the torch path even on CUDA), the ~100M Llama (head_dim 64, MHA) and a small GQA model
  with head_dim 128 (the 8B's kernel shapes); fp32 goes through the torch path, bf16
  through flashinfer, eager and with CUDA-graph decode. bf16 may diverge from HF's fp32
  late in a sequence: reported, not hidden.
- ``decode-bench``: a Llama-3-8B-shaped dummy model, ms per decode-only step (sampling
  included) at several batch sizes, eager vs CUDA graphs.
- ``serve``: the same model served by ``launch_cluster.py`` and loaded by ``candor bench``
  (64 streams, 512 -> 128 tokens), with graphs and with ``--enforce-eager``.
- ``tp``: the GQA head_dim-128 checkpoint served with ``--tensor-parallel-size 1`` and
  ``2`` (two GPUs, NCCL): greedy tokens of each prompt compared (first divergence; bf16
  sums in another order may diverge late: reported, not hidden) and ``candor bench``
  throughput of each. ``gpu_check.sh`` runs it only where two GPUs are visible.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import time
import traceback
from pathlib import Path

import torch

ROOT = Path(os.environ.get("CANDOR_GPU_CHECK_DIR", "/tmp/candor-gpu-check"))
DEVICE = "cuda"
NEW_TOKENS = 48
PROMPT_LENS = [1, 7, 16, 17, 64, 100, 190, 300]
ARRIVALS = [0, 0, 1, 3, 2, 5, 0, 8]


def _write(path: str, data) -> None:
    Path(path).write_text(json.dumps(data, indent=2, default=str))
    print(json.dumps(data, default=str)[:4000])


def _guarded(results: dict, key: str, fn) -> None:
    """Run one case; its failure is recorded and the others still run."""
    started = time.perf_counter()
    try:
        results[key] = fn()
    except Exception as exc:
        results[key] = {"error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc(limit=6)}
    results[key]["seconds"] = round(time.perf_counter() - started, 2)
    print(f"[{key}] {json.dumps(results[key], default=str)[:1500]}", flush=True)


def _models() -> dict[str, Path]:
    from bench.models import build_gqa_hd128, build_llama_100m, build_tiny

    tiny = build_tiny(ROOT)
    return {"tiny": tiny, "llama-100m": build_llama_100m(ROOT, tiny), "gqa-hd128": build_gqa_hd128(ROOT, tiny)}


def _backend_info(runner) -> dict:
    graphs = runner.decode_graphs
    return {"backend": runner.attn_backend.name,
            "graph_sizes": sorted(graphs.graphs) if graphs else [],
            "graph_decode_steps": graphs.steps if graphs else 0,
            "padding_rows": graphs.padding_rows if graphs else 0}


# ---------------------------------------------------------------- warm


def warm(args) -> int:
    from gpu_worker.attention.base import AttentionSpec
    from gpu_worker.attention.flashinfer_backend import FlashInferBackend

    out = {}
    for heads, kv_heads, head_dim in ((12, 12, 64), (32, 8, 128)):
        key = f"h{heads}-kv{kv_heads}-d{head_dim}"

        def check(heads=heads, kv_heads=kv_heads, head_dim=head_dim):
            b = FlashInferBackend(AttentionSpec(heads, kv_heads, head_dim, 16, torch.bfloat16,
                                                torch.device("cuda"), head_dim**-0.5))
            return {"self_check_max_err": b.self_check(), "tensor_core_decode": b.tensor_core_decode}

        _guarded(out, key, check)
    _write(args.out, out)
    return 0


# ---------------------------------------------------------------- parity


def _prompts(tiny: Path) -> list[list[int]]:
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tiny / "tokenizer.json"))
    corpus = (Path(__file__).resolve().parents[1] / "launcher/tiny_model/corpus.txt").read_text()
    ids = tok.encode(corpus, add_special_tokens=False).ids
    return [[0] + ids[997 * i: 997 * i + n - 1] for i, n in enumerate(PROMPT_LENS)]


def _hf_reference(path: Path, dtype: torch.dtype, prompts) -> dict:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(DEVICE).eval()
    model.generation_config.eos_token_id = None
    tokens, logits = [], []
    with torch.no_grad():
        for p in prompts:
            ids = torch.tensor([p], device=DEVICE)
            out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW_TOKENS,
                                 do_sample=False, output_logits=True, return_dict_in_generate=True)
            tokens.append(out.sequences[0, len(p):].tolist())
            logits.append(torch.stack([x[0].float().cpu() for x in out.logits]))
    del model
    torch.cuda.empty_cache()
    return {"tokens": tokens, "logits": logits}


def _first_divergence(got: list[int], want: list[int]) -> int | None:
    return next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), None)


def _teacher_forced(runner, prompts, ref_tokens) -> list[torch.Tensor]:
    """Our logits [NEW_TOKENS, vocab] per prompt with HF's tokens fed back: one prefill
    step for all prompts, then decode-only steps (the graph path when it is on)."""
    from protocol.ipc import SamplingParams, SeqChunk, StepPlan

    greedy = SamplingParams(temperature=0.0)
    captured: list[torch.Tensor] = []
    original = runner.sampler.sample

    def spy(logits, *a, **k):
        captured.append(logits.float().cpu())
        return original(logits, *a, **k)

    runner.sampler.sample = spy
    try:
        bs, nxt, tables = runner.block_size, 0, []
        for p in prompts:
            need = -(-(len(p) + NEW_TOKENS) // bs)
            tables.append(list(range(nxt, nxt + need)))
            nxt += need
        rids = [f"tf{i}" for i in range(len(prompts))]
        runner.execute(StepPlan(10_000, [SeqChunk(r, p, 0, t, True) for r, p, t in zip(rids, prompts, tables)],
                                {r: greedy for r in rids}))
        for t in range(NEW_TOKENS - 1):
            runner.execute(StepPlan(10_001 + t, [SeqChunk(r, [ref[t]], len(p) + t, tab, True)
                                                 for r, p, ref, tab in zip(rids, prompts, ref_tokens, tables)]))
        runner.execute(StepPlan(20_000, [], released=rids))
    finally:
        runner.sampler.sample = original
    return [torch.stack([step[i] for step in captured]) for i in range(len(prompts))]


def _parity_case(path: Path, dtype: str, eager: bool, prompts, refs: dict) -> dict:
    from gpu_worker.model_runner import ModelRunner
    from protocol.ipc import SamplingParams
    from tests.unit.gpu_worker.test_model_parity import run_continuous

    runner = ModelRunner(str(path), device=DEVICE, dtype=dtype, block_size=16, num_blocks=512,
                         enforce_eager=eager, max_num_seqs=16)
    res = {"dtype": dtype, "eager": eager, **_backend_info(runner)}
    ours = run_continuous(runner, prompts, [SamplingParams(temperature=0.0)] * len(prompts),
                          new_tokens=NEW_TOKENS, arrivals=ARRIVALS)
    for name, ref in refs.items():
        div = [_first_divergence(o, w) for o, w in zip(ours, ref["tokens"])]
        res[f"free_run_vs_{name}"] = {"all_equal": all(d is None for d in div), "first_divergence": div}
    hf32 = refs["hf_fp32"]
    tf = _teacher_forced(runner, prompts, hf32["tokens"])
    diffs = [(ours_l - ref_l).abs().amax(-1) for ours_l, ref_l in zip(tf, hf32["logits"])]
    agree = [(ours_l.argmax(-1) == torch.tensor(t)).tolist() for ours_l, t in zip(tf, hf32["tokens"])]
    res["teacher_forced_vs_hf_fp32"] = {
        "max_abs_logit_diff": max(float(d.max()) for d in diffs),
        "max_abs_logit_diff_first_step": max(float(d[0]) for d in diffs),
        "max_abs_logit_diff_decode_steps": max(float(d[1:].max()) for d in diffs),
        "logit_scale_max_abs": max(float(r.abs().max()) for r in hf32["logits"]),
        "argmax_agreement": sum(map(sum, agree)) / sum(map(len, agree)),
        "first_argmax_mismatch": [next((i for i, ok in enumerate(a) if not ok), None) for a in agree],
    }
    res.update(_backend_info(runner))  # after the runs: graph steps and padding counted
    del runner
    torch.cuda.empty_cache()
    return res


def parity(args) -> int:
    models = _models()
    prompts = _prompts(models["tiny"])
    cases = [("tiny", "float32", True), ("llama-100m", "float32", True),
             ("llama-100m", "bfloat16", True), ("llama-100m", "bfloat16", False),
             ("gqa-hd128", "bfloat16", True), ("gqa-hd128", "bfloat16", False)]
    cases = [c for c in cases if not args.only or any(o in "/".join(map(str, c)) for o in args.only)]
    results: dict = {}
    for name in dict.fromkeys(n for n, _, _ in cases):
        refs: dict = {}

        def reference(name=name, refs=refs) -> dict:
            refs["hf_fp32"] = _hf_reference(models[name], torch.float32, prompts)
            if any(n == name and d == "bfloat16" for n, d, _ in cases):
                refs["hf_bf16"] = _hf_reference(models[name], torch.bfloat16, prompts)
            return {"hf_tokens_fp32": refs["hf_fp32"]["tokens"]}

        _guarded(results, f"{name}/hf_reference", reference)
        if "hf_fp32" not in refs:
            continue
        for n, dtype, eager in cases:
            if n == name:
                wanted = {k: v for k, v in refs.items() if dtype == "bfloat16" or k == "hf_fp32"}
                _guarded(results, f"{name}/{dtype}/{'eager' if eager else 'graphs'}",
                         lambda p=models[name], d=dtype, e=eager, r=wanted: _parity_case(p, d, e, prompts, r))
        _write(args.out, results)  # after each model: a stage cut short keeps what it had
    _write(args.out, results)
    return 0


# ---------------------------------------------------------------- decode bench


def decode_bench(args) -> int:
    from bench.models import build_llama3_8b_dummy, build_tiny
    from gpu_worker.model_runner import ModelRunner
    from protocol.ipc import SamplingParams, SeqChunk, StepPlan

    path = build_llama3_8b_dummy(ROOT, build_tiny(ROOT)) if not args.small else build_tiny(ROOT)
    ctx, steps, sizes = (512, 20, [1, 8, 32, 64]) if not args.small else (40, 3, [1, 3])
    runner = ModelRunner(str(path), device=DEVICE, dtype="bfloat16", load_format="dummy", block_size=16,
                         num_blocks=64 * ((ctx + 2 * steps + 8) // 16 + 1), max_model_len=2048, max_num_seqs=64)
    res: dict = {"model": "llama3-8b-shaped dummy, bf16", "context": ctx, **_backend_info(runner), "ms_per_step": {}}
    greedy = SamplingParams(temperature=0.0)
    per_seq = (ctx + 2 * steps + 8) // 16 + 1
    graphs = runner.decode_graphs
    step_id = 0
    for n in sizes:
        rids = [f"b{n}-{i}" for i in range(n)]
        tables = [list(range(i * per_seq, (i + 1) * per_seq)) for i in range(n)]
        prompt = [300 + (i % 1000) for i in range(ctx)]
        for lo in range(0, n, 8):  # prefill in groups of 8 sequences
            runner.execute(StepPlan(step_id, [SeqChunk(r, prompt, 0, t, True) for r, t in
                                              zip(rids[lo:lo + 8], tables[lo:lo + 8])], {r: greedy for r in rids[lo:lo + 8]}))
            step_id += 1
        pos = ctx
        row = {}
        for mode in ("graphs", "eager"):
            runner.decode_graphs = graphs if mode == "graphs" else None
            if mode == "graphs" and graphs is None:
                continue
            times = []
            for i in range(3 + steps):
                plan = StepPlan(step_id, [SeqChunk(r, [400], pos, t, True) for r, t in zip(rids, tables)])
                if DEVICE == "cuda":
                    torch.cuda.synchronize()
                t0 = time.perf_counter()
                runner.execute(plan)  # returns sampled ids: synchronised
                if i >= 3:
                    times.append(1000 * (time.perf_counter() - t0))
                step_id += 1
                pos += 1
            row[mode] = round(statistics.median(times), 3)
        runner.decode_graphs = graphs
        runner.execute(StepPlan(step_id, [], released=rids))
        step_id += 1
        res["ms_per_step"][n] = row
        print(f"[decode-bench] batch {n}: {row}", flush=True)
    _write(args.out, res)
    return 0


# ---------------------------------------------------------------- serve


def serve(args) -> int:
    from bench.servers import candor_server
    from launcher.loadgen import Workload, run
    from bench.models import build_llama3_8b_dummy, build_tiny

    path = build_llama3_8b_dummy(ROOT, build_tiny(ROOT)) if not args.small else build_tiny(ROOT)
    workload = Workload(num_requests=args.requests, concurrency=64, prompt_len=(512, 512),
                        output_len=(128, 128), vocab_low=300, vocab_high=1800)
    if args.small:
        workload = Workload(num_requests=4, concurrency=4, prompt_len=(16, 16), output_len=(8, 8))
    results: dict = {"workload": vars(workload)}
    modes = [("graphs", [])] + ([] if args.graphs_only else [("eager", ["--enforce-eager"])])
    for mode, extra in modes:
        server = candor_server(path, "llama3-8b-dummy", threads=4, kv_blocks=4096, extra=[
            "--dtype", "bfloat16", "--device", DEVICE, "--load-format", "dummy", "--max-num-seqs", "64",
            "--max-num-batched-tokens", "8192", *extra])
        # candor_server sets PYTHONPATH to the repo alone: keep the carried wheels' folder.
        server.env["PYTHONPATH"] = os.pathsep.join(filter(None, [server.env["PYTHONPATH"],
                                                                 os.environ.get("PYTHONPATH")]))

        def one(server=server) -> dict:
            started = time.perf_counter()
            server.start()
            try:
                server.wait_ready(300)
                ready_s = time.perf_counter() - started
                summary = asyncio.run(run(server.url, "llama3-8b-dummy", workload))
                return {"ready_s": round(ready_s, 1), **summary}
            finally:
                server.stop()
                log = server.log_path.read_text(errors="replace").splitlines()
                keep = [ln for ln in log if any(w in ln for w in ("attention", "CUDA graph", "captured",
                                                                  "Error", "error", "Traceback"))]
                results.setdefault("server_log", {})[server.name + "-" + str(server.port)] = (keep + log[-15:])[-60:]

        _guarded(results, mode, one)
        _write(args.out, results)
    return 0


# ---------------------------------------------------------------- tensor parallel


def _greedy_ids(url: str, name: str, prompt: list[int], n: int) -> list[int]:
    import urllib.request
    body = {"model": name, "prompt": prompt, "max_tokens": n, "temperature": 0,
            "ignore_eos": True, "return_token_ids": True}
    req = urllib.request.Request(url + "/v1/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as resp:
        return json.loads(resp.read())["choices"][0]["token_ids"]


def tensor_parallel(args) -> int:
    from bench.servers import candor_server
    from launcher.loadgen import Workload, run
    from bench.models import build_gqa_hd128, build_tiny

    tiny = build_tiny(ROOT)
    path, name = (tiny, "tiny") if args.small else (build_gqa_hd128(ROOT, tiny), "gqa-hd128")
    dtype = "float32" if DEVICE == "cpu" else "bfloat16"
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(300, 1800, (n,), generator=g).tolist() for n in (7, 64, 300)]
    workload = Workload(num_requests=4 if args.small else 64, concurrency=4 if args.small else 32,
                        prompt_len=(128, 128), output_len=(32, 32), vocab_low=300, vocab_high=1800)
    results: dict = {"model": name, "dtype": dtype}
    tokens: dict[int, list[list[int]]] = {}
    for tp in (1, 2):
        server = candor_server(path, name, threads=1 if DEVICE == "cpu" else 4, kv_blocks=2048, extra=[
            "--dtype", dtype, "--device", DEVICE, "--tensor-parallel-size", str(tp)])
        server.env["PYTHONPATH"] = os.pathsep.join(filter(None, [server.env["PYTHONPATH"],
                                                                 os.environ.get("PYTHONPATH")]))

        def one(server=server, tp=tp) -> dict:
            server.start()
            try:
                server.wait_ready(300)
                tokens[tp] = [_greedy_ids(server.url, name, p, NEW_TOKENS) for p in prompts]
                return asyncio.run(run(server.url, name, workload))
            finally:
                server.stop()
                log = server.log_path.read_text(errors="replace").splitlines()
                results.setdefault("server_log", {})[f"tp{tp}"] = log[-20:]

        _guarded(results, f"tp{tp}", one)
    if 1 in tokens and 2 in tokens:
        firsts = []
        for a, b in zip(tokens[1], tokens[2]):
            firsts.append(next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None))
        results["first_divergence_per_prompt"] = firsts
        results["identical"] = all(f is None for f in firsts)
    _write(args.out, results)
    return 0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("stage", choices=["warm", "parity", "decode-bench", "serve", "tp"])
    p.add_argument("--out", required=True)
    p.add_argument("--requests", type=int, default=128)
    p.add_argument("--graphs-only", action="store_true")
    p.add_argument("--only", nargs="*", help="parity cases whose name/dtype contains one of these")
    p.add_argument("--device", default="cuda", help="cpu: a dry run of this script's own code")
    p.add_argument("--small", action="store_true", help="the tiny model instead of the 8B shape (dry runs)")
    args = p.parse_args()
    global DEVICE
    DEVICE = args.device
    ROOT.mkdir(parents=True, exist_ok=True)
    stage = {"warm": warm, "parity": parity, "decode-bench": decode_bench, "serve": serve,
             "tp": tensor_parallel}[args.stage]
    try:
        return stage(args)
    except Exception as exc:  # say why in the stage's file, unless it already holds results
        if not Path(args.out).exists():
            _write(args.out, {"error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc(limit=8)})
        raise


if __name__ == "__main__":
    raise SystemExit(main())
