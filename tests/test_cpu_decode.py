"""The compiled CPU decode kernel equals a naive reference and the torch path."""

import pytest
import torch

from gpu_worker import cpu_decode
from gpu_worker.attention import GatherScratch, build_metadata, paged_attention
from tests.test_decode_groups import _reference

KERNEL = cpu_decode.load(torch.device("cpu"), torch.float32)
pytestmark = pytest.mark.skipif(KERNEL is None, reason="no C++ toolchain for the CPU decode kernel")


def _tables(lens, bs, nblocks, shared=()):
    perm = [b for b in torch.randperm(nblocks).tolist() if b not in shared]
    tables, used = [], 0
    for n in lens:
        own = -(-n // bs) - len(shared)
        assert own >= 0
        tables.append(list(shared) + perm[used:used + own])
        used += own
    return tables


@pytest.mark.parametrize("heads,kvh", [(4, 4), (6, 2), (8, 1)])
def test_kernel_matches_reference(heads, kvh):
    torch.manual_seed(heads * 10 + kvh)
    bs, d, nblocks = 4, 16, 96
    k_cache = torch.randn(nblocks, bs, kvh, d)
    v_cache = torch.randn(nblocks, bs, kvh, d)
    lens = [1, 3, 9, 17, 30, 13, 10, 6]  # ragged, unsorted, not multiples of bs
    shared = [5, 77]  # all but the first two tables start with these blocks
    tables = [[5], [5]] + _tables(lens[2:], bs, nblocks, shared)  # block 5 also partly used
    q = torch.randn(len(lens), heads, d)
    scale = d ** -0.5
    mb = max(len(t) for t in tables)
    padded = torch.tensor([t + [0] * (mb - len(t)) for t in tables])
    out = KERNEL(q, k_cache, v_cache, padded, torch.tensor(lens), scale)
    ref = _reference(q, k_cache, v_cache, tables, lens, bs, scale)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


def test_kernel_rejects_bad_lengths():
    k = torch.zeros(4, 4, 1, 8)
    with pytest.raises(RuntimeError, match="out of range"):
        KERNEL(torch.zeros(1, 1, 8), k, k, torch.tensor([[0]]), torch.tensor([5]), 1.0)
    with pytest.raises(RuntimeError, match="out of range"):
        KERNEL(torch.zeros(1, 1, 8), k, k, torch.tensor([[4]]), torch.tensor([2]), 1.0)


def test_paged_attention_with_kernel_matches_torch_path():
    """Mixed step (a later prefill chunk plus decodes) through build_metadata."""
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
        meta = build_metadata(chunks, len(lens) - 1, bs, torch.device("cpu"), group_blocks=4,
                              scratch=GatherScratch(), decode_kernel=kernel)
        assert (meta.decode_kernel is not None) == (kernel is not None)
        outs.append(paged_attention(q, k_new, v_new, kc, vc, meta, d ** -0.5))
    torch.testing.assert_close(outs[1], outs[0], rtol=1e-5, atol=1e-5)
