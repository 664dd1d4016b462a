"""A GGUF model served by Candor (quantized tensors kept in their blocks) beside
transformers on the same file: start-up time, gpu_worker RSS, batch-1 decode tokens/s.

    python -m bench.gguf_bench [--model FILE.gguf] [--new 128] [--requests 3] [--threads 2]

Start-up is timed twice from the launcher's start to /health 200: cold (an empty GGUF
cache, so the tokenizer is converted from the metadata) and warm (the prepared directory
is there). RSS is the gpu_worker's VmRSS after a warm-up, with a 256 MiB KV cache (its
pages are written at start, so they count). tokens/s: ``--requests`` greedy chats one
after another, ``--new`` tokens each (ignore_eos); transformers runs the same token ids
through ``generate`` at batch 1 in a process of its own (fp32, ``--threads``), whose RSS
after loading is printed too. Prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from bench.rss_soak import _children, _rss_mb
from bench.servers import candor_server

QUESTIONS = ["What is the capital of France?", "Write a short poem about the sea.",
             "Explain how a bicycle works.", "Why is the sky blue?", "Name three fruits."]


def _post(url: str, body: dict) -> dict:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=600) as resp:
        return json.loads(resp.read())


def _candor(model: Path, new: int, requests: int, threads: int | None) -> tuple[dict, list[list[int]]]:
    out: dict = {}
    with tempfile.TemporaryDirectory(prefix="gguf-bench-") as cache:
        for run in ("cold", "warm"):
            srv = candor_server(model, "bench", threads, extra=["--kv-cache-memory", "256MiB"])
            srv.env["CANDOR_GGUF_CACHE"] = cache
            t0 = time.perf_counter()
            srv.start()
            try:
                srv.wait_ready(600)
                out[f"startup_{run}_s"] = round(time.perf_counter() - t0, 2)
                if run == "cold":
                    continue
                prompts, rates = [], []
                for i in range(requests + 1):  # the first is a warm-up
                    t1 = time.perf_counter()
                    body = _post(srv.url + "/v1/chat/completions", {
                        "model": "bench", "messages": [{"role": "user", "content": QUESTIONS[i % len(QUESTIONS)]}],
                        "max_tokens": new, "temperature": 0, "ignore_eos": True, "return_token_ids": True})
                    elapsed = time.perf_counter() - t1
                    if i:
                        rates.append(body["usage"]["completion_tokens"] / elapsed)
                        prompts.append(body["prompt_token_ids"])
                out["gpu_worker_rss_mb"] = round(_rss_mb(_children(srv.pid)["gpu_worker[0]"]), 1)
                out["tok_s_batch1"] = [round(r, 2) for r in rates]
            finally:
                srv.stop()
    return out, prompts


def _transformers(model: Path, prompts: list[list[int]], new: int, threads: int) -> dict:
    code = f"""
import json, sys, time, torch
from pathlib import Path
from transformers import AutoModelForCausalLM
from transformers.utils import logging
logging.disable_progress_bar()
torch.set_num_threads({threads})
path = Path({str(model)!r})
t0 = time.perf_counter()
m = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32).eval()
load = time.perf_counter() - t0
rss = next(int(l.split()[1]) for l in open("/proc/self/status") if l.startswith("VmRSS:")) / 1024
rates = []
with torch.inference_mode():
    for ids in json.loads(sys.argv[1]):
        x = torch.tensor([ids])
        t1 = time.perf_counter()
        m.generate(x, attention_mask=torch.ones_like(x), max_new_tokens={new}, min_new_tokens={new}, do_sample=False)
        rates.append({new} / (time.perf_counter() - t1))
print(json.dumps({{"load_s": round(load, 2), "rss_mb": round(rss, 1), "tok_s_batch1": [round(r, 2) for r in rates]}}))
"""
    proc = subprocess.run([sys.executable, "-c", code, json.dumps(prompts)], capture_output=True, text=True,
                          check=True)
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    from launcher.default_model import default_gguf

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", type=Path, default=None, help="a GGUF file (default: make serve's)")
    p.add_argument("--new", type=int, default=128)
    p.add_argument("--requests", type=int, default=3)
    p.add_argument("--threads", type=int, default=2, help="transformers' torch threads")
    p.add_argument("--worker-threads", type=int, default=None, help="Candor's (default: adaptive)")
    a = p.parse_args(argv)
    model = a.model or default_gguf()
    candor, prompts = _candor(model, a.new, a.requests, a.worker_threads)
    print(json.dumps({"model": str(model), "new_tokens": a.new, "candor": candor,
                      "transformers": _transformers(model, prompts, a.new, a.threads)}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
