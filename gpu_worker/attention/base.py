"""The attention-backend interface, and what every backend shares: the paged cache layout.

Cache layout, per layer: ``k`` and ``v`` of shape [num_blocks, block_size, kv_heads,
head_dim]. Viewed as [num_blocks * block_size, kv_heads, head_dim], a token's slot
``block_table[pos // block_size] * block_size + pos % block_size`` is one row, so new
K/V are written with a single ``index_copy_`` (``write_kv``) whatever the backend.

A step's batch is flattened: every prefill chunk first, then all single-token decodes.
The runner describes it as ``Chunk``s (start position, number of tokens, block table)
and asks the backend to ``build`` the step's metadata; every attention layer then calls
``meta.attend``. A backend chooses what its metadata holds (masks, block tables, planned
kernels) and how it computes prefills and decodes; the model never looks inside.

Decode-only steps may run at fixed, padded batch sizes through static buffers
(``cuda_graphs``): ``graph_attention`` gives one object per size whose ``meta`` plans a
padded batch over the runner's static slot buffer. A ``capturable`` backend returns the
same metadata object every step (its kernels read buffers re-planned in place), so the
step can be captured as a CUDA graph; the default plans afresh each step, eagerly.

Bidirectional spans (Gemma 3's images): a prefill chunk may name position ranges whose
tokens attend each other both ways (``Spans``: chunk index -> [(first, end)], each range
inside its chunk), on top of the causal mask and inside each layer's window (as HF's
``token_type_ids`` mask: a query at p sees key k when k <= p or both lie in one span, and
k > p - window). A spec with ``image_spans`` is served only by a backend that declares
``spans`` (the registry skips the others); the scheduler never splits a span over chunks.

Batch invariance (the deterministic mode): a spec with ``batch_invariant`` asks that each
query row's result depend on its own keys alone, never on the other rows of the step, on
whether its keys came from the cache or from its own chunk, or on where its prompt was
split into chunks. Only a backend that declares ``batch_invariant`` may serve such a spec
(``registry.select_backend`` skips the others), and it must then keep that promise for
every row it plans.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import ClassVar, Protocol

import torch

Chunk = tuple[int, int, list[int]]  # (start_pos, num_tokens, block_table) of one sequence
LayerKind = tuple[int | None, float | None]  # a layer's (sliding window, score soft-cap)
Spans = dict[int, list[tuple[int, int]]]  # prefill chunk index -> bidirectional (first, end) positions


@dataclass(frozen=True)
class AttentionSpec:
    """What this rank's model asks of attention, fixed at start-up: its share of the heads,
    the cache's block size, dtype and device, the score scale, and each layer's kind."""

    num_heads: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    dtype: torch.dtype
    device: torch.device
    scale: float
    layer_kinds: tuple[LayerKind, ...] = ((None, None),)
    batch_invariant: bool = False  # the deterministic mode (see the module docstring)
    causal: bool = True  # False: a bidirectional encoder (attention/bidirectional.py)
    image_spans: bool = False  # prefill chunks may carry bidirectional spans (Gemma 3's images)

    @property
    def kinds(self) -> list[LayerKind]:
        """The distinct layer kinds (a backend plans once per kind)."""
        return sorted(set(self.layer_kinds), key=repr)

    @property
    def plain(self) -> bool:
        """Every layer attends fully, without a soft-cap."""
        return all(kind == (None, None) for kind in self.layer_kinds)

    @property
    def block_bytes(self) -> int:
        """K and V bytes of one cache block of one layer."""
        elem = torch.empty((), dtype=self.dtype).element_size()
        return 2 * self.block_size * self.num_kv_heads * self.head_dim * elem


class AttentionMetadata(ABC):
    """One step's attention state, built by its backend before the forward pass and read
    by every layer."""

    slot_mapping: torch.Tensor  # [num_tokens] long: the cache row of each new token
    num_prefill_tokens: int

    @abstractmethod
    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
               v_cache: torch.Tensor, window: int | None = None,
               softcap: float | None = None) -> torch.Tensor:
        """q: [T, heads, d]; k, v: [T, kv_heads, d] (already rotated). Writes the new K/V
        into the cache first (later chunks and decodes see them); returns [T, heads, d].
        ``window``: a query at position p sees keys p - window + 1 .. p; ``softcap``:
        scores pass through ``softcap * tanh(score / softcap)``."""


class GraphAttention(Protocol):
    """Decode attention for one fixed batch size (see the module docstring)."""

    graphable: bool  # the metadata it returns may be captured in a CUDA graph

    def meta(self, chunks: list[Chunk], slot_mapping: torch.Tensor) -> AttentionMetadata: ...


class AttentionBackend(ABC):
    """A way to compute paged attention. Subclasses set ``name``, implement ``plan`` and,
    where they need them, ``unavailable`` (cheap: can it serve this spec at all?),
    ``check`` (a start-up self-test) and ``graph_attention``."""

    name: ClassVar[str]
    capturable: ClassVar[bool] = False  # its graph_attention metadata can be captured
    batch_invariant: ClassVar[bool] = False  # it can serve a spec that asks for batch invariance
    spans: ClassVar[bool] = False  # it honours bidirectional spans (``add_spans``)

    def __init__(self, spec: AttentionSpec) -> None:
        self.spec = spec

    @classmethod
    def unavailable(cls, spec: AttentionSpec) -> str | None:
        """Why this backend cannot serve ``spec`` (None: it can). No side effects."""
        return None

    def check(self) -> str | None:
        """Why this built backend must not serve after all (None: it may)."""
        return None

    def build(self, chunks: list[Chunk], num_decodes: int,
              slot_mapping: torch.Tensor | None = None, spans: Spans | None = None) -> AttentionMetadata:
        """This step's metadata; ``chunks`` in flattened-batch order (prefills, then the
        ``num_decodes`` single-token decodes). ``slot_mapping``: a caller-owned buffer
        holding the new tokens' cache rows (computed here when None). ``spans``: the
        prefill chunks' bidirectional ranges (see the module docstring)."""
        if slot_mapping is None:
            slot_mapping = slots(chunks, self.spec.block_size, self.spec.device)
        meta = self.plan(chunks, num_decodes, slot_mapping)
        if spans:
            for i, ranges in spans.items():
                start, n, _ = chunks[i]
                if i >= len(chunks) - num_decodes or any(
                        not start <= lo < hi <= start + n for lo, hi in ranges):
                    raise ValueError(f"a bidirectional span {ranges} is not inside prefill chunk "
                                     f"{i} (positions {start}..{start + n - 1})")
            self.add_spans(meta, chunks, spans)
        return meta

    def add_spans(self, meta: AttentionMetadata, chunks: list[Chunk], spans: Spans) -> None:
        """Make ``meta`` attend ``spans`` both ways (a backend that declares ``spans``)."""
        raise ValueError(f"the {self.name} attention backend cannot attend a span both ways")

    @abstractmethod
    def plan(self, chunks: list[Chunk], num_decodes: int,
             slot_mapping: torch.Tensor) -> AttentionMetadata:
        """``build`` with the slot mapping settled."""

    def graph_attention(self, sizes: list[int], max_blocks_per_seq: int) -> dict[int, GraphAttention]:
        """One decode attention per batch size; by default each step planned afresh."""
        return {size: EagerDecodeAttention(self) for size in sizes}


class EagerDecodeAttention:
    """A fixed-size decode batch planned like any step: its metadata follows the step's
    lengths, so it runs through the static buffers eagerly and is never captured."""

    graphable = False

    def __init__(self, backend: AttentionBackend) -> None:
        self.backend = backend

    def meta(self, chunks: list[Chunk], slot_mapping: torch.Tensor) -> AttentionMetadata:
        return self.backend.build(chunks, len(chunks), slot_mapping)


def kv_slot(table: list[int], pos: int, block_size: int) -> int:
    """The cache row (in the [num_blocks * block_size, ...] view) of position ``pos`` of a
    sequence whose blocks are ``table``."""
    return table[pos // block_size] * block_size + pos % block_size


def slots(chunks: list[Chunk], block_size: int, device: torch.device) -> torch.Tensor:
    """[num_tokens] long: the cache row of every new token of the step."""
    out: list[int] = []
    for start, n, table in chunks:
        if n == 1:
            out.append(kv_slot(table, start, block_size))
        else:
            out.extend(kv_slot(table, pos, block_size) for pos in range(start, start + n))
    return torch.tensor(out, dtype=torch.long, device=device)


def write_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """Store new K/V rows ([num_tokens, kv_heads, head_dim]) at their cache slots."""
    k_cache.view(-1, *k_cache.shape[2:]).index_copy_(0, slot_mapping, k)
    v_cache.view(-1, *v_cache.shape[2:]).index_copy_(0, slot_mapping, v)
