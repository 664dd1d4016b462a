"""Paged attention on CUDA through flashinfer's batch prefill/decode wrappers.

Status: every call here was read against flashinfer-python 0.7.4's source (``decode.py``,
``prefill.py``, ``jit/utils.py``, ``aot.py``) and cross-checked with 0.6.13 (the version
``bench/gpu_check.sh`` carries: 0.7's wheels are too big to carry), whose signatures are
the same for what we use. It has NEVER RUN ON A GPU. On CPU,
``tests/unit/gpu_worker/test_cuda_graphs.py`` drives it through ``tests/support/fake_flashinfer.py`` (0.7.4's signatures, torch arithmetic) to
greedy parity with HF, graph-mode wrappers included; the real kernels, their numerics
and CUDA-graph capture are ``bench/gpu_check.sh``'s to check.

What the reading established (and the code follows):
- ``BatchPrefillWithPagedKVCacheWrapper(workspace, "NHD")`` and
  ``BatchDecodeWithPagedKVCacheWrapper(workspace, "NHD", use_tensor_cores=...)``;
  ``use_tensor_cores`` still exists (tensor-core decode pays off for GQA groups >= 4).
  The float workspace "must be initialized to 0 for its first use": zeros, not empty.
- ``plan(qo_indptr, paged_kv_indptr, paged_kv_indices, paged_kv_last_page_len,
  num_qo_heads, num_kv_heads, head_dim, page_size, causal=..., sm_scale=...,
  q_data_type=..., kv_data_type=...)`` for prefill; decode's ``plan`` is the same without
  ``qo_indptr`` and ``causal``. Everything after ``page_size`` goes by keyword (0.7
  deprecates positional extras). ``sm_scale`` is passed explicitly (default would be
  1/sqrt(head_dim), the Llama scale, but we do not rely on it).
- ``plan`` copies the index tensors to the device itself and reads ``indptr.to("cpu")``:
  we hand it host int32 tensors, so planning never waits on the GPU.
- ``run(q, (k_cache, v_cache))`` takes the NHD tuple [pages, page_size, kv_heads, dim].
- Causal prefill masks bottom-right (query i of a chunk sees keys up to
  ``kv_len - qo_len + i``), which is what a later chunk of a long prompt needs.
- dtypes: the kernels are instantiated for fp16/bf16 (and fp8 KV); ``jit/utils.py``'s
  dtype map has no float32 at all, so fp32 stays on the torch path.
- head_dim: 64, 128 and 256 are the sizes flashinfer's ahead-of-time build covers
  (``aot.py``: fa2 (64, 128, 256), fa3 adds (192, 128)); the JIT may build others, but
  that is unchecked, so they (the tiny test model's 16 among them) stay on the torch path.
- CUDA graphs: a wrapper built with ``use_cuda_graph=True`` and caller-owned
  ``paged_kv_indptr_buffer`` [batch + 1], ``paged_kv_indices_buffer`` and
  ``paged_kv_last_page_len_buffer`` [batch] has a fixed batch size; ``plan`` (outside the
  graph) rewrites those buffers in place before each replay. ``CUDAGraphBatchDecode...``
  is a thin subclass of the same; we use the base class with the flag.

New K/V rows are written with the torch ``write_kv`` (one ``index_copy_``), then one
wrapper call per layer reads the pages; the wrappers are planned once per step.

Per-layer attention: ``window_left`` and ``logits_soft_cap`` are ``plan`` arguments, so
each distinct ``(window, softcap)`` among the layers (``layer_kinds``: e.g. Gemma 2's
sliding and global layers) has its own prefill and decode wrapper, all planned over the
same page table and sharing the float workspace (they run one after another). HF's
window w (a query sees keys p - w + 1 .. p) is flashinfer's ``window_left = w - 1``.
``registry`` imports this module only when it considers flashinfer, and this module
imports flashinfer only inside functions: importing Candor needs neither CUDA nor it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from gpu_worker.attention.base import (AttentionBackend, AttentionMetadata, AttentionSpec, Chunk, LayerKind,
                                       kv_slot, write_kv)

WORKSPACE_BYTES = 128 * 2**20
SUPPORTED_DTYPES = (torch.float16, torch.bfloat16)
SUPPORTED_HEAD_DIMS = (64, 128, 256)
SELF_CHECK_TOLERANCE = 0.05  # max |flashinfer - SDPA| on unit-scale random inputs


def unsupported_reason(head_dim: int, dtype: torch.dtype) -> str | None:
    """Why flashinfer cannot serve this model (None: it can). Pure: no CUDA needed."""
    if dtype not in SUPPORTED_DTYPES:
        return f"flashinfer kernels take fp16/bf16, not {dtype}"
    if head_dim not in SUPPORTED_HEAD_DIMS:
        return f"head_dim {head_dim} is not one of flashinfer's {SUPPORTED_HEAD_DIMS}"
    return None


def available(device: torch.device) -> bool:
    if device.type != "cuda" or not torch.cuda.is_available():
        return False
    try:
        import flashinfer  # noqa: F401
    except ImportError:
        return False
    return True


def paged_indices(chunks: list[Chunk], block_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """flashinfer's CSR description of each sequence's pages after this step's tokens:
    host int32 (indptr [n + 1], indices [total pages], last_page_len [n] in 1..page)."""
    indptr, indices, last_len = [0], [], []
    for start, n, table in chunks:
        ctx = start + n
        pages = -(-ctx // block_size)
        indices.extend(table[:pages])
        indptr.append(len(indices))
        last_len.append(ctx - (pages - 1) * block_size)
    as_i32 = lambda xs: torch.tensor(xs, dtype=torch.int32)  # noqa: E731
    return as_i32(indptr), as_i32(indices), as_i32(last_len)


def qo_indptr(chunks: list[Chunk]) -> torch.Tensor:
    out = [0]
    for _, n, _ in chunks:
        out.append(out[-1] + n)
    return torch.tensor(out, dtype=torch.int32)


def window_left(window: int | None) -> int:
    return -1 if window is None else window - 1


@dataclass
class FlashInferStep(AttentionMetadata):
    """Per-step state handed to every layer: the planned wrappers (per layer kind) and
    the row split."""

    slot_mapping: torch.Tensor
    num_prefill_tokens: int
    prefill: dict | None  # kind -> planned prefill wrapper; None: no prefill rows
    decode: dict | None  # kind -> planned decode wrapper; None: no decode rows

    def attend(self, q, k, v, k_cache, v_cache, window=None, softcap=None):
        kind = (window, softcap)
        write_kv(k_cache, v_cache, k, v, self.slot_mapping)
        q = q.contiguous()  # the model hands q as a view of the fused q|k rotation
        p = self.num_prefill_tokens
        if self.prefill is None:
            return self.decode[kind].run(q, (k_cache, v_cache))
        if self.decode is None:
            return self.prefill[kind].run(q, (k_cache, v_cache))
        out = torch.empty_like(q)
        out[:p] = self.prefill[kind].run(q[:p], (k_cache, v_cache))
        out[p:] = self.decode[kind].run(q[p:], (k_cache, v_cache))
        return out


class FlashInferBackend(AttentionBackend):
    """One prefill and one decode wrapper per layer kind (see the module docstring)."""

    name = "flashinfer"
    capturable = True

    def __init__(self, spec: AttentionSpec) -> None:
        import flashinfer

        super().__init__(spec)
        reason = unsupported_reason(spec.head_dim, spec.dtype)
        if reason:
            raise ValueError(reason)
        self.num_heads, self.num_kv_heads, self.head_dim = spec.num_heads, spec.num_kv_heads, spec.head_dim
        self.block_size, self.dtype, self.device = spec.block_size, spec.dtype, spec.device
        self.sm_scale = spec.scale
        self.tensor_core_decode = spec.num_heads // spec.num_kv_heads >= 4
        self.workspace = torch.zeros(WORKSPACE_BYTES, dtype=torch.uint8, device=spec.device)
        self.kinds: list[LayerKind] = spec.kinds
        self.prefill = {kind: flashinfer.BatchPrefillWithPagedKVCacheWrapper(self.workspace, "NHD")
                        for kind in self.kinds}
        self.decode = {kind: flashinfer.BatchDecodeWithPagedKVCacheWrapper(
            self.workspace, "NHD", use_tensor_cores=self.tensor_core_decode) for kind in self.kinds}

    @classmethod
    def unavailable(cls, spec: AttentionSpec) -> str | None:
        if spec.device.type != "cuda":
            return "not a CUDA device"
        if not available(spec.device):
            return "flashinfer is not installed (or CUDA is unavailable)"
        return unsupported_reason(spec.head_dim, spec.dtype)

    def check(self) -> str | None:
        err = self.self_check()
        if err <= SELF_CHECK_TOLERANCE:
            return None
        return f"flashinfer disagrees with SDPA by {err:.3g} on the start-up check"

    # ------------------------------------------------------------------ planning

    def plan_prefill(self, wrapper, chunks: list[Chunk], kind: LayerKind = (None, None)) -> None:
        indptr, indices, last = paged_indices(chunks, self.block_size)
        wrapper.plan(qo_indptr(chunks), indptr, indices, last, self.num_heads, self.num_kv_heads,
                     self.head_dim, self.block_size, causal=True, sm_scale=self.sm_scale,
                     window_left=window_left(kind[0]), logits_soft_cap=kind[1] or 0.0,
                     q_data_type=self.dtype, kv_data_type=self.dtype)

    def plan_decode(self, wrapper, chunks: list[Chunk], kind: LayerKind = (None, None)) -> None:
        indptr, indices, last = paged_indices(chunks, self.block_size)
        wrapper.plan(indptr, indices, last, self.num_heads, self.num_kv_heads, self.head_dim,
                     self.block_size, sm_scale=self.sm_scale, window_left=window_left(kind[0]),
                     logits_soft_cap=kind[1] or 0.0, q_data_type=self.dtype, kv_data_type=self.dtype)

    def plan(self, chunks: list[Chunk], num_decodes: int, slot_mapping: torch.Tensor) -> FlashInferStep:
        """Plan the wrappers for this step."""
        num_prefills = len(chunks) - num_decodes
        prefills, decodes = chunks[:num_prefills], chunks[num_prefills:]
        for kind in self.kinds:
            if prefills:
                self.plan_prefill(self.prefill[kind], prefills, kind)
            if decodes:
                self.plan_decode(self.decode[kind], decodes, kind)
        return FlashInferStep(slot_mapping, sum(n for _, n, _ in prefills),
                              self.prefill if prefills else None, self.decode if decodes else None)

    # ------------------------------------------------------------------ CUDA graphs

    def graph_attention(self, sizes: list[int], max_blocks_per_seq: int) -> dict[int, GraphDecodeAttention]:
        """Decode attention per captured batch size, over one page-id buffer (int32, on the
        device) all sizes share: only one replays at a time, and it holds the largest size
        times the most pages one sequence can have."""
        page_ids = torch.zeros(max(sizes) * max_blocks_per_seq, dtype=torch.int32, device=self.device)
        return {size: GraphDecodeAttention(self, size, page_ids) for size in sizes}

    # ------------------------------------------------------------------ start-up check

    def self_check(self) -> float:
        """Plan and run a small chunked prefill and a two-sequence decode on a throwaway
        cache, against torch SDPA; returns the max abs difference. Also compiles (JIT)
        the kernels at start-up rather than on the first request."""
        bs, dev, dt = self.block_size, self.device, self.dtype
        h, kvh, d = self.num_heads, self.num_kv_heads, self.head_dim
        g = torch.Generator(device="cpu").manual_seed(0)
        rnd = lambda *s: torch.randn(*s, generator=g).to(dev, dt)  # noqa: E731
        long_pages, short_pages = -(-(bs + 3) // bs), -(-2 // bs)
        pages = torch.randperm(2 * long_pages + short_pages, generator=g).tolist()  # shuffled ids
        table_a, table_b = pages[:long_pages], pages[long_pages:2 * long_pages]
        table_c = pages[2 * long_pages:]
        k_cache, v_cache = rnd(len(pages), bs, kvh, d), rnd(len(pages), bs, kvh, d)
        flat_k, flat_v = k_cache.view(-1, kvh, d), v_cache.view(-1, kvh, d)

        def reference(q, table, ctx):  # q: [n, h, d] for the last n positions of ctx
            slots = torch.tensor([kv_slot(table, p, bs) for p in range(ctx)], device=dev)
            keys, vals = flat_k[slots].transpose(0, 1), flat_v[slots].transpose(0, 1)
            n = q.shape[0]
            mask = torch.arange(ctx, device=dev)[None, :] <= torch.arange(ctx - n, ctx, device=dev)[:, None]
            o = torch.nn.functional.scaled_dot_product_attention(
                q.transpose(0, 1).float(), keys.float(), vals.float(), attn_mask=mask,
                scale=self.sm_scale, enable_gqa=h != kvh)
            return o.transpose(0, 1)

        # A 3-token chunk at the end of a (bs + 3)-token context, then two decodes.
        pre = [(bs, 3, table_a)]
        dec = [(bs + 2, 1, table_b), (1, 1, table_c)]
        import flashinfer

        prefill = flashinfer.BatchPrefillWithPagedKVCacheWrapper(self.workspace, "NHD")
        decode = flashinfer.BatchDecodeWithPagedKVCacheWrapper(self.workspace, "NHD",
                                                               use_tensor_cores=self.tensor_core_decode)
        self.plan_prefill(prefill, pre)
        qp = rnd(3, h, d)
        err = (prefill.run(qp, (k_cache, v_cache)).float() - reference(qp, table_a, bs + 3)).abs().max()
        self.plan_decode(decode, dec)
        qd = rnd(2, h, d)
        out = decode.run(qd, (k_cache, v_cache)).float()
        for i, (start, _, table) in enumerate(dec):
            err = torch.maximum(err, (out[i:i + 1] - reference(qd[i:i + 1], table, start + 1)).abs().max())
        return float(err)


class GraphDecodeAttention:
    """Decode attention for one captured batch size: a ``use_cuda_graph`` wrapper over
    caller-owned index buffers, and one fixed ``FlashInferStep`` the graph was captured
    with. ``meta`` re-plans the wrapper (host side, outside the graph) for the step's
    padded batch, which rewrites the buffers the captured kernels read."""

    graphable = True

    def __init__(self, backend: FlashInferBackend, size: int, indices: torch.Tensor) -> None:
        import flashinfer

        dev = backend.device
        self.backend, self.size = backend, size
        self.indptr = torch.zeros(size + 1, dtype=torch.int32, device=dev)
        self.indices = indices
        self.last_page_len = torch.ones(size, dtype=torch.int32, device=dev)
        # one wrapper per layer kind over the same page-table buffers (same values)
        self.wrappers = {kind: flashinfer.BatchDecodeWithPagedKVCacheWrapper(
            backend.workspace, "NHD", use_cuda_graph=True,
            use_tensor_cores=backend.tensor_core_decode,
            paged_kv_indptr_buffer=self.indptr, paged_kv_indices_buffer=self.indices,
            paged_kv_last_page_len_buffer=self.last_page_len) for kind in backend.kinds}
        self._meta: FlashInferStep | None = None

    def meta(self, chunks: list[Chunk], slot_mapping: torch.Tensor) -> FlashInferStep:
        if len(chunks) != self.size:
            raise ValueError(f"{len(chunks)} rows planned on the size-{self.size} graph")
        for kind, wrapper in self.wrappers.items():
            self.backend.plan_decode(wrapper, chunks, kind)
        if self._meta is None:
            self._meta = FlashInferStep(slot_mapping, 0, None, self.wrappers)
        elif self._meta.slot_mapping.data_ptr() != slot_mapping.data_ptr():
            raise ValueError("a captured graph's slot mapping must stay the same buffer")
        return self._meta
