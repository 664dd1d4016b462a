"""What a gpu_worker's memory is: RSS at each start-up stage of a ``ModelRunner`` on one
model (make serve's GGUF by default), the weights by group and dtype, the KV cache the
default sizing would give and why, and what a prefill chunk and decode steps add.

    python -m bench.worker_memory [--model FILE.gguf|DIR] [--max-model-len 2048]

Runs the runner in this process as the gpu_worker builds it (float32, the batch-
invariant default), with a two-block cache, so every stage's growth is its own: the
cache the server would allocate is reported from the sizing rule (``kv_budget``), not
allocated (its pages are all touched: zeros, so its RSS is its size).
"""

from __future__ import annotations

import argparse
import os
import time


def rss() -> dict[str, int]:
    """RssAnon, RssFile and VmHWM of this process, bytes."""
    out = {}
    with open("/proc/self/status") as fh:
        for line in fh:
            key, _, rest = line.partition(":")
            if key in ("RssAnon", "RssFile", "VmHWM", "VmRSS"):
                out[key] = int(rest.split()[0]) * 1024
    return out


def mib(n: int) -> str:
    return f"{n / 2**20:7.1f} MiB"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="a GGUF file or checkpoint directory "
                   "(default: make serve's GGUF)")
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--threads", type=int, default=1)
    a = p.parse_args(argv)
    stages: list[tuple[str, dict[str, int]]] = [("python + bench imports", rss())]

    os.environ.setdefault("MKL_CBWR", "AUTO,STRICT")  # as gpu_worker/__main__ does
    import torch
    torch.set_num_threads(a.threads)
    stages.append(("import torch", rss()))
    from gpu_worker.kv_budget import KvDemand, auto_kv_bytes, resident_bytes
    from gpu_worker.model_runner import ModelRunner
    from launcher.gguf_checkpoint import is_gguf, prepare
    from protocol.ipc import SamplingParams, SeqChunk, StepPlan
    stages.append(("import gpu_worker (model_runner, protocol)", rss()))

    model = a.model
    if model is None:
        from launcher.default_model import default_gguf
        model = str(default_gguf())
    path = str(prepare(model)) if is_gguf(model) else model
    prefill = 1024  # --max-num-batched-tokens' default: one chunk of a long prompt
    blocks = prefill // 16 + 8
    runner = ModelRunner(path, num_blocks=blocks, max_model_len=a.max_model_len,
                         max_num_seqs=a.max_num_seqs)
    kv_now = (blocks + 1) * runner.block_bytes
    stages.append((f"ModelRunner built (weights, kernels; a {blocks}-block cache = "
                   f"{kv_now / 2**20:.0f} MiB)", rss()))

    greedy = SamplingParams(temperature=0.0)
    table = list(range(blocks))
    prompt = [(7 * j) % 1000 + 3 for j in range(prefill - 8)]
    res = runner.execute(StepPlan(1, [SeqChunk("r", prompt, 0, table, True)], {"r": greedy}))
    stages.append((f"after a {len(prompt)}-token prefill chunk", rss()))
    last, pos = res.sampled[0], len(prompt)
    t0 = time.perf_counter()
    for step in range(2, 34):
        res = runner.execute(StepPlan(step, [SeqChunk("r", [last], pos, [], True,
                                                      kept_blocks=len(table))], {}))
        last, pos = res.sampled[0], pos + 1
    decode_ms = 1e3 * (time.perf_counter() - t0) / 32
    stages.append(("after 32 decode steps", rss()))
    import ctypes
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    stages.append(("after malloc_trim(0)", rss()))

    print(f"model {model}, max_model_len {a.max_model_len}, {a.threads} thread(s)")
    print(f"{'stage':<66}{'RSS':>12}{'anon':>12}{'file':>12}{'peak':>12}   growth")
    prev = 0
    for name, r in stages:
        print(f"{name:<66}{mib(r['VmRSS']):>12}{mib(r['RssAnon']):>12}{mib(r['RssFile']):>12}"
              f"{mib(r['VmHWM']):>12}   {mib(r['VmRSS'] - prev)}")
        prev = r["VmRSS"]

    groups: dict[str, int] = {}
    seen = set()
    for name, t in [*runner.model.named_parameters(), *runner.model.named_buffers()]:
        storage = t.untyped_storage()
        if storage.data_ptr() in seen:
            continue
        seen.add(storage.data_ptr())
        parts = name.removeprefix("model.").split(".")
        group = parts[0] if parts[0] != "layers" else "layers.*." + ".".join(parts[2:])
        key = f"{group} ({str(t.dtype).removeprefix('torch.')})"
        groups[key] = groups.get(key, 0) + storage.nbytes()
    print(f"\nweights and buffers: {mib(resident_bytes(runner.model))} "
          f"(each storage once)")
    for key, n in sorted(groups.items(), key=lambda kv: -kv[1])[:12]:
        print(f"  {key:<60}{mib(n)}")

    demand = KvDemand(runner.block_bytes, runner.block_size, a.max_num_seqs, runner.max_model_len,
                      resident_bytes(runner.model))
    kv, why = auto_kv_bytes(runner.device, demand, 0.9)
    print(f"\nKV cache: {runner.block_bytes / 2**10:.0f} KiB per {runner.block_size}-token block "
          f"({runner.block_bytes / runner.block_size / 2**10:.1f} KiB per token); the default "
          f"sizing gives {kv // runner.block_bytes - 1} blocks: {why}")
    import sys
    print("torch.compile's stack (torch._dynamo) imported: " + str("torch._dynamo" in sys.modules))
    print(f"batch-1 decode step here: {decode_ms:.1f} ms (mean of 32, context ~{pos})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
