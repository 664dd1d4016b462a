"""The torch backend with decodes through a fused paged-decode kernel for CPU, built from
``paged_decode.cpp`` on first use.

Why: the torch path gathers each decode's KV blocks into a scratch copy before SDPA,
so every KV byte is read from DRAM, written, then read again. The kernel reads the
cache in place, once per pass, in key order, with AVX2+FMA where the CPU has them
(~2x the torch path per layer on a (b)-shaped batch: 32 streams, 12 heads, contexts
128-256, about 2.8 ms a layer; ``python -m bench.attn_kernel`` times it on the
workloads' shapes).
It takes each decode's padded block table and length (and a layer's window and
soft-cap), and returns each head's log-sum-exp too, so under a cascade it attends each
decode's own suffix and merges with the shared prefix's attention. Prefill chunks run
as in the torch backend.

Batch-invariant (``AttentionSpec.batch_invariant``, the deterministic mode): every query
row, prefill or decode, goes through the kernel after the step's K/V write, reading its
causal prefix from the cache in key order (``InvariantStep``). The kernel takes any row:
``row_seq`` names each row's block table, and consecutive rows on one table (a prefill
chunk) or starting with the same block (decodes on a cached prefix) share each K/V read,
but a row's arithmetic depends on its own keys only. So a token's result never depends on
the other rows, on whether its keys came from the cache or from its own chunk, or on
where its prompt was split; SDPA (whose split over keys follows the chunk) and the
cascade (which depends on which other decodes share a prefix) stay out of it.

It is compiled with ``-ffp-contract=off`` (the compiler may not fuse a multiply and an
add into one FMA in one call site and not in another) with the system C++ compiler via
``torch.utils.cpp_extension`` (~45 s the first time, then cached under
``TORCH_EXTENSIONS_DIR``); where that fails, the backend declines and the torch backend
serves (and the deterministic mode is off). ``CANDOR_CPU_DECODE_KERNEL=0`` turns it off.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch

from gpu_worker.attention.base import AttentionMetadata, AttentionSpec, Chunk, Spans, write_kv
from gpu_worker.attention.torch_backend import (GatherScratch, TorchBackend, TorchStep, attend_span,
                                               merge_by_lse, padded_tables)
from gpu_worker.cpu_extension import build, wide_flags

_SOURCE = Path(__file__).with_name("paged_decode.cpp")
DISABLE_ENV = "CANDOR_CPU_DECODE_KERNEL"
CFLAGS = ("-ffp-contract=off", *wide_flags())
_NO_ROWS = torch.empty(0, dtype=torch.long)
_NO_KV = torch.empty(0, 0, 0)
# (q, k_cache, v_cache, tables, lens, scale, window=None, softcap=None, row_seq=None, new_kv=None) -> (out, lse)
Kernel = Callable[..., tuple[torch.Tensor, torch.Tensor]]


def compiled():
    """The compiled module (``paged_attention``, ``kernel_abi``), or None."""
    return build(_SOURCE, ["paged_attention", "kernel_abi"], openmp=True, cflags=CFLAGS)


def load() -> Kernel | None:
    """The compiled ``paged_attention``, or None when it cannot be built. Row b of ``q``
    attends keys 0..lens[b]-1 of block table ``tables[row_seq[b]]`` (``row_seq`` None:
    ``tables[b]``). ``window``: each row attends its last ``window`` keys only;
    ``softcap``: scores pass through ``softcap * tanh(score / softcap)`` first; ``new_kv``
    (k, v, slot_mapping): the step's new K/V rows, stored at their slots first."""
    module = compiled()
    if module is None:
        return None
    kernel = module.paged_attention

    def paged_attention(q, k_cache, v_cache, tables, lens, scale, window=None, softcap=None, row_seq=None,
                        new_kv=None):
        k, v, slots = (_NO_KV, _NO_KV, _NO_ROWS) if new_kv is None else new_kv
        return kernel(q, k_cache, v_cache, tables, _NO_ROWS if row_seq is None else row_seq, lens, scale,
                      window or 0, softcap or 0.0, k, v, slots)

    return paged_attention


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


@dataclass
class InvariantStep(AttentionMetadata):
    """Every row of the step through the kernel, from the cache (see the module docstring)."""

    slot_mapping: torch.Tensor
    num_prefill_tokens: int
    scale: float
    kernel: Kernel
    tables: torch.Tensor  # [sequences, max_blocks] long, padded
    row_seq: torch.Tensor  # [num_tokens] long: each row's table
    lens: torch.Tensor  # [num_tokens] long: each row's position + 1
    # bidirectional spans: (first row, first position, end position, sequence), each
    # recomputed whole by ``attend_span`` (its rows' keys: the span's own and its prefix)
    spans: list[tuple[int, int, int, int]] = field(default_factory=list)
    scratch: GatherScratch = field(default_factory=GatherScratch)

    def attend(self, q, k, v, k_cache, v_cache, window=None, softcap=None):
        new_kv = (k, v, self.slot_mapping)  # stored by the kernel call (its heads must be contiguous)
        if k.stride(-1) != 1 or v.stride(-1) != 1:
            write_kv(k_cache, v_cache, k, v, self.slot_mapping)
            new_kv = None
        out = self.kernel(q.contiguous(), k_cache, v_cache, self.tables, self.lens, self.scale, window, softcap,
                          row_seq=self.row_seq, new_kv=new_kv)[0]
        for row, lo, hi, seq in self.spans:
            rows = slice(row, row + hi - lo)
            out[rows] = attend_span(q[rows], k_cache, v_cache, self.tables[seq], lo, hi, window, softcap,
                                    self.scale, self.scratch)
        return out


class CpuKernelBackend(TorchBackend):
    name = "cpu_kernel"
    batch_invariant = True
    spans = True

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

    def plan(self, chunks: list[Chunk], num_decodes: int,
             slot_mapping: torch.Tensor) -> KernelStep | InvariantStep:
        if self.spec.batch_invariant:
            return self._every_row(chunks, num_decodes, slot_mapping)
        meta = KernelStep(slot_mapping, self.spec.scale, self.scratch, kernel=self.kernel)
        meta = self._prefills(meta, chunks, num_decodes)
        if num_decodes:
            rows = self._decode_rows(chunks[len(chunks) - num_decodes:], meta)
            meta.decode_lens = torch.tensor(rows.lens, dtype=torch.long, device=self.spec.device)
            meta.decode_tables = padded_tables(rows.lens, rows.tables, self.spec.block_size, self.spec.device)
        return meta

    def add_spans(self, meta: KernelStep | InvariantStep, chunks: list[Chunk], spans: Spans) -> None:
        if not isinstance(meta, InvariantStep):
            return super().add_spans(meta, chunks, spans)
        row = 0
        starts = []
        for _, n, _ in chunks:
            starts.append(row)
            row += n
        for i, ranges in sorted(spans.items()):
            start = chunks[i][0]
            meta.spans += [(starts[i] + lo - start, lo, hi, i) for lo, hi in ranges]

    def _every_row(self, chunks: list[Chunk], num_decodes: int, slot_mapping: torch.Tensor) -> InvariantStep:
        device = self.spec.device
        counts = [n for _, n, _ in chunks]
        return InvariantStep(
            slot_mapping, sum(counts[:len(chunks) - num_decodes]), self.spec.scale, self.kernel,
            scratch=self.scratch,
            tables=padded_tables([start + n for start, n, _ in chunks], [t for _, _, t in chunks],
                                 self.spec.block_size, device),
            row_seq=torch.repeat_interleave(torch.arange(len(chunks), device=device),
                                            torch.tensor(counts, device=device)),
            lens=torch.tensor([p for start, n, _ in chunks for p in range(start + 1, start + n + 1)],
                              dtype=torch.long, device=device))
