"""The row-wise CPU kernels (``gpu_worker.models.row_ops``) against the torch ops they
replace: RoPE and the residual add bit for bit, the RMS norm within fp32 rounding of
torch's (its own fixed summation order), every row independent of its batch and of the
thread count (``tests/unit/gpu_worker/test_batch_invariance.py`` runs the norm through
``RMSNorm`` too)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from gpu_worker.models import row_ops
from gpu_worker.models.blocks import RMSNorm, RotaryEmbedding, add_then_norm
from gpu_worker.model_config import RopeConfig

KERNELS = row_ops.load()
pytestmark = pytest.mark.skipif(KERNELS is None, reason="no C++ toolchain for the row kernels")


def _torch_rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin


# 300 rows x 4 heads x 64 take the multi-threaded loop, 3 rows the single-threaded one
@pytest.mark.parametrize("rows,heads,kv_heads,dim", [(3, 4, 2, 16), (300, 4, 2, 64), (7, 1, 1, 64), (5, 6, 3, 24)])
def test_rope_gives_torchs_bits_on_the_fused_projections_views(threads, rows, heads, kv_heads, dim):
    torch.manual_seed(rows)
    rope = RotaryEmbedding(dim, RopeConfig(), 512, "cpu", torch.float32)
    positions = torch.randint(0, 512, (rows,))
    cos, sin = rope.tables(positions)
    qkv = torch.randn(rows, (heads + 2 * kv_heads) * dim) * 4
    q = qkv[:, :heads * dim].view(rows, heads, dim)  # strided views, as Attention takes them
    k = qkv[:, heads * dim:(heads + kv_heads) * dim].view(rows, kv_heads, dim)
    for x in (q, k):
        out = RotaryEmbedding.rotate(x, (cos, sin))
        assert out.is_contiguous()
        assert torch.equal(out, _torch_rotate(x, cos, sin))
    # both out of the projection in one call, as Attention takes them on CPU
    for tables in ((cos, sin), (cos[:, 0], sin[:, 0])):  # [n, 1, dim] as tables() gives them, or [n, dim]
        fused_q, fused_k, v = row_ops.load().rope_qkv(qkv, *tables, heads, kv_heads)
        assert torch.equal(fused_q, _torch_rotate(q, cos, sin)) and torch.equal(fused_k, _torch_rotate(k, cos, sin))
        assert v.data_ptr() == qkv[:, (heads + kv_heads) * dim:].data_ptr()  # a view, not a copy
        assert torch.equal(v, qkv[:, (heads + kv_heads) * dim:].view(rows, kv_heads, dim))


@pytest.mark.parametrize("width", [16, 48, 64, 100, 768])
def test_rms_norm_is_torchs_within_rounding_on_rows_and_heads(threads, width):
    torch.manual_seed(width)
    norm = RMSNorm(width, 1e-6)
    with torch.no_grad():
        norm.weight.normal_()
    x = torch.randn(300, 2 * width) * 3
    rows = x[:, :width]  # a strided view, as q of the fused projection
    out = norm(rows)
    torch.testing.assert_close(out, F.rms_norm(rows, (width,), norm.weight, 1e-6), rtol=2e-6, atol=1e-6)
    heads = x.view(300, 2, width)  # [tokens, heads, head_dim]: Qwen3's per-head q/k norms
    assert torch.equal(norm(heads), norm(x.reshape(600, width)).view(300, 2, width))


@pytest.mark.parametrize("scale", [1.0, 0.25])
def test_add_then_norm_adds_as_torch_and_norms_each_row_alone(threads, scale):
    torch.manual_seed(0)
    norm = RMSNorm(96, 1e-5)
    with torch.no_grad():
        norm.weight.normal_()
    residual = torch.randn(70, 96) * 3
    branch = torch.randn(70, 2 * 96)[:, :96]  # the branch may be a strided view
    x = residual.clone()
    out = add_then_norm(norm, x, branch, scale)
    assert torch.equal(x, residual + (branch if scale == 1.0 else branch * scale))
    assert torch.equal(out, norm(x))
    for m in (1, 3, 4, 33, 70):  # a row's bits whatever the batch around it
        xm = residual[:m].clone()
        assert torch.equal(add_then_norm(norm, xm, branch[:m], scale), out[:m])


def test_switched_off_keeps_the_torch_path(monkeypatch):
    monkeypatch.setenv(row_ops.DISABLE_ENV, "0")
    row_ops.load.cache_clear()
    try:
        assert row_ops.load() is None and not row_ops.applies(torch.zeros(2))
        x = torch.randn(4, 32)
        norm = RMSNorm(32, 1e-6)
        assert torch.equal(norm(x), F.rms_norm(x, (32,), norm.weight, 1e-6))
    finally:
        monkeypatch.undo()
        row_ops.load.cache_clear()


def test_silu_mul_is_silu_times_up_within_rounding_and_each_row_alone(threads):
    """Against float64 SiLU over the range that matters (its exp is its own fixed
    polynomial: every element, wherever it sits, gets the same bits)."""
    inter = 1001  # a width no vector length divides
    g = torch.linspace(-100, 100, 200 * inter).view(200, inter)
    up = torch.randn(200, inter)
    gate_up = torch.cat([g, up], dim=-1)
    out = KERNELS.silu_mul(gate_up, inter)
    truth = (F.silu(g.double()) * up.double()).float()
    torch.testing.assert_close(out, truth, rtol=1e-6, atol=1e-30)
    for m in (1, 3, 70):
        assert torch.equal(KERNELS.silu_mul(gate_up[:m], inter), out[:m])
    strided = torch.cat([gate_up, gate_up], dim=-1)[:, :2 * inter]
    assert torch.equal(KERNELS.silu_mul(strided, inter), out)
    edge = KERNELS.silu_mul(torch.tensor([[float("nan"), float("inf"), 0.0, 1.0, 1.0, 1.0]]), 3)
    assert edge[0, 0].isnan() and edge[0, 1] == float("inf") and edge[0, 2] == 0.0


def test_silu_mul_gives_an_element_the_same_bits_in_the_vector_loop_and_the_tail():
    g = torch.cat([torch.randn(4000) * 30, torch.tensor([-88.5, -87.4, -87.3, 0.0, -0.0, 87.9, 88.1, 1e-30])])
    up = torch.randn(len(g))
    wide = KERNELS.silu_mul(torch.cat([g, up])[None], len(g))[0]  # 8 at a time, then a tail
    narrow = KERNELS.silu_mul(torch.stack([g, up], dim=1), 1)[:, 0]  # every element a tail
    assert torch.equal(wide, narrow)


@pytest.mark.parametrize("vocab", [1, 7, 2048, 32003])
def test_row_argmax_is_torchs_max_ties_nan_and_infinities_included(threads, vocab):
    g = torch.Generator().manual_seed(vocab)
    logits = torch.randint(0, 4, (80, vocab), generator=g).float()  # many ties: the first wins
    logits[1] = float("-inf")
    logits[2, vocab // 2] = float("nan")
    logits[3, -1] = float("inf")
    logits[4] = 0.0
    logits[4, vocab - 1] = -0.0
    logits[5] = float("nan")
    strided = torch.cat([logits, logits], dim=-1)[:, :vocab]
    for x in (logits, strided, logits[7:8]):
        best, index = KERNELS.row_argmax(x)
        want_best, want_index = x.max(dim=-1)
        assert torch.equal(index, want_index)
        assert torch.equal(best.nan_to_num(9.0), want_best.nan_to_num(9.0))
