"""The memory-bandwidth limit of batch-1 decode on this box: one decode step reads every
weight once, so no server can decode faster than (bytes the box streams per second) /
(bytes of weights per token), and a server's tok/s times its bytes per token says what
share of that limit it reaches.

    python -m bench.bandwidth [--model FILE.gguf]
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch

from gpu_worker.gguf.reader import GGUFFile

READ_BYTES = 256 * 2**20  # far past every cache level of this box
REPEATS = 7


def read_gbps(threads: int = 1, nbytes: int = READ_BYTES, repeats: int = REPEATS) -> float:
    """GB/s that ``threads`` threads stream from memory, summing a float32 buffer of
    ``nbytes`` (a read, as decode reads its weights); the best of ``repeats`` runs, the
    one a neighbour disturbed least."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        buf = torch.ones(nbytes // 4, dtype=torch.float32)
        buf.sum()  # pages in
        best = float("inf")
        for _ in range(repeats):
            start = time.perf_counter()
            buf.sum()
            best = min(best, time.perf_counter() - start)
        return nbytes / best / 1e9
    finally:
        torch.set_num_threads(before)


def gguf_bytes_per_token(path: str | Path) -> int:
    """Bytes of weights one decode step of a GGUF model reads: every tensor once, except
    the token embedding when the file has its own output matrix (then only one row of
    the embedding is read; tied, the embedding is the output matrix and read whole)."""
    tensors = GGUFFile(path).tensors
    untied = "output.weight" in tensors
    return sum(t.n_bytes for name, t in tensors.items()
               if not (untied and name == "token_embd.weight"))


def limit_line(gbps: float, weight_bytes: int, threads: int) -> str:
    return (f"memory bandwidth: {gbps:.1f} GB/s read by {threads} thread(s); "
            f"{weight_bytes / 1e6:.1f} MB of weights per token: batch-1 decode limit "
            f"{gbps * 1e9 / weight_bytes:.0f} tok/s")


def share(tok_s: float, weight_bytes: int, gbps: float) -> float:
    """The share of the bandwidth limit ``tok_s`` batch-1 tokens/s reach."""
    return tok_s * weight_bytes / (gbps * 1e9)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="a GGUF file (default: make serve's)")
    p.add_argument("--threads", type=int, default=1)
    a = p.parse_args(argv)
    if a.model is None:
        from launcher.default_model import default_gguf
        a.model = default_gguf()
    print(limit_line(read_gbps(a.threads), gguf_bytes_per_token(a.model), a.threads))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
