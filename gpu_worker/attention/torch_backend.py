"""Paged attention in plain torch (SDPA): runs anywhere, and is the reference the other
backends are checked against.

Prefill chunks run one SDPA call each: a chunk starting at position 0 attends to its own
fresh K/V with ``is_causal``; a later chunk of a long prompt gathers its earlier K/V from
the cache and uses an explicit causal mask offset by ``start_pos`` (SDPA's ``is_causal``
is top-left aligned, which would be wrong). A whole block gathers as one contiguous slab.

Decodes run in groups of consecutive rows (the runner orders them by length, so a group
pads little); each group gathers its keys block-wise through its block tables into a
reused scratch buffer and makes one padded, length-masked SDPA call. Groups are sized so
their gathered K and V stay cache-resident (a few MB): gathering a whole 32-stream batch
at once spills to DRAM and costs ~2x more per layer on CPU.

Cascade decode (CPU): when every decode's table starts with the same (prefix-cached, hence
full and immutable) blocks, those are gathered once and attended by all decodes' queries
in one call; each decode then attends only its own suffix, and the two partial results
merge through their log-sum-exps. torch's CPU flash kernel returns the LSE
(``_scaled_dot_product_flash_attention_for_cpu``); without it the path stays off.

Per-layer kinds: a sliding ``window`` (a query at position p sees keys p - window + 1 ..
p, as HF's sliding-window mask) and a score ``softcap`` (Gemma 2). Masks are built once
per step for each window a layer asks for (``PrefillChunk.mask`` / ``DecodeGroup.mask``)
and shared by the layers that use it. A soft-capped layer computes scores explicitly
(SDPA has no soft-cap), as HF's eager path. The cascade pass is off for models with
windows or soft-caps: the shared prefix may lie outside a window, and the LSE kernel has
no cap.

Bidirectional spans (Gemma 3's images, ``base.Spans``): a chunk with spans always takes
an explicit mask, the causal one OR'd with each span's block (inside the window); see
``span_mask``. ``attend_span`` computes one span's rows alone from the cache, which the
batch-invariant kernel path uses for them (cpu_kernel_backend).

``TorchStep`` splits a step into its prefill, decode and cascade-suffix parts, so a
backend that computes decodes another way (``cpu_kernel_backend``) overrides only those.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

import torch
import torch.nn.functional as F

from gpu_worker.attention.base import (AttentionBackend, AttentionMetadata, AttentionSpec, Chunk, Spans,
                                       write_kv)

_FLASH_LSE = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)
CASCADE_MIN_BLOCKS = 2  # shared leading blocks worth a separate prefix pass
DECODE_GROUP_BYTES = 8 * 2**20  # gathered K+V per decode group: well inside a CPU's L3


def _window_mask(q_pos: torch.Tensor, ctx: int, window: int | None) -> torch.Tensor:
    """[n, ctx] bool, True = attend: causal, and within ``window`` when there is one."""
    k_pos = torch.arange(ctx, device=q_pos.device)[None, :]
    mask = k_pos <= q_pos[:, None]
    if window is not None:
        mask &= k_pos > q_pos[:, None] - window
    return mask


def span_mask(q_pos: torch.Tensor, ctx: int, window: int | None,
              spans: list[tuple[int, int]]) -> torch.Tensor:
    """``_window_mask`` with each span's tokens attending each other both ways, inside the
    window (HF Gemma 3: AND(window, OR(causal, same image)))."""
    mask = _window_mask(q_pos, ctx, window)
    k_pos = torch.arange(ctx, device=q_pos.device)[None, :]
    for lo, hi in spans:
        block = ((q_pos >= lo) & (q_pos < hi))[:, None] & (k_pos >= lo) & (k_pos < hi)
        if window is not None:
            block &= k_pos > q_pos[:, None] - window
        mask |= block
    return mask


@dataclass
class PrefillChunk:
    q_start: int  # row range of this chunk in the flattened batch
    q_end: int
    start_pos: int
    blocks: torch.Tensor | None = None  # block ids covering the context; None when start_pos == 0
    masks: dict = field(default_factory=dict)  # window -> mask, built on first use
    spans: list[tuple[int, int]] = field(default_factory=list)  # bidirectional position ranges

    def mask(self, window: int | None, device: torch.device) -> torch.Tensor | None:
        """[n, ctx_len] bool (True = attend); None where SDPA's ``is_causal`` says the same
        (a chunk from position 0 without spans whose rows all fit in the window)."""
        n = self.q_end - self.q_start
        if self.start_pos == 0 and not self.spans and (window is None or n <= window):
            return None
        if window not in self.masks:
            q_pos = torch.arange(self.start_pos, self.start_pos + n, device=device)
            self.masks[window] = span_mask(q_pos, self.start_pos + n, window, self.spans)
        return self.masks[window]


def attend_span(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, table: torch.Tensor,
                lo: int, hi: int, window: int | None, softcap: float | None, scale: float,
                scratch: "GatherScratch") -> torch.Tensor:
    """Rows ``q`` [hi - lo, heads, d] of one bidirectional span at positions lo..hi-1,
    attending keys 0..hi-1 of ``table`` (written already) under ``span_mask``: a result
    that depends on the span's own rows and keys alone (the batch-invariant path)."""
    blocks = table[:-(-hi // k_cache.shape[1])]
    ks, vs = _gather_kv(k_cache, v_cache, blocks, scratch)
    mask = span_mask(torch.arange(lo, hi, device=q.device), hi, window, [(lo, hi)])
    return _sdpa(q.transpose(0, 1), ks[:, :hi], vs[:, :hi], mask, scale, softcap).transpose(0, 1)


@dataclass
class DecodeGroup:
    row_start: int  # row range among the decodes (0 = first decode)
    row_end: int
    block_tables: torch.Tensor  # [rows, max_blocks] long, padded with block 0
    lens: torch.Tensor  # [rows] long: keys each row attends (its context in these tables)
    block_size: int
    additive: bool = False  # the LSE kernel (cascade) wants float masks
    masks: dict = field(default_factory=dict)  # window -> mask, built on first use

    def mask(self, window: int | None) -> torch.Tensor:
        """[rows, 1, 1, keys]: True (or 0.0 when additive) where a row attends."""
        if window not in self.masks:
            key_pos = torch.arange(self.block_tables.shape[1] * self.block_size, device=self.lens.device)
            mask = key_pos[None, :] < self.lens[:, None]
            if window is not None:
                mask &= key_pos[None, :] >= self.lens[:, None] - window
            mask = mask[:, None, None, :]
            if self.additive:
                mask = torch.zeros(mask.shape, device=mask.device).masked_fill_(~mask, float("-inf"))
            self.masks[window] = mask
        return self.masks[window]


class GatherScratch:
    """Grow-only K and V buffers that gathers write into (``index_select(out=)``).

    A fresh multi-MB tensor per gather costs page faults and a slower allocation path
    (~6x the copy itself on CPU); one buffer pair lives as long as the backend."""

    def __init__(self) -> None:
        self.k: torch.Tensor | None = None
        self.v: torch.Tensor | None = None

    def get(self, rows: int, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        width = like[0].numel()
        if self.k is None or self.k.shape[0] < rows or self.k.shape[1] != width or self.k.dtype != like.dtype:
            self.k = torch.empty(rows, width, dtype=like.dtype, device=like.device)
            self.v = torch.empty_like(self.k)
        return self.k[:rows], self.v[:rows]


@dataclass
class DecodeRows:
    """The decodes of a step as the cache sees them: each one's context length and block
    table, less the ``shared`` leading blocks a cascade pass attends once for all."""

    lens: list[int]
    tables: list[list[int]]
    shared: torch.Tensor | None  # [P] the shared leading block ids; None: no cascade


@dataclass
class TorchStep(AttentionMetadata):
    slot_mapping: torch.Tensor
    scale: float
    scratch: GatherScratch
    prefills: list[PrefillChunk] = field(default_factory=list)
    num_prefill_tokens: int = 0
    num_decodes: int = 0
    decode_groups: list[DecodeGroup] = field(default_factory=list)
    shared_blocks: torch.Tensor | None = None  # [P] leading blocks every decode shares (cascade)

    def attend(self, q, k, v, k_cache, v_cache, window=None, softcap=None):
        write_kv(k_cache, v_cache, k, v, self.slot_mapping)
        out = torch.empty_like(q)
        self._prefill(out, q, k, v, k_cache, v_cache, window, softcap)
        p = self.num_prefill_tokens
        if not self.num_decodes:
            return out
        if self.shared_blocks is not None:
            if window is not None or softcap is not None:
                raise ValueError("cascade decode has no window or soft-cap (a plain model only)")
            out[p:] = self._cascade(q[p:], k_cache, v_cache)
        else:
            self._decode(out[p:], q[p:], k_cache, v_cache, window, softcap)
        return out

    def _prefill(self, out, q, k, v, k_cache, v_cache, window, softcap) -> None:
        for c in self.prefills:
            qs = q[c.q_start : c.q_end].transpose(0, 1)  # [h, n, d]
            mask = c.mask(window, q.device)
            if c.blocks is None:
                ks = k[c.q_start : c.q_end].transpose(0, 1)
                vs = v[c.q_start : c.q_end].transpose(0, 1)
            else:
                ctx = c.start_pos + c.q_end - c.q_start
                ks, vs = _gather_kv(k_cache, v_cache, c.blocks, self.scratch)
                ks, vs = ks[:, :ctx], vs[:, :ctx]
            o = _sdpa(qs, ks, vs, mask, self.scale, softcap)
            out[c.q_start : c.q_end] = o.transpose(0, 1)

    def _decode(self, out, qd, k_cache, v_cache, window, softcap) -> None:
        """Decode rows ``qd`` [b, h, d] into ``out`` [b, h, d]: one SDPA call per group."""
        for g in self.decode_groups:
            qg = qd[g.row_start : g.row_end].unsqueeze(2)  # [b, h, 1, d]
            kg, vg = _gather_kv(k_cache, v_cache, g.block_tables, self.scratch)  # [b, kvh, L, d]
            out[g.row_start : g.row_end] = _sdpa(qg, kg, vg, g.mask(window), self.scale, softcap).squeeze(2)

    def _cascade(self, qd: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> torch.Tensor:
        """Decode attention split at the shared prefix (see the module docstring)."""
        b, h, d = qd.shape
        kvh = k_cache.shape[2]
        g = h // kvh
        kp, vp = _gather_kv(k_cache, v_cache, self.shared_blocks[None], self.scratch)  # [1, kvh, Lp, d]
        qp = _heads_as_queries(qd, kvh).permute(1, 0, 2, 3).reshape(1, kvh, b * g, d)
        op, lse_p = _FLASH_LSE(qp, kp, vp, scale=self.scale)  # [1, kvh, b*g, d], [1, kvh, b*g]
        op = op.view(kvh, b, g, d).transpose(0, 1)
        lse_p = lse_p.view(kvh, b, g).transpose(0, 1)
        return self._merge_suffix(qd, op, lse_p, k_cache, v_cache)

    def _merge_suffix(self, qd, op, lse_p, k_cache, v_cache) -> torch.Tensor:
        """The prefix's output ``op`` [b, kvh, g, d] and LSE merged with each decode's own
        suffix, attended per group; [b, h, d]."""
        b, h, d = qd.shape
        kvh = k_cache.shape[2]
        out = torch.empty(b, kvh, h // kvh, d, dtype=qd.dtype, device=qd.device)
        for grp in self.decode_groups:
            lo, hi = grp.row_start, grp.row_end
            ks, vs = _gather_kv(k_cache, v_cache, grp.block_tables, self.scratch)
            os_, lse_s = _FLASH_LSE(_heads_as_queries(qd[lo:hi], kvh), ks, vs, attn_mask=grp.mask(None),
                                    scale=self.scale)
            out[lo:hi] = merge_by_lse(op[lo:hi], lse_p[lo:hi], os_, lse_s)
        return out.view(b, h, d)


def decode_group_blocks(spec: AttentionSpec, group_bytes: int = DECODE_GROUP_BYTES) -> int | None:
    """Blocks one decode group may gather (K and V) within ``group_bytes``; None on
    accelerators, where one big batched call is better."""
    if spec.device.type != "cpu":
        return None
    return max(1, group_bytes // spec.block_bytes)


class TorchBackend(AttentionBackend):
    """``group_blocks`` caps the (padded) blocks one decode group gathers (None: one group;
    "auto": what fits ``DECODE_GROUP_BYTES`` on CPU)."""

    name = "torch"
    spans = True

    def __init__(self, spec: AttentionSpec, group_blocks: int | None | Literal["auto"] = "auto") -> None:
        super().__init__(spec)
        self.group_blocks = decode_group_blocks(spec) if group_blocks == "auto" else group_blocks
        self.scratch = GatherScratch()
        # the shared prefix may lie outside a window, and the LSE kernel has no soft-cap
        self.cascade = spec.plain and spec.device.type == "cpu" and _FLASH_LSE is not None

    def plan(self, chunks: list[Chunk], num_decodes: int, slot_mapping: torch.Tensor) -> TorchStep:
        meta = self._prefills(TorchStep(slot_mapping, self.spec.scale, self.scratch), chunks, num_decodes)
        if num_decodes:
            rows = self._decode_rows(chunks[len(chunks) - num_decodes:], meta)
            for lo, hi in _decode_groups(rows.lens, self.spec.block_size, self.group_blocks):
                meta.decode_groups.append(_decode_group(lo, hi, rows, self.spec.block_size,
                                                        self.spec.device))
        return meta

    def add_spans(self, meta: TorchStep, chunks: list[Chunk], spans: Spans) -> None:
        for i, ranges in spans.items():
            meta.prefills[i].spans = list(ranges)

    def _prefills(self, meta: TorchStep, chunks: list[Chunk], num_decodes: int) -> TorchStep:
        """``meta`` with the step's prefill chunks and row counts filled in."""
        bs, device = self.spec.block_size, self.spec.device
        row = 0
        for start, n, table in chunks[:len(chunks) - num_decodes]:
            chunk = PrefillChunk(q_start=row, q_end=row + n, start_pos=start)
            if start > 0:
                nb = -(-(start + n) // bs)
                chunk.blocks = torch.tensor(table[:nb], dtype=torch.long, device=device)
            meta.prefills.append(chunk)
            row += n
        meta.num_prefill_tokens, meta.num_decodes = row, num_decodes
        return meta

    def _decode_rows(self, decodes: list[Chunk], meta: TorchStep) -> DecodeRows:
        """The decodes' lengths and tables, split at a shared prefix worth a cascade pass
        (recorded in ``meta.shared_blocks``)."""
        bs = self.spec.block_size
        lens = [start + 1 for start, _, _ in decodes]
        tables = [t for _, _, t in decodes]
        shared = _shared_prefix(lens, tables, bs) if self.cascade else 0
        if not shared:
            return DecodeRows(lens, tables, None)
        meta.shared_blocks = torch.tensor(tables[0][:shared], dtype=torch.long, device=self.spec.device)
        return DecodeRows([c - shared * bs for c in lens], [t[shared:] for t in tables], meta.shared_blocks)


def _decode_groups(ctx_lens: list[int], block_size: int, cap: int | None) -> list[tuple[int, int]]:
    """Split decode rows into consecutive groups whose padded block count stays <= cap."""
    if cap is None:
        return [(0, len(ctx_lens))]
    groups: list[tuple[int, int]] = []
    lo, widest = 0, 0
    for i, c in enumerate(ctx_lens):
        nb = -(-c // block_size)
        if i > lo and max(widest, nb) * (i + 1 - lo) > cap:
            groups.append((lo, i))
            lo, widest = i, 0
        widest = max(widest, nb)
    groups.append((lo, len(ctx_lens)))
    return groups


def _shared_prefix(ctx_lens: list[int], tables: list[list[int]], block_size: int) -> int:
    """Leading blocks identical in every decode's table, each full for every decode and
    leaving each at least one own key; 0 when too few to pay for a cascade pass."""
    if len(tables) < 2:
        return 0
    limit = min((c - 1) // block_size for c in ctx_lens)
    first = tables[0]
    n = 0
    while n < limit and all(t[n] == first[n] for t in tables):
        n += 1
    return n if n >= CASCADE_MIN_BLOCKS else 0


def padded_tables(lens: list[int], tables: list[list[int]], block_size: int,
                  device: torch.device) -> torch.Tensor:
    """[rows, max_blocks] block ids, each table cut to its length and padded with block 0
    (any valid block works: the length mask hides it)."""
    max_blocks = -(-max(lens) // block_size)
    padded = []
    for t, c in zip(tables, lens):
        t = t[: -(-c // block_size)]
        padded.append(t + [0] * (max_blocks - len(t)))
    return torch.tensor(padded, dtype=torch.long, device=device)


def _decode_group(lo: int, hi: int, rows: DecodeRows, block_size: int, device: torch.device) -> DecodeGroup:
    lens = rows.lens[lo:hi]
    block_tables = padded_tables(lens, rows.tables[lo:hi], block_size, device)
    lens_t = torch.tensor(lens, dtype=torch.long, device=device)
    return DecodeGroup(lo, hi, block_tables, lens_t, block_size, additive=rows.shared is not None)


def _gather(cache: torch.Tensor, blocks: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """[..., nb] block ids -> [..., kv_heads, nb * block_size, head_dim] for SDPA.

    ``index_select`` over flattened ids copies whole blocks as slabs; it is ~3x faster
    on CPU than advanced indexing (``cache[blocks]``). The cache is viewed as 2-D
    [num_blocks, block_elems] first: on the 4-D tensor torch's CPU ``index_select``
    takes a generic strided loop that is several times slower than its row-copy path.
    ``out`` (rows = number of ids) avoids allocating. The final transpose is a view:
    SDPA takes the strided keys as they are."""
    bs, kvh, d = cache.shape[1:]
    flat = cache.view(cache.shape[0], -1)
    g = torch.index_select(flat, 0, blocks.reshape(-1), out=out)
    g = g.view(*blocks.shape[:-1], blocks.shape[-1] * bs, kvh, d)
    return g.transpose(-3, -2)


def _gather_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, blocks: torch.Tensor,
               scratch: GatherScratch) -> tuple[torch.Tensor, torch.Tensor]:
    kb, vb = scratch.get(blocks.numel(), k_cache)
    return _gather(k_cache, blocks, kb), _gather(v_cache, blocks, vb)


def _sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, scale: float,
          softcap: float | None) -> torch.Tensor:
    """SDPA over [..., heads, n, d] queries and [..., kv_heads, L, d] keys; ``mask`` None
    means causal. With ``softcap``: HF's eager attention (scores, cap, mask, fp32 softmax)."""
    gqa = q.shape[-3] != k.shape[-3]
    if softcap is None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None, scale=scale,
                                              enable_gqa=gqa)
    if gqa:
        rep = q.shape[-3] // k.shape[-3]
        k, v = k.repeat_interleave(rep, dim=-3), v.repeat_interleave(rep, dim=-3)
    scores = torch.matmul(q, k.transpose(-1, -2)) * scale
    scores = torch.tanh(scores / softcap) * softcap
    if mask is None:
        n, L = scores.shape[-2:]
        mask = torch.ones(n, L, dtype=torch.bool, device=q.device).tril(L - n)
    if mask.dtype == torch.bool:
        scores = scores.masked_fill(~mask, float("-inf"))
    else:
        scores = scores + mask
    return torch.matmul(torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype), v)


def _heads_as_queries(q: torch.Tensor, kvh: int) -> torch.Tensor:
    """[b, h, d] -> [b, kv_heads, h // kv_heads, d]: a KV head's query heads become its
    query rows, so GQA needs no key repetition (HF maps head i to KV head i // group)."""
    b, h, d = q.shape
    return q.view(b, kvh, h // kvh, d)


def merge_by_lse(o1: torch.Tensor, lse1: torch.Tensor, o2: torch.Tensor, lse2: torch.Tensor) -> torch.Tensor:
    """Attention over two disjoint key sets from each one's output and log-sum-exp."""
    m = torch.maximum(lse1, lse2)
    w1 = (lse1 - m).exp_().unsqueeze(-1)
    w2 = (lse2 - m).exp_().unsqueeze(-1)
    return (o1 * w1 + o2 * w2) / (w1 + w2)

