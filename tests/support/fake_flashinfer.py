"""A torch stand-in for the two flashinfer wrappers Candor uses, for CPU tests.

Signatures copy flashinfer-python 0.7.4's (constructor and ``plan`` parameter names and
order, keyword-only where 0.7 made them so): a call with a misspelt or missing argument
fails here as it would there. Semantics follow its docstrings: CSR page tables
(``indptr``, ``indices``, ``last_page_len`` in 1..page_size), NHD ``(k, v)`` caches,
causal prefill masks aligned bottom-right, and ``use_cuda_graph`` wrappers that plan
into caller-owned buffers and read them (not the planned values) when they run, as
a replayed graph does. Unlike the real kernels it accepts float32 (tests compare with HF
in fp32) and any head size; what the real package rejects is ``flashinfer_backend``'s
``unsupported_reason``'s job, tested separately. ``test_fake_signatures_match_real``
compares these signatures with the installed package where there is one.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

__version__ = "0.0-fake"
PLANS: list[dict] = []  # every plan call's inputs (tests inspect where they lived)


def _dtype(x) -> torch.dtype:
    return getattr(torch, x) if isinstance(x, str) else x


def _check_index(name: str, t: torch.Tensor) -> None:
    if t.dtype != torch.int32:
        raise TypeError(f"{name} must be int32, got {t.dtype}")


def _record(kind: str, **tensors: torch.Tensor) -> None:
    for name, t in tensors.items():
        _check_index(name, t)
    PLANS.append({"kind": kind, "devices": {n: t.device.type for n, t in tensors.items()}})


def _attend(q, k_cache, v_cache, pages: list[int], kv_len: int, scale: float, window_left: int = -1,
            soft_cap: float = 0.0) -> torch.Tensor:
    """q: [n, h, d], the last n positions of a kv_len context; causal bottom-right; a query
    at position p sees keys p - window_left .. p when window_left >= 0; scores pass through
    soft_cap * tanh(s / soft_cap) when soft_cap > 0 (flashinfer's documented semantics)."""
    kvh, d = k_cache.shape[2], k_cache.shape[3]
    keys = k_cache[pages].reshape(-1, kvh, d)[:kv_len].transpose(0, 1)
    vals = v_cache[pages].reshape(-1, kvh, d)[:kv_len].transpose(0, 1)
    n = q.shape[0]
    k_pos, q_pos = torch.arange(kv_len)[None, :], torch.arange(kv_len - n, kv_len)[:, None]
    mask = k_pos <= q_pos
    if window_left >= 0:
        mask &= k_pos >= q_pos - window_left
    qh = q.transpose(0, 1)
    if not soft_cap or soft_cap <= 0:
        o = F.scaled_dot_product_attention(qh, keys, vals, attn_mask=mask, scale=scale,
                                           enable_gqa=q.shape[1] != kvh)
        return o.transpose(0, 1)
    keys = keys.repeat_interleave(q.shape[1] // kvh, 0)
    vals = vals.repeat_interleave(q.shape[1] // kvh, 0)
    scores = torch.matmul(qh, keys.transpose(-1, -2)) * scale
    if soft_cap and soft_cap > 0:
        scores = torch.tanh(scores / soft_cap) * soft_cap
    probs = torch.softmax(scores.masked_fill(~mask, float("-inf")), dim=-1, dtype=torch.float32)
    return torch.matmul(probs.to(q.dtype), vals).transpose(0, 1)


def _unpack(paged_kv_cache, kv_layout: str):
    if kv_layout != "NHD" or not isinstance(paged_kv_cache, tuple):
        raise NotImplementedError("the fake takes NHD (k, v) tuples only")
    return paged_kv_cache


class _Paged:
    """CSR page table state shared by both wrappers."""

    def _store(self, indptr, indices, last, page_size):
        self._page_size = page_size
        if self._use_cuda_graph:
            if len(last) != self._fixed_batch_size:
                raise ValueError("The batch size should be fixed in cudagraph mode")
            if len(indices) > len(self._paged_kv_indices_buf):
                raise ValueError("The size of indices should be less than or equal to the allocated buffer")
            self._paged_kv_indptr_buf.copy_(indptr)
            self._paged_kv_last_page_len_buf.copy_(last)
            self._paged_kv_indices_buf[: len(indices)].copy_(indices)
        else:
            self._paged_kv_indptr_buf = indptr.clone()
            self._paged_kv_indices_buf = indices.clone()
            self._paged_kv_last_page_len_buf = last.clone()

    def _sequences(self):
        """(pages, kv_len) per sequence, read from the buffers as a kernel would."""
        indptr = self._paged_kv_indptr_buf.tolist()
        indices = self._paged_kv_indices_buf.tolist()
        last = self._paged_kv_last_page_len_buf.tolist()
        for i in range(len(indptr) - 1):
            pages = indices[indptr[i] : indptr[i + 1]]
            if not 1 <= last[i] <= self._page_size or not pages:
                raise ValueError(f"bad page table for sequence {i}")
            yield pages, (len(pages) - 1) * self._page_size + last[i]

    def _check_q(self, q):
        if q.dtype != self._q_data_type:
            raise ValueError(f"q is {q.dtype}, planned {self._q_data_type}")


class BatchDecodeWithPagedKVCacheWrapper(_Paged):
    def __init__(
        self,
        float_workspace_buffer: torch.Tensor,
        kv_layout: str = "NHD",
        use_cuda_graph: bool = False,
        use_tensor_cores: bool = False,
        paged_kv_indptr_buffer: torch.Tensor | None = None,
        paged_kv_indices_buffer: torch.Tensor | None = None,
        paged_kv_last_page_len_buffer: torch.Tensor | None = None,
        backend: str = "auto",
        jit_args: list | None = None,
        jit_kwargs: dict | None = None,
    ) -> None:
        self._kv_layout = kv_layout
        self._use_cuda_graph = use_cuda_graph
        self._use_tensor_cores = use_tensor_cores
        if use_cuda_graph:
            for name, buf in (("paged_kv_indptr_buffer", paged_kv_indptr_buffer),
                              ("paged_kv_indices_buffer", paged_kv_indices_buffer),
                              ("paged_kv_last_page_len_buffer", paged_kv_last_page_len_buffer)):
                if not torch.is_tensor(buf):
                    raise ValueError(f"{name} should be a torch.Tensor in cudagraph mode")
            self._fixed_batch_size = len(paged_kv_last_page_len_buffer)
            if len(paged_kv_indptr_buffer) != self._fixed_batch_size + 1:
                raise ValueError("The size of paged_kv_indptr_buffer should be batch_size + 1")
        self._paged_kv_indptr_buf = paged_kv_indptr_buffer
        self._paged_kv_indices_buf = paged_kv_indices_buffer
        self._paged_kv_last_page_len_buf = paged_kv_last_page_len_buffer

    @property
    def is_cuda_graph_enabled(self) -> bool:
        return self._use_cuda_graph

    def plan(
        self,
        indptr: torch.Tensor,
        indices: torch.Tensor,
        last_page_len: torch.Tensor,
        num_qo_heads: int,
        num_kv_heads: int,
        head_dim: int,
        page_size: int,
        *,
        pos_encoding_mode: str = "NONE",
        window_left: int = -1,
        window_right: int = 0,
        logits_soft_cap: float | None = None,
        q_data_type: Any = "float16",
        kv_data_type: Any = None,
        o_data_type: Any = None,
        data_type: Any = None,
        sm_scale: float | None = None,
        rope_scale: float | None = None,
        rope_theta: float | None = None,
        non_blocking: bool = True,
        block_tables: torch.Tensor | None = None,
        seq_lens: torch.Tensor | None = None,
        fixed_split_size: int | None = None,
        disable_split_kv: bool = False,
        q_len_per_req: int = 1,
        is_causal: bool | None = None,
        use_token_head_sf: bool = False,
    ) -> None:
        _record("decode", indptr=indptr, indices=indices, last_page_len=last_page_len)
        if num_qo_heads % num_kv_heads:
            raise ValueError("num_qo_heads must be a multiple of num_kv_heads")
        self._store(indptr, indices, last_page_len, page_size)
        self._q_data_type = _dtype(q_data_type)
        self._sm_scale = head_dim**-0.5 if sm_scale is None else sm_scale
        self._window_left, self._soft_cap = window_left, logits_soft_cap or 0.0

    def run(self, q: torch.Tensor, paged_kv_cache, *args, out=None, lse=None, return_lse=False,
            enable_pdl=None, **kwargs) -> torch.Tensor:
        self._check_q(q)
        k_cache, v_cache = _unpack(paged_kv_cache, self._kv_layout)
        seqs = list(self._sequences())
        if len(seqs) != q.shape[0]:
            raise ValueError(f"planned {len(seqs)} requests, q has {q.shape[0]} rows")
        rows = [_attend(q[i:i + 1], k_cache, v_cache, p, n, self._sm_scale, self._window_left, self._soft_cap)
                for i, (p, n) in enumerate(seqs)]
        return torch.cat(rows).to(q.dtype)


class BatchPrefillWithPagedKVCacheWrapper(_Paged):
    def __init__(
        self,
        float_workspace_buffer: torch.Tensor,
        kv_layout: str = "NHD",
        use_cuda_graph: bool = False,
        qo_indptr_buf: torch.Tensor | None = None,
        paged_kv_indptr_buf: torch.Tensor | None = None,
        paged_kv_indices_buf: torch.Tensor | None = None,
        paged_kv_last_page_len_buf: torch.Tensor | None = None,
        custom_mask_buf: torch.Tensor | None = None,
        mask_indptr_buf: torch.Tensor | None = None,
        backend: str = "auto",
        jit_args: list | None = None,
        jit_kwargs: dict | None = None,
        variant_owns_mask: bool = False,
        max_total_num_rows: int | None = None,
    ) -> None:
        if use_cuda_graph:
            raise NotImplementedError("the fake has no graph-mode prefill (Candor uses none)")
        self._kv_layout = kv_layout
        self._use_cuda_graph = False

    def plan(
        self,
        qo_indptr: torch.Tensor,
        paged_kv_indptr: torch.Tensor,
        paged_kv_indices: torch.Tensor,
        paged_kv_last_page_len: torch.Tensor,
        num_qo_heads: int,
        num_kv_heads: int,
        head_dim_qk: int,
        page_size: int,
        head_dim_vo: int | None = None,
        custom_mask: torch.Tensor | None = None,
        packed_custom_mask: torch.Tensor | None = None,
        causal: bool = False,
        pos_encoding_mode: str = "NONE",
        use_fp16_qk_reduction: bool = False,
        sm_scale: float | None = None,
        window_left: int = -1,
        logits_soft_cap: float | None = None,
        rope_scale: float | None = None,
        rope_theta: float | None = None,
        q_data_type: Any = "float16",
        kv_data_type: Any = None,
        o_data_type: Any = None,
        non_blocking: bool = True,
        prefix_len_ptr: torch.Tensor | None = None,
        token_pos_in_items_ptr: torch.Tensor | None = None,
        token_pos_in_items_len: int = 0,
        max_item_len_ptr: torch.Tensor | None = None,
        seq_lens: torch.Tensor | None = None,
        seq_lens_q: torch.Tensor | None = None,
        block_tables: torch.Tensor | None = None,
        max_token_per_sequence: int | None = None,
        max_sequence_kv: int | None = None,
        fixed_split_size: int | None = None,
        disable_split_kv: bool = False,
        uniform_q_len: int | None = None,
        use_token_head_sf: bool = False,
    ) -> None:
        _record("prefill", qo_indptr=qo_indptr, indptr=paged_kv_indptr, indices=paged_kv_indices,
                last_page_len=paged_kv_last_page_len)
        if not causal:
            raise NotImplementedError("the fake models causal prefill only")
        self._store(paged_kv_indptr, paged_kv_indices, paged_kv_last_page_len, page_size)
        self._qo_indptr = qo_indptr.tolist()
        self._q_data_type = _dtype(q_data_type)
        self._sm_scale = head_dim_qk**-0.5 if sm_scale is None else sm_scale
        self._window_left, self._soft_cap = window_left, logits_soft_cap or 0.0

    def run(self, q: torch.Tensor, paged_kv_cache, *args, out=None, lse=None, return_lse=False,
            enable_pdl=None, **kwargs) -> torch.Tensor:
        self._check_q(q)
        k_cache, v_cache = _unpack(paged_kv_cache, self._kv_layout)
        qo = self._qo_indptr
        if qo[-1] != q.shape[0]:
            raise ValueError(f"planned {qo[-1]} query rows, q has {q.shape[0]}")
        rows = []
        for i, (pages, kv_len) in enumerate(self._sequences()):
            if qo[i + 1] - qo[i] > kv_len:
                raise ValueError("more query rows than keys")
            rows.append(_attend(q[qo[i]:qo[i + 1]], k_cache, v_cache, pages, kv_len, self._sm_scale,
                                self._window_left, self._soft_cap))
        return torch.cat(rows).to(q.dtype)


CUDAGraphBatchDecodeWithPagedKVCacheWrapper = None  # Candor uses the use_cuda_graph flag
