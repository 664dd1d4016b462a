"""Grouped decode attention (CPU path) equals one batched call and a naive reference."""

import torch

from gpu_worker.attention.base import AttentionSpec
from gpu_worker.attention.torch_backend import TorchBackend, _decode_groups


def _backend(heads, kvh, d, bs, cap) -> TorchBackend:
    spec = AttentionSpec(heads, kvh, d, bs, torch.float32, torch.device("cpu"), d ** -0.5)
    return TorchBackend(spec, group_blocks=cap)


def _reference(q, k_cache, v_cache, tables, lens, bs, scale):
    outs = []
    for i, (t, n) in enumerate(zip(tables, lens)):
        rows = torch.cat([torch.arange(b * bs, b * bs + bs) for b in t])[:n]
        k = k_cache.view(-1, *k_cache.shape[2:])[rows].transpose(0, 1)
        v = v_cache.view(-1, *v_cache.shape[2:])[rows].transpose(0, 1)
        heads = q.shape[1]
        k = k.repeat_interleave(heads // k.shape[0], 0)
        v = v.repeat_interleave(heads // v.shape[0], 0)
        w = (q[i][:, None] @ k.transpose(-1, -2) * scale).softmax(-1)
        outs.append((w @ v)[:, 0])
    return torch.stack(outs)


def test_decode_groups_match_single_call_and_reference():
    torch.manual_seed(0)
    bs, heads, kvh, d, nblocks = 4, 4, 2, 8, 64
    k_cache = torch.randn(nblocks, bs, kvh, d)
    v_cache = torch.randn(nblocks, bs, kvh, d)
    lens = [3, 5, 9, 9, 17, 30]  # context incl. the new token, sorted as the runner does
    perm = torch.randperm(nblocks).tolist()
    tables, used = [], 0
    for n in lens:
        nb = -(-n // bs)
        tables.append(perm[used:used + nb])
        used += nb
    chunks = [(n - 1, 1, t) for n, t in zip(lens, tables)]
    q = torch.randn(len(lens), heads, d)
    k_new = torch.randn(len(lens), kvh, d)
    v_new = torch.randn(len(lens), kvh, d)
    scale = d ** -0.5
    outs = []
    for cap in (None, 4, 9, 1):
        kc, vc = k_cache.clone(), v_cache.clone()
        meta = _backend(heads, kvh, d, bs, cap).build(chunks, len(lens))
        outs.append((meta.attend(q, k_new, v_new, kc, vc), kc, vc, len(meta.decode_groups)))
    assert [o[3] for o in outs] == [1, 5, 4, 6]
    ref = _reference(q, outs[0][1], outs[0][2], tables, lens, bs, scale)
    for out, _, _, _ in outs:
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


def test_group_split_respects_the_cap():
    lens = [1, 4, 5, 8, 9, 16, 17]
    for cap in (1, 2, 3, 5, 8):
        groups = _decode_groups(lens, 4, cap)
        assert groups[0][0] == 0 and groups[-1][1] == len(lens)
        for lo, hi in groups:
            widest = max(-(-n // 4) for n in lens[lo:hi])
            assert hi - lo == 1 or widest * (hi - lo) <= cap


def test_cascade_over_a_shared_prefix_matches_reference():
    torch.manual_seed(1)
    bs, heads, kvh, d, nblocks = 4, 6, 2, 8, 64
    k_cache = torch.randn(nblocks, bs, kvh, d)
    v_cache = torch.randn(nblocks, bs, kvh, d)
    shared = [7, 3, 11]
    lens = [13, 14, 17, 25]  # every decode has >= 1 key past the 12 shared ones
    tables, nxt = [], 20
    for n in lens:
        own = -(-n // bs) - len(shared)
        tables.append(shared + list(range(nxt, nxt + own)))
        nxt += own
    chunks = [(n - 1, 1, t) for n, t in zip(lens, tables)]
    q = torch.randn(len(lens), heads, d)
    k_new = torch.randn(len(lens), kvh, d)
    v_new = torch.randn(len(lens), kvh, d)
    for cap in (None, 2):
        kc, vc = k_cache.clone(), v_cache.clone()
        meta = _backend(heads, kvh, d, bs, cap).build(chunks, len(lens))
        assert meta.shared_blocks is not None and meta.shared_blocks.tolist() == shared
        out = meta.attend(q, k_new, v_new, kc, vc)
        ref = _reference(q, kc, vc, tables, lens, bs, d ** -0.5)
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
