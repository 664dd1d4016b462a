"""Quantized weights against the fp32 path: matmul speed, and worker memory.

    python -m bench.quant_bench matmul [--threads N] [--shapes smollm2|llama7b] [--reps R]
                                       [--rows 1,16] [--kinds fp32,Q4_1] [--from-memory]
    python -m bench.quant_bench rss [--root DIR]

``matmul``: each quantized kernel (GGUF types, group-wise int4, FP8) and the fp32 path the
dense layers run (oneDNN on a packed weight, as ``Numerics`` serves) over a model's linear
layers (SmolLM2-135M's or a Llama-7B layer's shapes): ms per call, the weight's GB/s,
GFLOP/s, and the tokens per second that model's matmuls alone would allow at each
``--rows`` count (a step of that many rows through every layer: 1 and 16 are decode
batches, hundreds a prefill chunk's), with the ratio to fp32. Q4_0 / Q4_1 / Q8_0 run in the
packed layout where the kernel packs them, as a served layer holds them. By default one
weight per layer is called again and again (in cache: the kernel's own rate);
``--from-memory`` holds one per model layer and calls them in turn, as a decode step
reads them.

``rss``: a ~100M-parameter Llama (``bench.models``) served in fp32, as GGUF Q4_1 blocks
and as GPTQ int4 / FP8 / W8A8 checkpoints (tests' writers: run from a checkout): each in a
fresh process, the resident memory a ``ModelRunner`` adds over the imports (with the
KV cache made small) beside the bytes its weights hold.
"""

from __future__ import annotations

import argparse
import itertools
import json
import subprocess
import sys
import time
from pathlib import Path

# (name, out, in, per layer) of each model's linear layers; the LM head once
SHAPES = {
    "smollm2": dict(layers=30, mats=[("qkv", 960, 576), ("o", 576, 576), ("gate_up", 3072, 576),
                                     ("down", 576, 1536)], head=(49152, 576)),
    "llama7b": dict(layers=32, mats=[("qkv", 12288, 4096), ("o", 4096, 4096), ("gate_up", 22016, 4096),
                                     ("down", 4096, 11008)], head=(32000, 4096)),
}
KINDS = ("fp32", "Q8_0", "Q4_0", "Q4_1", "Q5_1", "Q4_K", "Q6_K", "int4-g64", "fp8-channel")


def _weights(kind: str, n: int, k: int, copies: int = 1):
    """(bytes held, a function y = f(x)) for one [n, k] layer of ``kind`` (random values
    whose scales keep the outputs finite). ``copies`` > 1: that many weights (as a model
    holds one per layer), each call the next one's, so a call reads its weight from
    memory rather than from the cache the previous call filled."""
    if copies > 1:
        made = [_weights(kind, n, k) for _ in range(copies)]
        turn = itertools.cycle(f for _, f in made)
        return made[0][0], lambda x: next(turn)(x)
    import torch

    from gpu_worker.quantization import kernels
    from gpu_worker.quantization.spec import GGML_TYPES

    kern = kernels.load()
    gen = torch.Generator().manual_seed(0)
    if kind == "fp32":
        w = torch.randn(n, k, generator=gen) * 0.02
        packed = torch.ops.mkldnn._reorder_linear_weight(w, 32)
        return w.numel() * 4, lambda x: torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")
    if kind in GGML_TYPES:
        type_id, block, nbytes = GGML_TYPES[kind]
        raw = torch.randint(0, 256, (n, k // block * nbytes), dtype=torch.uint8, generator=gen)
        d = torch.full((n, k // block), 0.001, dtype=torch.float16).view(torch.uint8).view(n, k // block, 2)
        view = raw.view(n, k // block, nbytes)
        if kind == "Q6_K":
            view[..., 208:210] = d
        else:
            view[..., 0:2] = d
            if kind in ("Q4_1", "Q5_1", "Q4_K", "Q5_K"):
                view[..., 2:4] = d
        if kern.ggml_packs(type_id):  # as a served layer holds it (GgmlLinear.finish)
            packed = kern.ggml_pack(raw, type_id)
            return raw.numel(), lambda x: _into(x, n, lambda out: kern.ggml_linear_packed(x, packed, type_id, n, out))
        return raw.numel(), lambda x: _into(x, n, lambda out: kern.ggml_linear(x, raw, type_id, out))
    if kind == "int4-g64":  # (GPTQ's usual 128 does not divide SmolLM2's 576)
        qs = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, generator=gen)
        scales, zeros = torch.rand(n, k // 64, generator=gen) * 0.01, torch.full((n, k // 64), 8.0)
        return qs.numel() + scales.numel() * 8, lambda x: _into(
            x, n, lambda out: kern.int4_linear(x, qs, scales, zeros, 64, out))
    bits = (torch.randn(n, k, generator=gen)).to(torch.float8_e4m3fn).view(torch.uint8)
    scales = torch.rand(n, 1, generator=gen)
    return bits.numel() + n * 4, lambda x: _into(x, n, lambda out: kern.fp8_linear(x, bits, scales, 1, k, out))


def _into(x, n, fill):
    import torch
    out = torch.empty(x.shape[0], n)
    fill(out)
    return out


def _time(f, x, reps: int) -> float:
    f(x)
    best = float("inf")
    for _ in range(3):  # best of three runs of ``reps`` calls: the box is shared
        start = time.perf_counter()
        for _ in range(reps):
            f(x)
        best = min(best, (time.perf_counter() - start) / reps)
    return best


def matmul(args) -> None:
    import torch

    from gpu_worker.quantization import kernels

    torch.set_num_threads(args.threads)
    if kernels.load() is None:
        raise SystemExit("the quantized-matmul kernel did not build")
    shape = SHAPES[args.shapes]
    mats = [(name, n, k, shape["layers"]) for name, n, k in shape["mats"]] + [("head", *shape["head"], 1)]
    print(f"{args.shapes} linear layers, {args.threads} thread(s), best of 3 x {args.reps} calls, weights "
          + ("from memory (one per layer, in turn)" if args.from_memory else "in cache (one, called again)"))
    print(f"{'kind':<12}{'layer':<9}{'M':>5}{'ms':>9}{'GB/s':>8}{'GFLOP/s':>9}")
    step: dict[tuple[str, int], float] = {}
    held: dict[str, int] = {}
    from gpu_worker.quantization.spec import GGML_TYPES
    rows = [int(r) for r in args.rows.split(",")]
    kinds = [kind for kind in (args.kinds.split(",") if args.kinds else KINDS)
             # (a K-quant's 256-element blocks need rows of whole blocks)
             if kind not in GGML_TYPES or all(k % GGML_TYPES[kind][1] == 0 for _, _, k, _ in mats)]
    for kind in kinds:
        for name, n, k, count in mats:
            nbytes, f = _weights(kind, n, k, count if args.from_memory else 1)
            held[kind] = held.get(kind, 0) + nbytes * count
            for m in rows:
                x = torch.randn(m, k)
                s = _time(f, x, args.reps)
                step[(kind, m)] = step.get((kind, m), 0.0) + s * count
                print(f"{kind:<12}{name:<9}{m:>5}{s * 1e3:>9.3f}{nbytes / s / 1e9:>8.1f}"
                      f"{2 * m * n * k / s / 1e9:>9.1f}")
    print(f"\nwhole model's matmuls ({shape['layers']} layers + head): weights, then tok/s at each row"
          " count (x fp32: the ratio to the fp32 path)")
    print(f"{'kind':<12}{'MiB':>8}" + "".join(f"{f'tok/s@{m}':>12}{'x fp32':>8}" for m in rows) + f"{'GB/s@1':>8}")
    for kind in kinds:
        line = f"{kind:<12}{held[kind] / 2**20:>8.0f}"
        for m in rows:
            t = step[(kind, m)]
            line += f"{m / t:>12.1f}" + (f"{step[('fp32', m)] / t:>8.2f}" if ("fp32", m) in step else f"{'-':>8}")
        print(line + (f"{held[kind] / step[(kind, 1)] / 1e9:>8.1f}" if 1 in rows else ""))


# ---------------------------------------------------------------- rss

_CHILD = r"""
import json, os, sys
def rss():  # (resident now, the most resident so far), bytes
    status = dict(line.split(":", 1) for line in open("/proc/self/status"))
    return tuple(int(status[k].split()[0]) * 1024 for k in ("VmRSS", "VmHWM"))
import torch, msgspec
from gpu_worker import model_runner
from gpu_worker.quantization.spec import GgmlSpec
path = sys.argv[1]
types = os.path.join(path, "ggml_types.json")
if os.path.exists(types):  # what a GGUF reader's config carries (see tests/support/ggml_zoo.py)
    load = model_runner.load_config
    model_runner.load_config = lambda p: msgspec.structs.replace(load(p), quantization=GgmlSpec(json.load(open(types))))
before, _ = rss()
runner = model_runner.ModelRunner(path, num_blocks=8)
after, peak = rss()
held = sum(p.numel() * p.element_size() for p in runner.model.parameters())
held += sum(e[1].numel() * e[1].element_size() for e in runner.numerics.packed.values())
print(json.dumps({"rss": after - before, "peak": peak - before, "held": held}))
"""


def rss(args) -> None:
    import shutil

    import torch
    from gguf import GGMLQuantizationType
    from gguf.quants import quantize
    from safetensors.torch import load_file, save_file

    from bench.models import build_llama_100m, build_tiny
    from tests.support import quant_zoo

    root = Path(args.root)
    base = build_llama_100m(root, build_tiny(root))
    paths = {"fp32": base}
    q41 = root / "llama-100m-q4_1"
    if not (q41 / "model.safetensors").exists():
        q41.mkdir(parents=True, exist_ok=True)
        for f in base.iterdir():
            if f.is_file() and f.name != "model.safetensors":
                shutil.copy(f, q41 / f.name)
        tensors = load_file(str(base / "model.safetensors"))
        types = {}
        for name, t in list(tensors.items()):
            if t.dim() == 2:
                tensors[name] = torch.from_numpy(quantize(t.numpy(), GGMLQuantizationType.Q4_1))
                types[name] = "Q4_1"
        save_file(tensors, str(q41 / "model.safetensors"))
        (q41 / "ggml_types.json").write_text(json.dumps(types))
    paths["gguf Q4_1"] = q41
    for name, write in (("gptq int4 g128", lambda o, r: quant_zoo.write_int4(base, o, r, "gptq", group=128)),
                        ("fp8 128x128", lambda o, r: quant_zoo.write_fp8(base, o, r)),
                        ("w8a8 int8", lambda o, r: quant_zoo.write_compressed(base, o, r, "w8a8"))):
        out = root / f"llama-100m-{name.split()[0]}"
        if not (out / "config.json").exists():
            write(out, root / f"llama-100m-{name.split()[0]}-ref")
        paths[name] = out
    fp32_bytes = sum(f.stat().st_size for f in base.glob("*.safetensors"))
    print(f"llama-100m ({fp32_bytes / 2**20:.0f} MiB of fp32 weights): a fresh ModelRunner per format")
    print(f"{'format':<16}{'held MiB':>10}{'RSS MiB':>9}{'peak MiB':>10}{'RSS / fp32 file':>17}")
    for name, path in paths.items():
        out = subprocess.run([sys.executable, "-c", _CHILD, str(path)], capture_output=True, text=True,
                             check=True).stdout.strip().splitlines()[-1]
        r = json.loads(out)
        print(f"{name:<16}{r['held'] / 2**20:>10.1f}{r['rss'] / 2**20:>9.1f}{r['peak'] / 2**20:>10.1f}"
              f"{r['rss'] / fp32_bytes:>17.2f}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="what", required=True)
    m = sub.add_parser("matmul")
    m.add_argument("--threads", type=int, default=1)
    m.add_argument("--shapes", choices=list(SHAPES), default="smollm2")
    m.add_argument("--reps", type=int, default=5)
    m.add_argument("--rows", default="1,16", help="row counts (M) to time, comma-separated")
    m.add_argument("--kinds", default="", help=f"weight kinds, comma-separated (default: all of {','.join(KINDS)})")
    m.add_argument("--from-memory", action="store_true", help="hold each layer's weight once per model "
                   "layer and cycle through them (a decode step's case: every weight read from memory)")
    r = sub.add_parser("rss")
    r.add_argument("--root", default=str(Path.home() / ".cache" / "candor" / "bench" / "quant"))
    args = p.parse_args()
    matmul(args) if args.what == "matmul" else rss(args)


if __name__ == "__main__":
    main()
