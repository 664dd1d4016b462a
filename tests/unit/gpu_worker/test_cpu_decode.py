"""The compiled CPU decode kernel equals a naive reference and the torch path."""

import pytest
import torch

from gpu_worker.attention import cpu_kernel_backend
from gpu_worker.attention.base import AttentionSpec
from gpu_worker.attention.cpu_kernel_backend import CpuKernelBackend, KernelStep
from gpu_worker.attention.torch_backend import TorchBackend
from tests.unit.gpu_worker.test_decode_groups import _reference

KERNEL = cpu_kernel_backend.load()
pytestmark = pytest.mark.skipif(KERNEL is None, reason="no C++ toolchain for the CPU decode kernel")


def _backend(kernel, heads, kvh, d, bs):
    """The kernel's backend, or (kernel None) the torch backend in groups of 4 blocks."""
    spec = AttentionSpec(heads, kvh, d, bs, torch.float32, torch.device("cpu"), d ** -0.5)
    return TorchBackend(spec, group_blocks=4) if kernel is None else CpuKernelBackend(spec, kernel)


def _tables(lens, bs, nblocks, shared=()):
    perm = [b for b in torch.randperm(nblocks).tolist() if b not in shared]
    tables, used = [], 0
    for n in lens:
        own = -(-n // bs) - len(shared)
        assert own >= 0
        tables.append(list(shared) + perm[used:used + own])
        used += own
    return tables


def _reference_lse(q, k_cache, v_cache, tables, lens, bs, scale):
    out = []
    for i, (t, n) in enumerate(zip(tables, lens)):
        rows = torch.cat([torch.arange(b * bs, b * bs + bs) for b in t])[:n]
        k = k_cache.view(-1, *k_cache.shape[2:])[rows]  # [n, kvh, d]
        k = k.repeat_interleave(q.shape[1] // k.shape[1], 1)
        out.append(torch.einsum("hd,nhd->hn", q[i], k).mul(scale).logsumexp(-1))
    return torch.stack(out)


# head_dim 16/32/64/80/128 take the vector code (where built), 24 the portable loops.
@pytest.mark.parametrize("heads,kvh,d", [(4, 4, 16), (6, 2, 16), (8, 1, 16), (4, 2, 64), (2, 1, 128),
                                         (4, 4, 32), (6, 3, 24), (9, 3, 64), (16, 2, 80), (10, 1, 96)])
def test_kernel_matches_reference(heads, kvh, d):
    torch.manual_seed(heads * 10 + kvh + d)
    bs, nblocks = 4, 96
    k_cache = torch.randn(nblocks, bs, kvh, d)
    v_cache = torch.randn(nblocks, bs, kvh, d)
    lens = [1, 3, 9, 17, 30, 13, 10, 6]  # ragged, unsorted, not multiples of bs
    shared = [5, 77]  # all but the first two tables start with these blocks
    tables = [[5], [5]] + _tables(lens[2:], bs, nblocks, shared)  # block 5 also partly used
    q = torch.randn(len(lens), heads, d)
    scale = d ** -0.5
    mb = max(len(t) for t in tables)
    padded = torch.tensor([t + [0] * (mb - len(t)) for t in tables])
    out, lse = KERNEL(q, k_cache, v_cache, padded, torch.tensor(lens), scale)
    ref = _reference(q, k_cache, v_cache, tables, lens, bs, scale)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    lse_ref = _reference_lse(q, k_cache, v_cache, tables, lens, bs, scale)
    torch.testing.assert_close(lse, lse_ref, rtol=1e-5, atol=1e-5)


def test_kernel_softmax_is_exact_over_a_wide_score_range():
    """Scores spanning ~200 (exp underflows for most keys) still give softmax's answer:
    the vector exp must not wrap its exponent below exp(-87)."""
    torch.manual_seed(1)
    bs, d, nblocks, n = 16, 64, 8, 100
    k_cache = torch.randn(nblocks, bs, 1, d)
    k_cache.view(-1, d)[:n] *= torch.linspace(0, 6, n)[:, None]
    v_cache = torch.randn(nblocks, bs, 1, d)
    q = torch.randn(1, 1, d) * 4
    tables = [list(range(-(-n // bs)))]
    out, lse = KERNEL(q, k_cache, v_cache, torch.tensor(tables), torch.tensor([n]), 1.0)
    # against float64 truth: scores reach ~290, where one fp32 ulp is ~3e-5, so fp32 torch
    # itself is only that close (its GEMM order varies with the CPU's ISA); a wrapped
    # exponent would be off by orders of magnitude
    ref = _reference(q.double(), k_cache.double(), v_cache.double(), tables, [n], bs, 1.0)
    assert torch.isfinite(out).all() and torch.isfinite(lse).all()
    torch.testing.assert_close(out.double(), ref, rtol=1e-4, atol=1e-4)


def test_kernel_writes_the_new_rows_before_attending():
    """``new_kv``: the step's K/V rows stored at their slots (as ``write_kv`` stores them,
    V a strided view of a fused projection) and attended by the same call; a slot past
    the cache is refused before anything is written."""
    torch.manual_seed(3)
    bs, nblocks, kvh, heads, d = 4, 8, 2, 6, 16
    k_cache, v_cache = torch.randn(nblocks, bs, kvh, d), torch.randn(nblocks, bs, kvh, d)
    qkv = torch.randn(3, (heads + 2 * kvh) * d)
    k = torch.randn(3, kvh, d)
    v = qkv[:, (heads + kvh) * d:].view(3, kvh, d)
    slots = torch.tensor([9, 10, 11])  # block 2, offsets 1..3
    tables, lens = torch.tensor([[5, 2]]), torch.tensor([6, 7, 8])
    q, rows = torch.randn(3, heads, d), torch.zeros(3, dtype=torch.long)
    want_k, want_v = k_cache.clone(), v_cache.clone()
    from gpu_worker.attention.base import write_kv
    write_kv(want_k, want_v, k, v, slots)
    want = KERNEL(q, want_k, want_v, tables, lens, d ** -0.5, row_seq=rows)
    got = KERNEL(q, k_cache, v_cache, tables, lens, d ** -0.5, row_seq=rows, new_kv=(k, v, slots))
    assert torch.equal(k_cache, want_k) and torch.equal(v_cache, want_v)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    before = k_cache.clone()
    with pytest.raises(RuntimeError, match="slot out of range"):
        KERNEL(q, k_cache, v_cache, tables, lens, d ** -0.5, row_seq=rows,
               new_kv=(k, v, torch.tensor([9, 10, nblocks * bs])))
    assert torch.equal(k_cache, before)


def test_kernel_rejects_bad_lengths():
    k = torch.zeros(4, 4, 1, 8)
    with pytest.raises(RuntimeError, match="out of range"):
        KERNEL(torch.zeros(1, 1, 8), k, k, torch.tensor([[0]]), torch.tensor([5]), 1.0)
    with pytest.raises(RuntimeError, match="out of range"):
        KERNEL(torch.zeros(1, 1, 8), k, k, torch.tensor([[4]]), torch.tensor([2]), 1.0)
    with pytest.raises(RuntimeError, match="out of range"):  # no key at all
        KERNEL(torch.zeros(1, 1, 8), k, k, torch.tensor([[0]]), torch.tensor([0]), 1.0)
    with pytest.raises(RuntimeError, match="block id out of range"):  # a padded table's tail
        KERNEL(torch.zeros(1, 1, 8), k, k, torch.tensor([[0, -1]]), torch.tensor([2]), 1.0)
    with pytest.raises(RuntimeError, match="row's table out of range"):
        KERNEL(torch.zeros(2, 1, 8), k, k, torch.tensor([[0]]), torch.tensor([2, 2]), 1.0,
               row_seq=torch.tensor([0, 1]))


def test_cascade_with_kernel_matches_torch_cascade():
    """Decodes sharing leading blocks: prefix through the LSE flash call, each suffix
    through the kernel, merged; equals the gather-and-SDPA cascade."""
    torch.manual_seed(4)
    bs, heads, kvh, d, nblocks = 4, 4, 2, 16, 96
    k_cache = torch.randn(nblocks, bs, kvh, d)
    v_cache = torch.randn(nblocks, bs, kvh, d)
    lens = [13, 14, 17, 22, 30]  # all past the 3 shared blocks (12 keys)
    tables = _tables(lens, bs, nblocks, shared=[7, 3, 50])
    chunks = [(n - 1, 1, t) for n, t in zip(lens, tables)]
    q, k_new, v_new = torch.randn(5, heads, d), torch.randn(5, kvh, d), torch.randn(5, kvh, d)
    outs = []
    for kernel in (None, KERNEL):
        kc, vc = k_cache.clone(), v_cache.clone()
        meta = _backend(kernel, heads, kvh, d, bs).build(chunks, len(lens))
        assert meta.shared_blocks is not None and meta.shared_blocks.tolist() == [7, 3, 50]
        outs.append(meta.attend(q, k_new, v_new, kc, vc))
    ref = _reference(q, kc, vc, tables, lens, bs, d ** -0.5)
    torch.testing.assert_close(outs[0], ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(outs[1], ref, rtol=1e-5, atol=1e-5)


def test_paged_attention_with_kernel_matches_torch_path():
    """Mixed step (a later prefill chunk plus decodes) through each backend's build."""
    torch.manual_seed(3)
    bs, heads, kvh, d, nblocks = 4, 6, 2, 8, 64
    k_cache = torch.randn(nblocks, bs, kvh, d)
    v_cache = torch.randn(nblocks, bs, kvh, d)
    lens = [7, 3, 5, 9, 9, 17, 30]  # first: a 3-token chunk starting at 4; then decodes
    tables = _tables(lens, bs, nblocks)
    chunks = [(4, 3, tables[0])] + [(n - 1, 1, t) for n, t in zip(lens[1:], tables[1:])]
    rows = 3 + len(lens) - 1
    q, k_new, v_new = torch.randn(rows, heads, d), torch.randn(rows, kvh, d), torch.randn(rows, kvh, d)
    outs = []
    for kernel in (None, KERNEL):
        kc, vc = k_cache.clone(), v_cache.clone()
        meta = _backend(kernel, heads, kvh, d, bs).build(chunks, len(lens) - 1)
        assert isinstance(meta, KernelStep) == (kernel is not None)
        outs.append(meta.attend(q, k_new, v_new, kc, vc))
    torch.testing.assert_close(outs[1], outs[0], rtol=1e-5, atol=1e-5)
