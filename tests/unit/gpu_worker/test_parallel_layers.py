"""Each tensor-parallel layer loads its own rank's slice of a checkpoint tensor (read from
a real safetensors file), for separate and fused checkpoint layouts, replicated KV heads
and the padded vocabulary; an adapter's matrices load through the layer they wrap."""

from __future__ import annotations

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn

from gpu_worker.model_config import parse_config
from gpu_worker.models.parallel import (ColumnParallelLinear, MergedColumnParallelLinear, QKVParallelLinear,
                                        RowParallelLinear, TPGroup, VocabParallelEmbedding)
from gpu_worker.models.weights import CheckpointTensor
from gpu_worker.tp_shard import tp_shard

HD, HEADS, KV_HEADS, HIDDEN, INTER, VOCAB = 2, 4, 2, 8, 12, 11
CFG = parse_config({"model_type": "llama", "vocab_size": VOCAB, "hidden_size": HIDDEN,
                    "intermediate_size": INTER, "num_hidden_layers": 1, "num_attention_heads": HEADS,
                    "num_key_value_heads": KV_HEADS, "head_dim": HD})


def _tp(rank: int, size: int) -> TPGroup:
    return TPGroup(tp_shard(CFG, rank, size))


def _rows(n: int, cols: int, offset: float) -> torch.Tensor:
    return torch.arange(n * cols, dtype=torch.float32).view(n, cols) + offset


@pytest.fixture
def checkpoint(tmp_path):
    q, k, v = _rows(HEADS * HD, HIDDEN, 0), _rows(KV_HEADS * HD, HIDDEN, 1000), _rows(KV_HEADS * HD, HIDDEN, 2000)
    gate, up = _rows(INTER, HIDDEN, 3000), _rows(INTER, HIDDEN, 4000)
    tensors = {"q": q, "k": k, "v": v, "qkv": torch.cat([q, k, v]), "gate": gate, "up": up,
               "gate_up": torch.cat([gate, up]), "down": _rows(HIDDEN, INTER, 5000),
               "bias": torch.arange(HIDDEN, dtype=torch.float32), "embed": _rows(VOCAB, HIDDEN, 6000),
               "lora_b": _rows(INTER, 3, 7000), "lora_a": _rows(3, INTER, 8000)}
    save_file(tensors, tmp_path / "w.safetensors")
    with safe_open(str(tmp_path / "w.safetensors"), framework="pt") as f:
        yield tensors, lambda name: CheckpointTensor(f, name)


def _load(layer: nn.Module, param: torch.Tensor, source: CheckpointTensor, *ids) -> int:
    with torch.no_grad():
        return layer.weight_loader(param, source, *ids)


def test_qkv_loads_this_ranks_heads_from_separate_or_fused_tensors(checkpoint):
    tensors, open_ = checkpoint
    for rank, size, kv_head in ((1, 2, 1), (3, 4, 1), (0, 4, 0)):  # 4 ranks: KV heads replicated
        heads = HEADS // size
        want = torch.cat([tensors["q"][rank * heads * HD:(rank + 1) * heads * HD],
                          tensors["k"][kv_head * HD:(kv_head + 1) * HD] if size > KV_HEADS else
                          tensors["k"][rank * HD:(rank + 1) * HD],
                          tensors["v"][kv_head * HD:(kv_head + 1) * HD] if size > KV_HEADS else
                          tensors["v"][rank * HD:(rank + 1) * HD]])
        separate = QKVParallelLinear(HIDDEN, HD, HEADS, KV_HEADS, False, _tp(rank, size))
        n = sum(_load(separate, separate.weight, open_(part), part) for part in "qkv")
        assert n == separate.weight.numel() and torch.equal(separate.weight, want), (rank, size)
        fused = QKVParallelLinear(HIDDEN, HD, HEADS, KV_HEADS, False, _tp(rank, size))
        assert _load(fused, fused.weight, open_("qkv")) == fused.weight.numel()
        assert torch.equal(fused.weight, want)


def test_merged_and_row_layers_slice_their_dimension(checkpoint):
    tensors, open_ = checkpoint
    half = INTER // 2
    merged = MergedColumnParallelLinear(HIDDEN, [INTER, INTER], False, _tp(1, 2))
    _load(merged, merged.weight, open_("gate"), 0)
    _load(merged, merged.weight, open_("up"), 1)
    want = torch.cat([tensors["gate"][half:], tensors["up"][half:]])
    assert torch.equal(merged.weight, want)
    fused = MergedColumnParallelLinear(HIDDEN, [INTER, INTER], False, _tp(1, 2))
    _load(fused, fused.weight, open_("gate_up"))
    assert torch.equal(fused.weight, want)
    row = RowParallelLinear(INTER, HIDDEN, True, _tp(1, 2))
    _load(row, row.weight, open_("down"))
    _load(row, row.bias, open_("bias"))
    assert torch.equal(row.weight, tensors["down"][:, half:])
    assert torch.equal(row.bias, tensors["bias"])  # whole: rank 0 adds it once


def test_vocab_ranges_and_padding(checkpoint):
    tensors, open_ = checkpoint
    last = VocabParallelEmbedding(HIDDEN, _tp(1, 2))  # rows 6..10 of 11, one padding row
    last.weight.data.fill_(float("nan"))
    assert _load(last, last.weight, open_("embed")) == last.weight.numel()
    assert torch.equal(last.weight[:5], tensors["embed"][6:]) and not last.weight[5].any()


def test_an_adapter_loads_through_the_sharded_layer_it_wraps(checkpoint):
    """LoRA on a column layer: B [out, r] is split like the layer's output; on a row
    layer: A [r, in] like its input. The wrapped layer's weight_loader slices both."""
    tensors, open_ = checkpoint
    half = INTER // 2
    column = ColumnParallelLinear(HIDDEN, INTER, False, _tp(1, 2))
    lora_b = nn.Parameter(torch.empty(column.weight.shape[0], 3))
    _load(column, lora_b, open_("lora_b"))
    assert torch.equal(lora_b, tensors["lora_b"][half:])
    row = RowParallelLinear(INTER, HIDDEN, False, _tp(1, 2))
    lora_a = nn.Parameter(torch.empty(3, row.weight.shape[1]))
    _load(row, lora_a, open_("lora_a"))
    assert torch.equal(lora_a, tensors["lora_a"][:, half:])


def test_a_shape_mismatch_names_the_tensor_before_reading_it(checkpoint):
    _, open_ = checkpoint
    column = ColumnParallelLinear(HIDDEN, INTER, False, _tp(0, 2))
    down = open_("down")  # [HIDDEN, INTER]: a row layer's tensor
    with pytest.raises(ValueError, match=r"down: checkpoint shape \(6, 12\) .* != \(6, 8\)"):
        _load(column, column.weight, down)
    assert down.bytes_read == 0
