"""Each batch-invariant kernel gives a row the same bits whatever else is in its batch.

Equality, never a tolerance: the deterministic mode promises bitwise identical tokens and
logprobs, so a row computed alone, inside 1..64 other rows, at another position, as a
decode or inside any prefill chunk, under 1 or 2 threads, must come out identical. (The
tolerance checks below are about correctness against a reference, a separate claim.)
"""

from __future__ import annotations

import random
import weakref

import pytest
import torch
import torch.nn.functional as F

from gpu_worker.attention import cpu_kernel_backend
from gpu_worker.batch_invariant import INVARIANT_ACTIVATIONS, PACK_MIN_NUMEL, Numerics, measure_min_rows
from gpu_worker.models.blocks import RMSNorm, activation
from gpu_worker.sampler import top_logprobs
from tests.unit.gpu_worker.test_decode_groups import _reference

KERNEL = cpu_kernel_backend.load()
needs_kernel = pytest.mark.skipif(KERNEL is None, reason="no C++ toolchain for the CPU attention kernel")
BATCH_SIZES = range(1, 65)


# ---------------------------------------------------------------- attention


class Sequences:
    """A paged cache holding a few sequences' keys, and a query row for each position."""

    def __init__(self, lens: list[int], heads: int, kvh: int, d: int, bs: int = 4, seed: int = 0) -> None:
        g = torch.Generator().manual_seed(seed)
        self.lens, self.bs, self.d = lens, bs, d
        nblocks = sum(-(-n // bs) for n in lens) + 3
        self.k = torch.randn(nblocks, bs, kvh, d, generator=g)
        self.v = torch.randn(nblocks, bs, kvh, d, generator=g)
        perm = torch.randperm(nblocks, generator=g).tolist()
        self.tables, used = [], 0
        for n in lens:
            nb = -(-n // bs)
            self.tables.append(perm[used:used + nb])
            used += nb
        self.q = [torch.randn(n, heads, d, generator=g) for n in lens]

    def attend(self, rows: list[tuple[int, int]], window=None, softcap=None) -> torch.Tensor:
        """One kernel call over query rows (sequence, position), in this order, as a step
        lays them out: each row reads its own sequence's table up to its position."""
        seqs = sorted({s for s, _ in rows})
        mb = max(len(self.tables[s]) for s in seqs)
        tables = torch.tensor([self.tables[s] + [0] * (mb - len(self.tables[s])) for s in seqs])
        row_seq = torch.tensor([seqs.index(s) for s, _ in rows])
        lens = torch.tensor([p + 1 for _, p in rows])
        q = torch.stack([self.q[s][p] for s, p in rows])
        out, _ = KERNEL(q, self.k, self.v, tables, lens, self.d ** -0.5, window, softcap, row_seq=row_seq)
        return out

    def alone(self, window=None, softcap=None) -> dict[tuple[int, int], torch.Tensor]:
        """Every row computed as a lone decode."""
        return {(s, p): self.attend([(s, p)], window, softcap)[0]
                for s, n in enumerate(self.lens) for p in range(n)}


def _assert_rows(out: torch.Tensor, rows: list[tuple[int, int]], alone: dict, what: str) -> None:
    for i, row in enumerate(rows):
        assert torch.equal(out[i], alone[row]), f"{what}: row {row} differs from the same row alone"


# head_dim 16/32/64/80/128 take the vector code (where built), 24 the portable loops; on
# AVX-512 builds GQA groups (2, 3 and 8 query heads a KV head here) take the grouped passes.
@needs_kernel
@pytest.mark.parametrize("heads,kvh,d", [(4, 2, 16), (6, 3, 24), (4, 4, 64), (2, 1, 128), (8, 2, 32), (9, 3, 64),
                                         (16, 2, 80)])
@pytest.mark.parametrize("window,softcap", [(None, None), (5, None), (None, 2.0)])
def test_attention_row_is_independent_of_batch_and_prefill_split(threads, heads, kvh, d, window, softcap):
    seqs = Sequences([37, 20, 64], heads, kvh, d, seed=heads + d)
    alone = seqs.alone(window, softcap)
    # the whole prompt as one prefill chunk, and split in two at every point
    n = seqs.lens[0]
    whole = [(0, p) for p in range(n)]
    _assert_rows(seqs.attend(whole, window, softcap), whole, alone, "one chunk")
    for split in range(1, n):
        first, second = whole[:split], whole[split:]
        _assert_rows(seqs.attend(first, window, softcap), first, alone, f"chunk [0, {split})")
        _assert_rows(seqs.attend(second, window, softcap), second, alone, f"chunk [{split}, {n})")
    # batches of 1..64 rows: chunks of random sequences and positions, in random order
    rng = random.Random(d)
    for m in BATCH_SIZES:
        rows: list[tuple[int, int]] = []
        while len(rows) < m:
            s = rng.randrange(len(seqs.lens))
            start = rng.randrange(seqs.lens[s])
            take = min(rng.choice([1, 1, 3, 17]), m - len(rows), seqs.lens[s] - start)
            rows += [(s, p) for p in range(start, start + take)]
        _assert_rows(seqs.attend(rows, window, softcap), rows, alone, f"batch of {m}")


@needs_kernel
@pytest.mark.parametrize("heads,kvh,d", [(4, 2, 16), (6, 3, 24), (2, 1, 128)])
def test_attention_prefill_rows_match_reference(heads, kvh, d):
    """Correctness (a tolerance here is about the maths, not invariance): each row of a
    prefill chunk equals causal attention over its sequence's keys."""
    seqs = Sequences([29], heads, kvh, d, seed=7)
    out = seqs.attend([(0, p) for p in range(29)])
    ref = _reference(seqs.q[0], seqs.k, seqs.v, [seqs.tables[0]] * 29, list(range(1, 30)), seqs.bs,
                     d ** -0.5)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


@needs_kernel
@pytest.mark.parametrize("heads,kvh,d", [(1, 1, 64), (4, 2, 32), (6, 3, 24), (9, 3, 64)])
@pytest.mark.parametrize("window", [None, 100])
def test_attention_row_is_independent_of_its_tile_over_a_shared_prefix(threads, heads, kvh, d, window):
    """Workload (c)'s shape: 64 sequences whose tables start with the same 64 cached blocks
    (a 1024-token prefix), contexts that cross the kernel's key chunks and groups of eight.
    The kernel tiles rows that share leading blocks together (decodes on different tables
    too) and the tile size follows the batch and the thread count; a row's bits must not:
    alone, as one of 64 decodes, in its sequence's 16-row prefill chunk among 64 such
    chunks, and as a decode behind another sequence's chunk, it is the same."""
    bs, prefix, n_seqs, chunk, own = 16, 1024, 64, 16, 6
    g = torch.Generator().manual_seed(d + heads)
    nblocks = prefix // bs + n_seqs * own
    k, v = torch.randn(nblocks, bs, kvh, d, generator=g), torch.randn(nblocks, bs, kvh, d, generator=g)
    perm = torch.randperm(nblocks, generator=g).tolist()
    shared, rest = perm[:prefix // bs], perm[prefix // bs:]
    tables = torch.tensor([shared + rest[s * own:(s + 1) * own] for s in range(n_seqs)])
    last = [prefix + (s * 7) % (own * bs) for s in range(n_seqs)]  # each sequence's last position
    q = torch.randn(n_seqs, chunk, heads, d, generator=g)  # its last `chunk` positions' queries

    def attend(rows: list[tuple[int, int]]) -> tuple[torch.Tensor, torch.Tensor]:
        """Rows (sequence, i): position last - chunk + 1 + i of that sequence."""
        lens = torch.tensor([last[s] - chunk + 2 + i for s, i in rows])
        row_seq = torch.tensor([s for s, _ in rows])
        return KERNEL(torch.stack([q[s, i] for s, i in rows]), k, v, tables, lens, d ** -0.5, window,
                      row_seq=row_seq)

    alone = {(s, i): attend([(s, i)]) for s in range(n_seqs) for i in range(chunk)}
    decodes = [(s, chunk - 1) for s in range(n_seqs)]
    chunks = [(s, i) for s in range(n_seqs) for i in range(chunk)]
    behind_a_chunk = [(0, i) for i in range(chunk)] + decodes[1:]
    for rows, what in [(decodes, "64 decodes"), (chunks, "64 prefill chunks"),
                       (behind_a_chunk, "decodes behind a chunk")]:
        out, lse = attend(rows)
        for j, row in enumerate(rows):
            assert torch.equal(out[j], alone[row][0][0]), f"{what}: row {row}'s output differs from it alone"
            assert torch.equal(lse[j], alone[row][1][0]), f"{what}: row {row}'s log-sum-exp differs"


# ---------------------------------------------------------------- matmuls


@pytest.mark.parametrize("k,n,bias", [(64, 192, False), (48, 2048, True), (128, 64, True),
                                      (256, 768, False), (512, 384, True)])
def test_linear_row_is_independent_of_batch(threads, k, n, bias):
    """Through the path that serves: the last two weights are big enough to be packed for
    oneDNN (``Numerics.pack``), the others stay on F.linear."""
    torch.manual_seed(k + n)
    w = torch.nn.Parameter(torch.randn(n, k), requires_grad=False)
    b = torch.randn(n) if bias else None
    numerics = Numerics(deterministic=True)
    numerics.pack([(w, b)])
    assert (id(w) in numerics.packed) == (k * n >= PACK_MIN_NUMEL)
    rows, why = measure_min_rows([(w, b)], matmul=numerics.matmul)
    assert rows is not None, why
    numerics.min_rows = rows
    x = torch.randn(200, k)
    alone = torch.cat([numerics.linear(x[i:i + 1], w, b) for i in range(len(x))])
    rng = random.Random(n)
    for m in [*BATCH_SIZES, 100, 200]:
        idx = rng.sample(range(len(x)), m)
        out = numerics.linear(x[idx], w, b)
        for j, i in enumerate(idx):
            assert torch.equal(out[j], alone[i]), f"row {i} in a batch of {m} (padded to {rows})"


def test_a_packed_copy_replaces_the_weight_only_its_matmul_reads():
    """Memory holds a linear layer's weight once: its packed copy replaces it (what stays
    has its shape and no values: a read past Numerics raises); a weight also read
    elsewhere (a tied embedding) keeps both."""
    torch.manual_seed(0)
    linear = torch.nn.Linear(512, 384)
    tied = torch.nn.Embedding(384, 512)
    for p in (*linear.parameters(), *tied.parameters()):
        p.requires_grad_(False)
    x = torch.randn(5, 512)
    before = Numerics()
    before.pack([(linear.weight, linear.bias)])
    want = before.linear(x, linear.weight, linear.bias)
    original = weakref.ref(linear.weight)
    del before

    numerics = Numerics()
    said = numerics.pack([(linear.weight, linear.bias), (tied.weight, None)], [linear])
    assert linear.weight.is_meta and linear.weight.shape == (384, 512)
    assert [name for name, _ in linear.named_parameters()] == ["bias"]
    assert original() is None  # the weight's bytes are gone, not merely unreferenced here
    assert not tied.weight.is_meta and id(tied.weight) in numerics.packed
    assert "2 packed weights (1.5 MiB; +0.8 MiB beside weights also read elsewhere)" in said
    assert torch.equal(numerics.linear(x, linear.weight, linear.bias), want)
    assert numerics.linear(x[:0], linear.weight, linear.bias).shape == (0, 384)
    rows, why = measure_min_rows([(linear.weight, linear.bias)], matmul=numerics.matmul)
    assert rows is not None, why
    for stray in (lambda: F.linear(x, linear.weight, linear.bias), linear.weight.tolist,
                  lambda: linear.weight + 1, lambda: linear.weight.data,
                  lambda: linear.weight.T):
        with pytest.raises(RuntimeError, match="packed copy replaced it"):
            stray()


def test_min_rows_refuses_a_matmul_that_never_agrees():
    """A BLAS whose rows depend on the batch at every size is refused, naming the shape."""
    def drifting(x, w, b=None):
        return F.linear(x, w, b) + x.shape[0] * 1e-3

    rows, why = measure_min_rows([(torch.randn(8, 4), None)], matmul=drifting)
    assert rows is None and "(8, 4)" in why


# ---------------------------------------------------------------- row-wise ops


def _rows_independent(f, width: int, what: str) -> None:
    x = torch.randn(70, width) * 3
    alone = torch.cat([f(x[i:i + 1]) for i in range(len(x))])
    for m in BATCH_SIZES:
        out = f(x[:m])
        for i in range(m):
            assert torch.equal(out[i], alone[i]), f"{what}: row {i} of {m} differs from alone"
    # a row taken out of a strided view (the fused gate|up projection's halves) too
    pair = torch.cat([x, x], dim=-1)[:, :width]
    assert torch.equal(f(pair), f(x[:70])), f"{what}: a strided view differs"


@pytest.mark.parametrize("name", sorted(INVARIANT_ACTIVATIONS))
@pytest.mark.parametrize("width", [16, 48, 100, 128])
def test_activation_row_is_independent_of_batch(threads, name, width):
    torch.manual_seed(width)
    _rows_independent(Numerics(deterministic=True).activation(name), width, name)


@pytest.mark.parametrize("name", sorted(INVARIANT_ACTIVATIONS))
def test_invariant_activations_are_the_same_functions(name):
    """Against torch's own activation in float64: as close as torch's fp32 kernel is."""
    x = torch.linspace(-12, 12, 10001)
    truth = activation(name)(x.double()).float()
    torch.testing.assert_close(INVARIANT_ACTIVATIONS[name](x), truth, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("kind", ["rms", "rms_1p", "layer"])
@pytest.mark.parametrize("width", [16, 48, 768])
def test_norm_row_is_independent_of_batch(threads, kind, width):
    torch.manual_seed(width)
    norm = torch.nn.LayerNorm(width) if kind == "layer" else RMSNorm(width, 1e-6, one_plus=kind == "rms_1p")
    with torch.no_grad():
        norm.weight.normal_()
        _rows_independent(norm, width, kind)


def test_softmax_family_row_is_independent_of_batch(threads):
    for f, what in ((lambda t: torch.log_softmax(t, -1), "log_softmax"),
                    (lambda t: torch.softmax(t, -1), "softmax"),
                    (lambda t: torch.tanh(t / 5.0) * 5.0, "soft-cap")):
        _rows_independent(f, 2048, what)


# ---------------------------------------------------------------- sampler


def test_top_logprobs_of_a_row_do_not_depend_on_other_rows_k():
    """Ties included: a row's top-k list is the one it gets alone, whatever larger k
    another row of the batch asks for."""
    torch.manual_seed(3)
    logits = torch.randn(6, 300)
    logits[:, 10:20] = 4.0  # ten equally likely ids
    lp = torch.log_softmax(logits, -1)
    chosen = lp.argmax(-1)
    ks = [3, 20, 0, 3, 7, 5]
    batched = top_logprobs(lp, chosen, ks, with_rank=True)
    for r, k in enumerate(ks):
        assert batched[r] == top_logprobs(lp[r:r + 1], chosen[r:r + 1], [k], with_rank=True)[0]
