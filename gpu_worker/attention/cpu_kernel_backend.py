"""The torch backend with decodes through a fused paged-decode kernel for CPU, built from
``paged_decode.cpp`` on first use.

Why: the torch path gathers each decode's KV blocks into a scratch copy before SDPA,
so every KV byte is read from DRAM, written, then read again. The kernel reads the
cache in place, once per pass, in memory order, with AVX2+FMA where the CPU has them
(~2x the torch path per layer on a (b)-shaped batch: 32 streams, 12 heads, contexts
128-256, about 2.8 ms a layer; the V pass walks memory in order and exp is vectorised).
It takes each decode's padded block table and length (and a layer's window and
soft-cap), and returns each head's log-sum-exp too, so under a cascade it attends each
decode's own suffix and merges with the shared prefix's attention. Prefill chunks run
as in the torch backend.

It is compiled with the system C++ compiler via ``torch.utils.cpp_extension`` (~45 s the
first time, then cached under ``TORCH_EXTENSIONS_DIR``); where that fails, the backend
declines and the torch backend serves. ``CANDOR_CPU_DECODE_KERNEL=0`` turns it off.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from gpu_worker.attention.base import AttentionSpec, Chunk
from gpu_worker.attention.torch_backend import TorchBackend, TorchStep, merge_by_lse, padded_tables
from gpu_worker.cpu_extension import build

_SOURCE = Path(__file__).with_name("paged_decode.cpp")
DISABLE_ENV = "CANDOR_CPU_DECODE_KERNEL"
# (q, k_cache, v_cache, tables, lens, scale, window=None, softcap=None) -> (out, lse)
Kernel = Callable[..., tuple[torch.Tensor, torch.Tensor]]


def load() -> Kernel | None:
    """The compiled ``paged_decode``, or None when it cannot be built. ``window``: each
    decode attends its last ``window`` keys only; ``softcap``: scores pass through
    ``softcap * tanh(score / softcap)`` first."""
    module = build(_SOURCE, ["paged_decode"], openmp=True)
    if module is None:
        return None
    kernel = module.paged_decode

    def paged_decode(q, k_cache, v_cache, tables, lens, scale, window=None, softcap=None):
        return kernel(q, k_cache, v_cache, tables, lens, scale, window or 0, softcap or 0.0)

    return paged_decode


@dataclass
class KernelStep(TorchStep):
    kernel: Kernel | None = None
    decode_tables: torch.Tensor | None = None  # [decodes, max_blocks] long, padded
    decode_lens: torch.Tensor | None = None  # [decodes] long context lengths (own suffix under a cascade)

    def _decode(self, out, qd, k_cache, v_cache, window, softcap) -> None:
        out[:] = self.kernel(qd.contiguous(), k_cache, v_cache, self.decode_tables, self.decode_lens,
                             self.scale, window, softcap)[0]

    def _merge_suffix(self, qd, op, lse_p, k_cache, v_cache) -> torch.Tensor:
        b, h, d = qd.shape
        kvh = k_cache.shape[2]
        g = h // kvh
        os_, lse_s = self.kernel(qd.contiguous(), k_cache, v_cache, self.decode_tables, self.decode_lens,
                                 self.scale)
        return merge_by_lse(op, lse_p, os_.view(b, kvh, g, d), lse_s.view(b, kvh, g)).reshape(b, h, d)


class CpuKernelBackend(TorchBackend):
    name = "cpu_kernel"

    def __init__(self, spec: AttentionSpec, kernel: Kernel | None = None) -> None:
        super().__init__(spec)
        self.kernel = kernel or load()

    @classmethod
    def unavailable(cls, spec: AttentionSpec) -> str | None:
        if spec.device.type != "cpu" or spec.dtype != torch.float32:
            return f"fp32 on CPU only, not {str(spec.dtype).removeprefix('torch.')} on {spec.device.type}"
        if os.environ.get(DISABLE_ENV, "1") == "0":
            return f"{DISABLE_ENV}=0"
        return None

    def check(self) -> str | None:
        return None if self.kernel is not None else "the kernel could not be built (see the log above)"

    def plan(self, chunks: list[Chunk], num_decodes: int, slot_mapping: torch.Tensor) -> KernelStep:
        meta = KernelStep(slot_mapping, self.spec.scale, self.scratch, kernel=self.kernel)
        meta = self._prefills(meta, chunks, num_decodes)
        if num_decodes:
            rows = self._decode_rows(chunks[len(chunks) - num_decodes:], meta)
            meta.decode_lens = torch.tensor(rows.lens, dtype=torch.long, device=self.spec.device)
            meta.decode_tables = padded_tables(rows.lens, rows.tables, self.spec.block_size, self.spec.device)
        return meta
