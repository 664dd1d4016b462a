"""Attention over the paged KV cache, in plain torch (CPU-friendly, runs anywhere).

Cache layout, per layer: ``k`` and ``v`` of shape [num_blocks, block_size, kv_heads,
head_dim]. Viewed as [num_blocks * block_size, kv_heads, head_dim], a token's slot
``block_table[pos // block_size] * block_size + pos % block_size`` is one row, so
writes are a single ``index_copy_`` and a whole block gathers as one contiguous slab.

The flattened batch puts every prefill chunk first and all decodes (one token each)
last. Decodes run in groups of consecutive rows (the runner orders them by length, so a
group pads little); each group gathers its keys block-wise through its block tables
into a reused scratch buffer and makes one padded, length-masked SDPA call. Groups are
sized so their gathered K and V stay cache-resident (a few MB): gathering a whole
32-stream batch at once spills to DRAM and costs ~2x more per layer on CPU.

With the compiled CPU kernel (``cpu_decode``), decodes skip all of that: it reads the
blocks in place through padded block tables and per-decode lengths (and, under a
cascade, attends each decode's own suffix).

Cascade decode: when every decode's table starts with the same (prefix-cached, hence
full and immutable) blocks, those are gathered once and attended by all decodes' queries
in one call; each group then attends only its own suffix, and the two partial results
merge through their log-sum-exps. torch's CPU flash kernel returns the LSE
(``_scaled_dot_product_flash_attention_for_cpu``); without it the path stays off. Prefill chunks run one SDPA call each: a chunk
starting at position 0 attends to its own fresh K/V with ``is_causal``; a later chunk of
a long prompt gathers its earlier K/V from the cache and uses an explicit causal mask
offset by ``start_pos`` (SDPA's ``is_causal`` is top-left aligned, which would be wrong).

Batch-invariant path (the deterministic mode, ``build_metadata(invariant=True)``): every
query row, prefill or decode, goes through the compiled kernel after this step's K/V
write, reading its causal prefix from the cache in key order. A token's result then never
depends on the other rows, on whether its keys came from the cache or from its own chunk,
or on where its prompt was split; SDPA (whose split over keys follows the chunk) and the
cascade (which depends on which other decodes share a prefix) stay out of it.

Per-layer switches: a sliding ``window`` (a query at position p sees keys p - window + 1
.. p, as HF's sliding-window mask) and Gemma 2's score ``softcap``. Masks are built once
per step for each window a layer asks for (``PrefillChunk.mask`` / ``DecodeGroup.mask``)
and shared by the layers that use it; the compiled kernel takes the window itself. A
soft-capped layer computes scores explicitly (SDPA has no soft-cap), as HF's eager path.
The cascade pass is off for models with windows or soft-caps (``build_metadata``'s
``cascade``): the shared prefix may lie outside a window, and the LSE kernel has no cap.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

log = logging.getLogger(__name__)


def _window_mask(q_pos: torch.Tensor, ctx: int, window: int | None) -> torch.Tensor:
    """[n, ctx] bool, True = attend: causal, and within ``window`` when there is one."""
    k_pos = torch.arange(ctx, device=q_pos.device)[None, :]
    mask = k_pos <= q_pos[:, None]
    if window is not None:
        mask &= k_pos > q_pos[:, None] - window
    return mask


@dataclass
class PrefillChunk:
    q_start: int  # row range of this chunk in the flattened batch
    q_end: int
    start_pos: int
    blocks: torch.Tensor | None = None  # block ids covering the context; None when start_pos == 0
    masks: dict = field(default_factory=dict)  # window -> mask, built on first use

    def mask(self, window: int | None, device: torch.device) -> torch.Tensor | None:
        """[n, ctx_len] bool (True = attend); None where SDPA's ``is_causal`` says the same
        (a chunk from position 0 whose rows all fit in the window)."""
        n = self.q_end - self.q_start
        if self.start_pos == 0 and (window is None or n <= window):
            return None
        if window not in self.masks:
            q_pos = torch.arange(self.start_pos, self.start_pos + n, device=device)
            self.masks[window] = _window_mask(q_pos, self.start_pos + n, window)
        return self.masks[window]


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
    (~6x the copy itself on CPU); one buffer pair lives as long as the runner."""

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
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [num_tokens] long: cache row for each new token
    prefills: list[PrefillChunk] = field(default_factory=list)
    num_prefill_tokens: int = 0
    decode_groups: list[DecodeGroup] = field(default_factory=list)
    shared_blocks: torch.Tensor | None = None  # [P] leading blocks every decode shares (cascade)
    scratch: GatherScratch | None = None  # None: gathers allocate their own output
    impl: object | None = None  # another backend's per-step state (has ``attend``); None: torch
    decode_kernel: object | None = None  # cpu_decode kernel; set: decodes skip groups and gathers
    decode_tables: torch.Tensor | None = None  # [decodes, max_blocks] long, padded (kernel only)
    decode_lens: torch.Tensor | None = None  # [decodes] long context lengths (kernel only)
    # Batch-invariant: every row (prefill and decode) through the kernel, from the cache.
    row_tables: torch.Tensor | None = None  # [sequences, max_blocks] long, padded
    row_seq: torch.Tensor | None = None  # [num_tokens] long: each row's table
    row_lens: torch.Tensor | None = None  # [num_tokens] long: each row's position + 1


def select_backend(num_heads: int, num_kv_heads: int, head_dim: int, block_size: int,
                   dtype: torch.dtype, device: torch.device, sm_scale: float | None = None,
                   layer_kinds: list[tuple[int | None, float | None]] | None = None):
    """flashinfer (planned once per distinct ``(window, softcap)`` of ``layer_kinds``) when the device is CUDA, flashinfer is installed, it supports the
    dtype and head size, and its start-up self-check agrees with SDPA; else None (the
    torch SDPA path here), with the reason logged. Imported lazily, so CPU-only installs
    never touch CUDA or flashinfer."""
    if device.type != "cuda":
        return None
    from gpu_worker import flashinfer_backend

    reason = None
    if not flashinfer_backend.available(device):
        reason = "flashinfer is not installed (or CUDA is unavailable)"
    else:
        reason = flashinfer_backend.unsupported_reason(head_dim, dtype)
    if reason is None:
        try:
            backend = flashinfer_backend.FlashInferBackend(num_heads, num_kv_heads, head_dim, block_size,
                                                           dtype, device, sm_scale, layer_kinds)
            err = backend.self_check()
        except Exception as exc:  # JIT build failure (no nvcc), unsupported GPU, API drift
            reason = f"flashinfer failed its start-up check: {type(exc).__name__}: {exc}"
        else:
            if err <= flashinfer_backend.SELF_CHECK_TOLERANCE:
                log.info("attention: flashinfer (self-check max error %.2e vs SDPA)", err)
                return backend
            reason = f"flashinfer disagrees with SDPA by {err:.3g} on the start-up check"
    log.warning("attention: torch SDPA path on %s: %s", device, reason)
    return None


_FLASH_LSE = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)
CASCADE_MIN_BLOCKS = 2  # shared leading blocks worth a separate prefix pass
DECODE_GROUP_BYTES = 8 * 2**20  # gathered K+V per decode group: well inside a CPU's L3


def decode_group_blocks(k_cache: torch.Tensor, group_bytes: int = DECODE_GROUP_BYTES) -> int | None:
    """Blocks one decode group may gather (K and V) within ``group_bytes``; None on
    accelerators, where one big batched call is better."""
    if k_cache.device.type != "cpu":
        return None
    return max(1, group_bytes // (2 * k_cache[0].numel() * k_cache.element_size()))


def kv_slot(table: list[int], pos: int, block_size: int) -> int:
    """The cache row (in the [num_blocks * block_size, ...] view) of position ``pos`` of a
    sequence whose blocks are ``table``."""
    return table[pos // block_size] * block_size + pos % block_size


def build_metadata(
    chunks: list[tuple[int, int, list[int]]],
    num_decodes: int,
    block_size: int,
    device: torch.device,
    backend=None,
    group_blocks: int | None = None,
    scratch: GatherScratch | None = None,
    decode_kernel=None,
    cascade: bool = True,
    invariant: bool = False,
) -> AttentionMetadata:
    """Index tensors for one step.

    ``chunks`` lists (start_pos, num_tokens, block_table) in flattened-batch order:
    prefill chunks first, then the ``num_decodes`` single-token decodes. ``backend``
    (from ``select_backend``) plans its own kernels; None builds the torch path's masks.
    ``group_blocks`` caps the (padded) blocks one decode group gathers (None: one group).
    ``decode_kernel`` (from ``cpu_decode.load``) attends decodes in place (their own
    suffix when they share a prefix worth a cascade pass). ``cascade`` False: never split
    decodes at a shared prefix (models with windows or soft-caps). ``invariant``: every
    row, prefill or decode, goes through ``decode_kernel`` and reads its keys from the
    cache, so its result does not depend on the batch or on how its prompt was chunked
    (the deterministic mode; needs the kernel).
    """
    slots: list[int] = []
    for start, n, table in chunks:
        if n == 1:
            slots.append(kv_slot(table, start, block_size))
        else:
            slots.extend(kv_slot(table, pos, block_size) for pos in range(start, start + n))
    slot_mapping = torch.tensor(slots, dtype=torch.long, device=device)
    if backend is not None:
        return backend.build(chunks, num_decodes, slot_mapping)
    meta = AttentionMetadata(slot_mapping=slot_mapping, scratch=scratch)
    if invariant:
        return _every_row(meta, chunks, block_size, device, decode_kernel)

    num_prefills = len(chunks) - num_decodes
    row = 0
    for start, n, table in chunks[:num_prefills]:
        chunk = PrefillChunk(q_start=row, q_end=row + n, start_pos=start)
        if start > 0:
            nb = -(-(start + n) // block_size)
            chunk.blocks = torch.tensor(table[:nb], dtype=torch.long, device=device)
        meta.prefills.append(chunk)
        row += n
    meta.num_prefill_tokens = row

    if num_decodes:
        ctx_lens = [start + 1 for start, _, _ in chunks[num_prefills:]]
        tables = [t for _, _, t in chunks[num_prefills:]]
        shared = _shared_prefix(ctx_lens, tables, block_size) if cascade and device.type == "cpu" else 0
        if shared:
            meta.shared_blocks = torch.tensor(tables[0][:shared], dtype=torch.long, device=device)
            ctx_lens = [c - shared * block_size for c in ctx_lens]
            tables = [t[shared:] for t in tables]
        if decode_kernel is not None:
            meta.decode_kernel = decode_kernel
            meta.decode_lens = torch.tensor(ctx_lens, dtype=torch.long, device=device)
            meta.decode_tables = _padded_tables(ctx_lens, tables, block_size, device)
            return meta
        for lo, hi in _decode_groups(ctx_lens, block_size, group_blocks):
            meta.decode_groups.append(_decode_group(lo, hi, ctx_lens, tables, block_size, device,
                                                    additive=bool(shared)))
    return meta


def _every_row(meta: AttentionMetadata, chunks: list[tuple[int, int, list[int]]], block_size: int,
               device: torch.device, kernel) -> AttentionMetadata:
    if kernel is None:
        raise ValueError("batch-invariant attention needs the compiled CPU kernel")
    meta.decode_kernel = kernel
    ends = [start + n for start, n, _ in chunks]
    meta.row_tables = _padded_tables(ends, [t for _, _, t in chunks], block_size, device)
    meta.row_seq = torch.repeat_interleave(torch.arange(len(chunks), device=device),
                                           torch.tensor([n for _, n, _ in chunks], device=device))
    meta.row_lens = torch.tensor([p for start, n, _ in chunks for p in range(start + 1, start + n + 1)],
                                 dtype=torch.long, device=device)
    return meta


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
    if _FLASH_LSE is None or len(tables) < 2:
        return 0
    limit = min((c - 1) // block_size for c in ctx_lens)
    first = tables[0]
    n = 0
    while n < limit and all(t[n] == first[n] for t in tables):
        n += 1
    return n if n >= CASCADE_MIN_BLOCKS else 0


def _padded_tables(lens: list[int], tables: list[list[int]], block_size: int,
                   device: torch.device) -> torch.Tensor:
    """[rows, max_blocks] block ids, each table cut to its length and padded with block 0
    (any valid block works: the length mask hides it)."""
    max_blocks = -(-max(lens) // block_size)
    padded = []
    for t, c in zip(tables, lens):
        t = t[: -(-c // block_size)]
        padded.append(t + [0] * (max_blocks - len(t)))
    return torch.tensor(padded, dtype=torch.long, device=device)


def _decode_group(lo: int, hi: int, ctx_lens: list[int], tables: list[list[int]], block_size: int,
                  device: torch.device, additive: bool = False) -> DecodeGroup:
    lens = ctx_lens[lo:hi]
    block_tables = _padded_tables(lens, tables[lo:hi], block_size, device)
    lens_t = torch.tensor(lens, dtype=torch.long, device=device)
    return DecodeGroup(lo, hi, block_tables, lens_t, block_size, additive)


def write_kv(
    k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor
) -> None:
    """Store new K/V rows ([num_tokens, kv_heads, head_dim]) at their cache slots."""
    k_cache.view(-1, *k_cache.shape[2:]).index_copy_(0, slots, k)
    v_cache.view(-1, *v_cache.shape[2:]).index_copy_(0, slots, v)


def _gather(cache: torch.Tensor, blocks: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """[..., nb] block ids -> [..., kv_heads, nb * block_size, head_dim] for SDPA.

    ``index_select`` over flattened ids copies whole blocks as slabs; it is ~3x faster
    on CPU than advanced indexing (``cache[blocks]``). The cache is viewed as 2-D
    [num_blocks, block_elems] first: on the 4-D tensor torch's CPU ``index_select``
    takes a generic strided loop that is several times slower than its row-copy path.
    ``out`` (rows = number of ids) avoids allocating. The final transpose is a view:
    SDPA takes the strided keys as they are."""
    bs, kvh, d = cache.shape[1:]
    flat = cache.view(cache.shape[0], -1)
    ids = blocks.reshape(-1)
    g = flat.index_select(0, ids) if out is None else torch.index_select(flat, 0, ids, out=out)
    g = g.view(*blocks.shape[:-1], blocks.shape[-1] * bs, kvh, d)
    return g.transpose(-3, -2)


def _gather_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, blocks: torch.Tensor,
               scratch: GatherScratch | None) -> tuple[torch.Tensor, torch.Tensor]:
    if scratch is None:
        return _gather(k_cache, blocks), _gather(v_cache, blocks)
    kb, vb = scratch.get(blocks.numel(), k_cache)
    return _gather(k_cache, blocks, kb), _gather(v_cache, blocks, vb)


def paged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    window: int | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """q: [T, heads, d]; k, v: [T, kv_heads, d] (already rotated). Returns [T, heads, d].

    Writes the new K/V into the cache first, so later chunks and decodes see them.
    """
    if meta.impl is not None:
        return meta.impl.attend(q, k, v, k_cache, v_cache, meta, scale, window, softcap)
    write_kv(k_cache, v_cache, k, v, meta.slot_mapping)
    if meta.row_lens is not None:
        return meta.decode_kernel(q.contiguous(), k_cache, v_cache, meta.row_tables, meta.row_lens, scale,
                                  window, softcap, row_seq=meta.row_seq)[0]
    out = torch.empty_like(q)

    for c in meta.prefills:
        qs = q[c.q_start : c.q_end].transpose(0, 1)  # [h, n, d]
        mask = c.mask(window, q.device)
        if c.blocks is None:
            ks = k[c.q_start : c.q_end].transpose(0, 1)
            vs = v[c.q_start : c.q_end].transpose(0, 1)
        else:
            ctx = c.start_pos + c.q_end - c.q_start
            ks, vs = _gather_kv(k_cache, v_cache, c.blocks, meta.scratch)
            ks, vs = ks[:, :ctx], vs[:, :ctx]
        o = _sdpa(qs, ks, vs, mask, scale, softcap)
        out[c.q_start : c.q_end] = o.transpose(0, 1)

    p = meta.num_prefill_tokens
    if meta.decode_kernel is not None and meta.shared_blocks is None:
        out[p:] = meta.decode_kernel(q[p:].contiguous(), k_cache, v_cache, meta.decode_tables,
                                     meta.decode_lens, scale, window, softcap)[0]
        return out
    if meta.shared_blocks is not None:
        if window is not None or softcap is not None:
            raise ValueError("cascade decode has no window or soft-cap (build_metadata cascade=False)")
        out[p:] = _cascade_decode(q[p:], k_cache, v_cache, meta, scale)
        return out
    for g in meta.decode_groups:
        qd = q[p + g.row_start : p + g.row_end].unsqueeze(2)  # [b, h, 1, d]
        kd, vd = _gather_kv(k_cache, v_cache, g.block_tables, meta.scratch)  # [b, kvh, L, d]
        o = _sdpa(qd, kd, vd, g.mask(window), scale, softcap)
        out[p + g.row_start : p + g.row_end] = o.squeeze(2)
    return out


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


def _cascade_decode(qd: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    meta: AttentionMetadata, scale: float) -> torch.Tensor:
    """Decode attention split at the shared prefix; see the module docstring."""
    b, h, d = qd.shape
    kvh = k_cache.shape[2]
    g = h // kvh
    kp, vp = _gather_kv(k_cache, v_cache, meta.shared_blocks[None], meta.scratch)  # [1, kvh, Lp, d]
    qp = _heads_as_queries(qd, kvh).permute(1, 0, 2, 3).reshape(1, kvh, b * g, d)
    op, lse_p = _FLASH_LSE(qp, kp, vp, scale=scale)  # [1, kvh, b*g, d], [1, kvh, b*g]
    op = op.view(kvh, b, g, d).transpose(0, 1)
    lse_p = lse_p.view(kvh, b, g).transpose(0, 1)
    if meta.decode_kernel is not None:
        os_, lse_s = meta.decode_kernel(qd.contiguous(), k_cache, v_cache, meta.decode_tables,
                                        meta.decode_lens, scale)
        return _merge(op, lse_p, os_.view(b, kvh, g, d), lse_s.view(b, kvh, g)).reshape(b, h, d)
    out = torch.empty(b, kvh, g, d, dtype=qd.dtype, device=qd.device)
    for grp in meta.decode_groups:
        lo, hi = grp.row_start, grp.row_end
        ks, vs = _gather_kv(k_cache, v_cache, grp.block_tables, meta.scratch)
        os_, lse_s = _FLASH_LSE(_heads_as_queries(qd[lo:hi], kvh), ks, vs, attn_mask=grp.mask(None), scale=scale)
        out[lo:hi] = _merge(op[lo:hi], lse_p[lo:hi], os_, lse_s)
    return out.view(b, h, d)


def _merge(o1: torch.Tensor, lse1: torch.Tensor, o2: torch.Tensor, lse2: torch.Tensor) -> torch.Tensor:
    """Attention over two disjoint key sets from each one's output and log-sum-exp."""
    m = torch.maximum(lse1, lse2)
    w1 = (lse1 - m).exp_().unsqueeze(-1)
    w2 = (lse2 - m).exp_().unsqueeze(-1)
    return (o1 * w1 + o2 * w2) / (w1 + w2)
