"""Decode-only steps at a few fixed batch sizes, replayed as CUDA graphs.

A decode step is dozens of small kernels per layer; at small batches launching them costs
more than running them. When the step holds only single-token decodes (and the attention
backend is ``capturable``: flashinfer), the runner pads the batch up to the next captured size and replays
that size's graph instead of launching the model eagerly:

- Sizes: 1, 2, 4, 8, 16, 24, 32, 48, 64, then wider steps up to ``max_num_seqs`` (capped
  at 256; larger decode batches run eagerly, where launch overhead matters less).
- Static inputs: one [3, max_size] int64 buffer holds input ids, positions and KV slots;
  each step writes its rows there with one host-to-device copy before replaying. The
  graph's output (final hidden states) is copied into one static buffer too; logits and
  sampling run outside the graph on the real rows only.
- Padding rows: token 0 at position 0, writing its K/V into slot 0 of a scratch block the
  runner reserves past the scheduler's blocks (``ModelRunner.scratch_block``, an index the
  scheduler is never told of, so no request's cache can be touched). Each padding row
  attends only to that one slot (which padding row's write lands there does not matter:
  their outputs are computed and dropped).
- Attention per size: the backend's ``graph_attention(sizes, ...)`` gives one object per
  size whose ``meta(chunks, slot_mapping)`` plans this step's (padded) batch and returns
  the metadata the model reads. With flashinfer that is a ``use_cuda_graph`` decode
  wrapper over fixed index buffers, re-planned on the host before each replay, and the
  same metadata object every step (``GraphDecodeAttention``). Other backends plan fresh
  metadata each step: that cannot be captured (its shapes follow the step's lengths), so
  the same padded static-buffer function runs eagerly (the CPU tests check padding,
  buffers and dummy rows against the unpadded path that way).

Capture happens at start-up (``capture``, called by the runner before the worker reports
ready), not lazily: capturing a size means a warm-up forward plus the capture itself,
hundreds of milliseconds for a large model, and at start-up that cost lands before any
request instead of as a latency spike on the first step of each new batch size; it also
makes the graphs' memory use visible before the KV cache is in use. ``enforce_eager``
(engine option / ``--enforce-eager``) turns all of this off.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable

import torch

from gpu_worker.attention.base import AttentionMetadata, Chunk, GraphAttention, kv_slot

MAX_CAPTURE_SIZE = 256
_BASE_SIZES = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 224, 256)
PAD_TOKEN = 0

def capture_sizes(max_num_seqs: int, cap: int = MAX_CAPTURE_SIZE) -> list[int]:
    """Batch sizes to capture: the base ladder below ``min(max_num_seqs, cap)``, plus that
    limit itself so the largest batch the scheduler forms pads by nothing."""
    limit = min(max_num_seqs, cap)
    if limit < 1:
        return []
    return sorted({s for s in _BASE_SIZES if s < limit} | {limit})


def padded_size(n: int, sizes: list[int]) -> int | None:
    """The smallest captured size that holds ``n`` rows; None when ``n`` is too big."""
    i = bisect.bisect_left(sizes, n)
    return sizes[i] if i < len(sizes) and n > 0 else None


def pad_decodes(chunks: list[Chunk], ids: list[int], positions: list[int], size: int,
                scratch_block: int, block_size: int) -> tuple[list[Chunk], list[list[int]]]:
    """Pad a decode batch to ``size`` rows.

    Returns the padded chunks (padding rows: position 0 in ``[scratch_block]``) and the
    [3, size] host rows (input ids, positions, KV slots) for the static buffer."""
    n = len(chunks)
    if n > size or len(ids) != n or len(positions) != n:
        raise ValueError(f"{n} decode rows do not pad to {size}")
    if any(num != 1 for _, num, _ in chunks):
        raise ValueError("only single-token decodes run at a padded size")
    slots = [kv_slot(t, p, block_size) for p, _, t in chunks]
    pad = size - n
    padded = list(chunks) + [(0, 1, [scratch_block])] * pad
    rows = [list(ids) + [PAD_TOKEN] * pad, list(positions) + [0] * pad,
            slots + [scratch_block * block_size] * pad]
    return padded, rows


Model = Callable[[torch.Tensor, torch.Tensor, list, AttentionMetadata], torch.Tensor]


class DecodeGraphRunner:
    """Runs decode-only steps padded to ``sizes`` through static buffers; replays a CUDA
    graph per size when the attention is capturable and ``capture`` has run."""

    def __init__(self, model: Model, kv_caches: list, attention: dict[int, GraphAttention], *,
                 scratch_block: int, block_size: int, hidden_size: int, dtype: torch.dtype,
                 device: torch.device) -> None:
        if not attention:
            raise ValueError("no batch sizes to run")
        self.model, self.kv_caches = model, kv_caches
        self.sizes = sorted(attention)
        self.scratch_block, self.block_size, self.device = scratch_block, block_size, device
        self.attention = attention
        max_size = self.sizes[-1]
        self.static = torch.zeros(3, max_size, dtype=torch.long, device=device)  # ids, positions, slots
        self.static[2].fill_(scratch_block * block_size)
        self.hidden = torch.zeros(max_size, hidden_size, dtype=dtype, device=device)
        # eagle3: the model's captured aux hidden states (``captured``) get a static buffer too
        taps = getattr(model, "aux_layers", ())
        self.aux = (torch.zeros(max_size, len(taps) * hidden_size, dtype=dtype, device=device)
                    if taps else None)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.pool = None
        self.steps = 0  # decode steps served here (tests and logs)
        self.padding_rows = 0  # padding rows computed so far

    def fits(self, n: int) -> bool:
        return padded_size(n, self.sizes) is not None

    def _body(self, size: int, meta: AttentionMetadata) -> None:
        """The captured function: static inputs -> static hidden states."""
        ids, positions = self.static[0, :size], self.static[1, :size]
        self.hidden[:size].copy_(self.model(ids, positions, self.kv_caches, meta))
        if self.aux is not None:
            self.aux[:size].copy_(self.model.captured)

    def _prepare(self, size: int, chunks: list[Chunk], rows: list[list[int]]) -> AttentionMetadata:
        host = torch.tensor(rows, dtype=torch.long)
        self.static[:, :size].copy_(host, non_blocking=self.device.type == "cuda")
        return self.attention[size].meta(chunks, self.static[2, :size])

    def run(self, chunks: list[Chunk], ids: list[int], positions: list[int]) -> torch.Tensor:
        """Hidden states [len(chunks), hidden] for a decode-only batch (a view of the static
        output buffer: valid until the next call)."""
        n = len(chunks)
        size = padded_size(n, self.sizes)
        if size is None:
            raise ValueError(f"{n} decodes exceed the largest padded size {self.sizes[-1]}")
        padded, rows = pad_decodes(chunks, ids, positions, size, self.scratch_block, self.block_size)
        meta = self._prepare(size, padded, rows)
        graph = self.graphs.get(size)
        if graph is not None:
            graph.replay()
        else:
            self._body(size, meta)
        self.steps += 1
        self.padding_rows += size - n
        if self.aux is not None:
            self.model.captured = self.aux[:n]
        return self.hidden[:n]

    def capture(self) -> int:
        """Capture one graph per size (largest first, sharing one memory pool), each after
        an eager warm-up run on padding rows only. Returns how many were captured."""
        if self.device.type != "cuda":
            return 0
        self.pool = torch.cuda.graph_pool_handle()
        for size in reversed(self.sizes):
            attn = self.attention[size]
            if not attn.graphable:
                continue
            padded, rows = pad_decodes([], [], [], size, self.scratch_block, self.block_size)
            meta = self._prepare(size, padded, rows)
            self._body(size, meta)  # warm-up: JIT, cuBLAS handles, allocator
            torch.cuda.synchronize(self.device)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.pool):
                self._body(size, meta)
            self.graphs[size] = graph
        torch.cuda.synchronize(self.device)
        return len(self.graphs)
