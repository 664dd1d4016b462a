"""Attention for bidirectional encoders (BERT family): every token of a sequence sees
every other one, and nothing is kept between steps.

An encoder's prompt is computed whole in one step (the scheduler never splits a
bidirectional model's prompt: ``Planner(whole_prompts=True)``), so each sequence attends
to its own fresh K/V only; the KV cache is never read or written. One SDPA call per
sequence, without a mask: a row's result depends on its own sequence alone, so the
backend is batch-invariant.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from gpu_worker.attention.base import AttentionBackend, AttentionMetadata, AttentionSpec, Chunk, Spans


class BidirectionalMetadata(AttentionMetadata):
    def __init__(self, bounds: list[tuple[int, int]], scale: float, slot_mapping: torch.Tensor) -> None:
        self.bounds = bounds  # each sequence's row range in the flattened batch
        self.scale = scale
        self.slot_mapping = slot_mapping
        self.num_prefill_tokens = bounds[-1][1] if bounds else 0

    def attend(self, q, k, v, k_cache=None, v_cache=None, window=None, softcap=None):
        out = torch.empty_like(q)
        for start, end in self.bounds:  # [heads, n, d] per sequence
            out[start:end] = F.scaled_dot_product_attention(
                q[start:end].transpose(0, 1), k[start:end].transpose(0, 1),
                v[start:end].transpose(0, 1), scale=self.scale).transpose(0, 1)
        return out


class BidirectionalBackend(AttentionBackend):
    name = "bidirectional"
    batch_invariant = True

    @classmethod
    def unavailable(cls, spec: AttentionSpec) -> str | None:
        if spec.causal:
            return "for bidirectional (encoder) models only"
        if not spec.plain:
            return "encoders have no sliding windows or soft-caps"
        return None

    def build(self, chunks: list[Chunk], num_decodes: int,
              slot_mapping: torch.Tensor | None = None, spans: Spans | None = None) -> AttentionMetadata:
        """(``spans``: every position of an encoder's prompt already attends every other,
        so an image span needs nothing more; none come, as no encoder takes images.)"""
        return self.plan(chunks, num_decodes, torch.empty(0, dtype=torch.long))

    def plan(self, chunks: list[Chunk], num_decodes: int, slot_mapping: torch.Tensor) -> AttentionMetadata:
        bounds, row = [], 0
        for start, n, _ in chunks:
            if start != 0:
                raise ValueError(f"an encoder's prompt must be computed whole, in one step "
                                 f"(a chunk starts at position {start})")
            bounds.append((row, row + n))
            row += n
        return BidirectionalMetadata(bounds, self.spec.scale, slot_mapping)
