"""One adapter's tensors on one tensor-parallel rank, read through the layers they adapt.

Each adapted layer gets one pair ``A`` [P*r, in] and ``Bt`` [P*r, out] (this rank's
columns or rows), so its delta for rows ``x`` is ``(x A^T) Bt``: one matmul pair per layer
even where the layer fuses several projections (q|k|v, gate|up). The P projections'
ranks sit side by side in A, and B is block-diagonal (projection j's rank columns feed
only projection j's output rows; the rest are zeros), with the adapter's scaling folded
in. Slicing is the wrapped layer's own ``weight_loader``: B [out, r] is split like a
column layer's output (per q/k/v or gate/up part), A [r, in] like a row layer's input;
the other factor is whole on every rank. A row-parallel layer's delta is a partial sum
that its all-reduce adds with the base output's, so adapters cost no extra collective.
"""

from __future__ import annotations

from collections import defaultdict

import torch
from torch import nn

from gpu_worker.lora.peft_files import AdapterLayout, AdapterPair
from gpu_worker.models.parallel import RowParallelLinear
from gpu_worker.models.weights import CheckpointTensor, copy_into

SiteKey = tuple[int, str]  # (layer index, the decoder's module name: qkv_proj ...)


def adapted_layer(model: nn.Module, layer: int, module: str) -> nn.Module:
    block = model.model.layers[layer]
    return getattr(block.self_attn if module in ("qkv_proj", "o_proj") else block.mlp, module)


class AdapterWeights:
    """``pairs``: (A, Bt) per adapted layer of this rank; ``min_rows``: the row count a
    group of its rows is padded to in the deterministic mode (``batch.measure_delta_rows``)."""

    def __init__(self, pairs: dict[SiteKey, tuple[torch.Tensor, torch.Tensor]], min_rows: int = 1) -> None:
        self.pairs = pairs
        self.min_rows = min_rows

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for pair in self.pairs.values() for t in pair)

    def to(self, device: torch.device) -> AdapterWeights:
        """The same adapter on ``device`` (itself when it is there already)."""
        if all(a.device == device for a, _ in self.pairs.values()):
            return self
        return AdapterWeights({k: (a.to(device), b.to(device)) for k, (a, b) in self.pairs.items()},
                              self.min_rows)


def _load_pair(layer: nn.Module, a: torch.Tensor, b: torch.Tensor, pair: AdapterPair, f) -> None:
    """Projection ``pair``'s A into ``a`` [r, in_local] and B into ``b`` [out_local, r]
    (views into the packed pair), sliced by ``layer``'s weight_loader."""
    source_a, source_b = CheckpointTensor(f, pair.a_key), CheckpointTensor(f, pair.b_key)
    if isinstance(layer, RowParallelLinear):
        layer.weight_loader(a, source_a)  # this rank's input columns
        copy_into(b, source_b)
    else:
        copy_into(a, source_a)
        layer.weight_loader(b, source_b, *(() if pair.part is None else (pair.part,)))


def load_adapter(model: nn.Module, layout: AdapterLayout, dtype: torch.dtype) -> AdapterWeights:
    """This rank's part of the adapter ``layout`` describes (checked by ``read_adapter``),
    in host memory."""
    from safetensors import safe_open

    sites: dict[SiteKey, list[AdapterPair]] = defaultdict(list)
    for pair in layout.pairs:
        sites[(pair.layer, pair.module)].append(pair)
    r = layout.rank
    out: dict[SiteKey, tuple[torch.Tensor, torch.Tensor]] = {}
    with torch.no_grad(), safe_open(layout.file, framework="pt", device="cpu") as f:
        for key, pairs in sites.items():
            layer = adapted_layer(model, *key)
            out_local, in_local = layer.out_features, layer.in_features  # (this rank's)
            a = torch.zeros(len(pairs) * r, in_local)
            b = torch.zeros(out_local, len(pairs) * r)
            for j, pair in enumerate(pairs):
                _load_pair(layer, a.narrow(0, j * r, r), b.narrow(1, j * r, r), pair, f)
            bt = (b * layout.scaling).t()
            out[key] = (a.to(dtype).contiguous(), bt.to(dtype).contiguous())
    return AdapterWeights(out)
