"""The workloads ``bench.ab`` and ``bench.compare`` run, and the checkpoints they need.

  a      tiny-hd64,              32 concurrent streams, 128-token prompts, 128 output tokens
  b      ~100M Llama (768 x 12), the same shape of load
  c      tiny-hd64,              64 requests sharing a 1024-token prefix (+64 own, 32 out)
  d      tiny-hd64,              32 requests at once sharing a 256-token prefix (+32 own, 32
                                 out): a burst that fits a few steps (TTFT of a burst)
  e      tiny-hd64,              32 identical 128-token prompts at once -> 64 tokens (the
                                 prefix cache serves all but the first)
  smoke  tiny-hd64,              4 requests of 16 -> 16 tokens: checks the plumbing only
  r1     smollm2 (make serve's SmolLM2-135M-Instruct Q4_1 GGUF): batch-1 decode, 4
         requests one at a time, 32-token prompts -> 128 tokens
  r16    smollm2, 16 concurrent streams, 128-token prompts -> 128 tokens
  r2k    smollm2, the TTFT of a ~1.9k-token prompt (2 requests one at a time -> 1 token)

The smollm2 workloads send their prompts as text (the token ids decoded by the model's
tokenizer, about 1% more tokens once re-encoded): llama.cpp's server takes no token ids,
and both sides then tokenize the same strings.

tiny-hd64 is the tiny checkpoint's shape (hidden 64, 4 layers, its tokenizer) with one
64-wide head: vLLM's CPU attention kernels reject head_dim 16, the tiny model's.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, replace
from pathlib import Path

from launcher.default_model import default_gguf
from launcher.loadgen import Workload
from bench.models import build_llama_100m, build_tiny, build_tiny_hd64


@dataclass(frozen=True)
class Bench:
    model: str  # the served model name: a key of MODELS here, an ARCH_SHAPES name in arch_bench
    workload: Workload
    text: bool = False  # prompts go as text (``with_tokenizer`` says whose)

    def with_tokenizer(self, tokenizer_json: Path) -> Bench:
        if not self.text:
            return self
        return replace(self, workload=replace(self.workload, text_tokenizer=str(tokenizer_json)))

    def describe(self) -> str:
        w = self.workload
        if w.prompt_len == (0, 0):
            prompts = f"identical {w.shared_prefix_len}-token prompts"
        else:
            prefix = f" + {w.shared_prefix_len}-token shared prefix" if w.shared_prefix_len else ""
            prompts = f"{w.prompt_len[0]}-token prompts{prefix}{' (as text)' if self.text else ''}"
        return (f"{self.model}: {w.num_requests} requests ({w.concurrency} at once), "
                f"{prompts} -> {w.output_len[0]} tokens")


WORKLOADS = {
    "a": Bench("tiny-hd64", Workload(num_requests=32, concurrency=32, prompt_len=(128, 128),
                                     output_len=(128, 128))),
    "b": Bench("llama-100m", Workload(num_requests=32, concurrency=32, prompt_len=(128, 128),
                                      output_len=(128, 128))),
    "c": Bench("tiny-hd64", Workload(num_requests=64, concurrency=64, prompt_len=(64, 64),
                                     output_len=(32, 32), shared_prefix_len=1024)),
    "d": Bench("tiny-hd64", Workload(num_requests=32, concurrency=32, prompt_len=(32, 32),
                                     output_len=(32, 32), shared_prefix_len=256)),
    "e": Bench("tiny-hd64", Workload(num_requests=32, concurrency=32, prompt_len=(0, 0),
                                     output_len=(64, 64), shared_prefix_len=128)),
    "smoke": Bench("tiny-hd64", Workload(num_requests=4, concurrency=4, prompt_len=(16, 16),
                                         output_len=(16, 16))),
    "r1": Bench("smollm2", Workload(num_requests=4, concurrency=1, prompt_len=(32, 32),
                                    output_len=(128, 128)), text=True),
    "r16": Bench("smollm2", Workload(num_requests=16, concurrency=16, prompt_len=(128, 128),
                                     output_len=(128, 128)), text=True),
    "r2k": Bench("smollm2", Workload(num_requests=2, concurrency=1, prompt_len=(1900, 1900),
                                     output_len=(1, 1)), text=True),
}
REAL = ("r1", "r16", "r2k")  # what "real" means
# KV blocks (of 16 tokens) per model: enough for every workload, small enough that two
# servers side by side fit in memory
KV_BLOCKS = {"tiny-hd64": 4096, "llama-100m": 1024}


ALL = ("a", "b", "c", "e")  # what "all" means: smoke measures nothing


def parse_workloads(text: str) -> list[str]:
    names = (list(ALL) if text == "all" else list(REAL) if text == "real"
             else [w for w in text.split(",") if w])
    unknown = [w for w in names if w not in WORKLOADS]
    if unknown:
        raise SystemExit(f"unknown workload(s) {unknown}; known: {', '.join(WORKLOADS)}")
    return names


def by_model(names: list[str]) -> dict[str, list[str]]:
    """Workload names grouped by checkpoint, so each server starts once per model."""
    out: dict[str, list[str]] = {}
    for name in names:
        out.setdefault(WORKLOADS[name].model, []).append(name)
    return out


def build_models(models_dir: Path, keys: list[str]) -> dict[str, Path]:
    """The checkpoints named by ``keys`` (built once, kept in ``models_dir``; smollm2:
    the GGUF file ``make install`` installs)."""
    models_dir.mkdir(parents=True, exist_ok=True)
    tiny = build_tiny(models_dir)
    builders = {"tiny-hd64": build_tiny_hd64, "llama-100m": build_llama_100m,
                "smollm2": lambda _root, _tiny: default_gguf()}
    return {key: builders[key](models_dir, tiny) for key in keys}


def round_workload(bench: Bench, round_index: int) -> Workload:
    """A fresh seed per round (so no prefix cache carries over), the same for every side."""
    return dataclasses.replace(bench.workload, seed=1000 * round_index + 1)
