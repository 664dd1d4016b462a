"""Paged attention on CUDA through flashinfer's batch prefill/decode wrappers.

UNTESTED on a GPU so far (written on a CPU-only machine): selected automatically only
when CUDA and the ``flashinfer`` package are both present; importing Candor never needs
either (this module imports flashinfer lazily, inside ``available`` / the constructor).

The KV cache layout is already flashinfer's "NHD" paged layout: per layer ``k`` and ``v``
of shape [num_pages, page_size, kv_heads, head_dim], so the same tensors serve both
backends. New K/V rows are written with the torch ``write_kv`` (one ``index_copy_``),
then one wrapper call per layer reads the pages. The wrappers are planned once per step
(``plan`` builds the work split for the batch's lengths) and run once per layer.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from gpu_worker.attention import AttentionMetadata, write_kv

WORKSPACE_BYTES = 128 * 2**20


def available(device: torch.device) -> bool:
    if device.type != "cuda" or not torch.cuda.is_available():
        return False
    try:
        import flashinfer  # noqa: F401
    except ImportError:
        return False
    return True


@dataclass
class FlashInferStep:
    """Per-step state handed to every layer: the planned wrappers and row split."""

    backend: "FlashInferBackend"
    num_prefill_tokens: int
    has_prefill: bool
    has_decode: bool

    def attend(self, q, k, v, k_cache, v_cache, meta: AttentionMetadata,
               scale: float) -> torch.Tensor:
        """Same contract as ``attention.paged_attention`` (flashinfer's default scale,
        1/sqrt(head_dim), is the Llama scale ``scale`` carries)."""
        write_kv(k_cache, v_cache, k, v, meta.slot_mapping)
        b = self.backend
        out = torch.empty_like(q)
        p = self.num_prefill_tokens
        if self.has_prefill:
            out[:p] = b.prefill.run(q[:p], (k_cache, v_cache))
        if self.has_decode:
            out[p:] = b.decode.run(q[p:], (k_cache, v_cache))
        return out


def _paged_indices(chunks, block_size: int, device) -> tuple[torch.Tensor, ...]:
    """flashinfer's CSR description of each sequence's pages after this step's tokens."""
    indptr, indices, last_len = [0], [], []
    for start, n, table in chunks:
        ctx = start + n
        pages = -(-ctx // block_size)
        indices.extend(table[:pages])
        indptr.append(len(indices))
        last_len.append(ctx - (pages - 1) * block_size)
    as_i32 = lambda xs: torch.tensor(xs, dtype=torch.int32, device=device)  # noqa: E731
    return as_i32(indptr), as_i32(indices), as_i32(last_len)


class FlashInferBackend:
    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, block_size: int,
                 dtype: torch.dtype, device: torch.device) -> None:
        import flashinfer

        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.block_size, self.dtype, self.device = block_size, dtype, device
        self.workspace = torch.empty(WORKSPACE_BYTES, dtype=torch.uint8, device=device)
        self.prefill = flashinfer.BatchPrefillWithPagedKVCacheWrapper(self.workspace, "NHD")
        self.decode = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
            self.workspace, "NHD", use_tensor_cores=num_heads // num_kv_heads >= 4)

    def build(self, chunks: list[tuple[int, int, list[int]]], num_decodes: int,
              slot_mapping: torch.Tensor) -> AttentionMetadata:
        """Plan the wrappers for this step; ``chunks`` as in ``attention.build_metadata``."""
        dev, bs = self.device, self.block_size
        num_prefills = len(chunks) - num_decodes
        prefills, decodes = chunks[:num_prefills], chunks[num_prefills:]
        num_prefill_tokens = sum(n for _, n, _ in prefills)
        if prefills:
            qo = [0]
            for _, n, _ in prefills:
                qo.append(qo[-1] + n)
            indptr, indices, last = _paged_indices(prefills, bs, dev)
            self.prefill.plan(torch.tensor(qo, dtype=torch.int32, device=dev), indptr, indices,
                              last, self.num_heads, self.num_kv_heads, self.head_dim, bs,
                              causal=True, q_data_type=self.dtype, kv_data_type=self.dtype)
        if decodes:
            indptr, indices, last = _paged_indices(decodes, bs, dev)
            self.decode.plan(indptr, indices, last, self.num_heads, self.num_kv_heads,
                             self.head_dim, bs, q_data_type=self.dtype,
                             kv_data_type=self.dtype)
        meta = AttentionMetadata(slot_mapping=slot_mapping,
                                 num_prefill_tokens=num_prefill_tokens)
        meta.impl = FlashInferStep(self, num_prefill_tokens, bool(prefills), bool(decodes))
        return meta
