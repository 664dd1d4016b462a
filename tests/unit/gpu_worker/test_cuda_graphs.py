"""Padded static-buffer decode (the CUDA-graph path) and the flashinfer backend, on CPU.

No GPU here: the graph "replay" is the captured function called eagerly, and flashinfer
is ``tests/support/fake_flashinfer.py`` (its real signatures, torch arithmetic). What the GPU adds
(capture, the real kernels) is ``bench/gpu_check.sh``'s job.
"""

from __future__ import annotations

import inspect
import sys

import pytest
import torch

from gpu_worker import cuda_graphs
from gpu_worker.attention import flashinfer_backend
from gpu_worker.attention.base import AttentionSpec
from gpu_worker.attention.registry import select_backend
from gpu_worker.cuda_graphs import capture_sizes, pad_decodes, padded_size
from gpu_worker.model_runner import ModelRunner
from protocol.ipc import SeqChunk, StepPlan
from tests.support import fake_flashinfer
from tests.unit.gpu_worker.test_model_parity import (  # noqa: F401  (pytest fixtures)
    ARRIVALS,
    GREEDY,
    PROMPT_LENS,
    hf_reference,
    hf_tiny,
    prompts,
    run_continuous,
    tiny_dir,
)

# ---------------------------------------------------------------- pure helpers


def test_capture_sizes():
    assert capture_sizes(64) == [1, 2, 4, 8, 16, 24, 32, 48, 64]
    assert capture_sizes(100)[-3:] == [64, 96, 100]
    assert capture_sizes(1) == [1]
    assert capture_sizes(10_000)[-1] == cuda_graphs.MAX_CAPTURE_SIZE
    assert capture_sizes(0) == []


def test_padded_size():
    sizes = capture_sizes(64)
    assert [padded_size(n, sizes) for n in (1, 3, 5, 9, 17, 33, 49, 64)] == [1, 4, 8, 16, 24, 48, 64, 64]
    assert padded_size(65, sizes) is None and padded_size(0, sizes) is None


def test_pad_decodes_fills_scratch_rows():
    chunks = [(5, 1, [7]), (17, 1, [2, 9])]
    padded, rows = pad_decodes(chunks, [11, 12], [5, 17], size=4, scratch_block=40, block_size=16)
    assert padded == chunks + [(0, 1, [40])] * 2
    assert rows == [[11, 12, 0, 0], [5, 17, 0, 0], [7 * 16 + 5, 9 * 16 + 1, 640, 640]]
    with pytest.raises(ValueError):
        pad_decodes(chunks, [11, 12], [5, 17], size=1, scratch_block=40, block_size=16)
    with pytest.raises(ValueError, match="single-token"):
        pad_decodes([(0, 2, [1])], [1], [0], size=2, scratch_block=40, block_size=16)


def test_backend_choice_without_cuda():
    spec = AttentionSpec(4, 2, 64, 16, torch.bfloat16, torch.device("cpu"), 64**-0.5)
    assert select_backend(spec).name == "torch"
    assert flashinfer_backend.unsupported_reason(128, torch.bfloat16) is None
    assert flashinfer_backend.unsupported_reason(64, torch.float16) is None
    assert "fp16/bf16" in flashinfer_backend.unsupported_reason(128, torch.float32)
    assert "head_dim 16" in flashinfer_backend.unsupported_reason(16, torch.bfloat16)


def test_paged_indices_are_host_int32_csr():
    indptr, indices, last = flashinfer_backend.paged_indices(
        [(0, 16, [3, 8]), (16, 1, [4, 5, 6]), (0, 1, [9])], block_size=16)
    assert indptr.tolist() == [0, 1, 3, 4] and indices.tolist() == [3, 4, 5, 9]
    assert last.tolist() == [16, 1, 1]
    assert {t.device.type for t in (indptr, indices, last)} == {"cpu"}
    assert {t.dtype for t in (indptr, indices, last)} == {torch.int32}


# ---------------------------------------------------------------- padded decode, torch path


def _torch_decode(runner: ModelRunner, sizes: list[int]) -> cuda_graphs.DecodeGraphRunner:
    """The CPU backend's padded decode: metadata fresh each step, so eager only."""
    assert not runner.attn_backend.capturable
    return runner.static_decode(sizes)


def _decode_plan(step, rows):
    return StepPlan(step, [SeqChunk(rid, [tok], pos, table, True) for rid, tok, pos, table in rows])


def test_padded_decode_matches_unpadded_and_touches_only_scratch(tiny_dir):
    plain = ModelRunner(str(tiny_dir), num_blocks=12, deterministic=False)
    padded = ModelRunner(str(tiny_dir), num_blocks=12, deterministic=False)
    padded.decode_graphs = _torch_decode(padded, [2, 8])
    for r in (plain, padded):
        r.execute(StepPlan(0, [SeqChunk("a", list(range(1, 20)), 0, [3, 5], True),
                               SeqChunk("b", list(range(30, 37)), 0, [1], True),
                               SeqChunk("c", [5, 6, 7], 0, [0], True)],
                           {rid: GREEDY for rid in "abc"}))
    before = [k.clone() for k, _ in padded.kv_caches]
    rows = [("a", 40, 19, [3, 5]), ("b", 41, 7, [1]), ("c", 42, 3, [0])]
    got = padded.execute(_decode_plan(1, rows)).sampled
    assert got == plain.execute(_decode_plan(1, rows)).sampled
    dg = padded.decode_graphs
    assert dg.steps == 1 and dg.padding_rows == 5  # 3 rows ran at size 8
    # Rows in the runner's decode order (by position), then padding: token 0 at
    # position 0 into the scratch block's first slot.
    assert dg.static[:, :8].tolist() == [[42, 41, 40] + [0] * 5, [3, 7, 19] + [0] * 5,
                                         [3, 16 + 7, 5 * 16 + 3] + [12 * 16] * 5]
    for (k_pad, _), (k_plain, _), old in zip(padded.kv_caches, plain.kv_caches, before):
        changed = (k_pad != old).flatten(2).any(-1).nonzero().tolist()  # [block, slot] written
        assert sorted(changed) == [[0, 3], [1, 7], [5, 3], [12, 0]]  # the three rows + scratch
        torch.testing.assert_close(k_pad[:12], k_plain[:12], rtol=1e-4, atol=1e-5)  # matmul blocking
        assert not k_plain[12].any()  # the plain path never touches the scratch block


def test_large_or_mixed_batches_skip_the_padded_path(tiny_dir):
    runner = ModelRunner(str(tiny_dir), num_blocks=12, deterministic=False)
    runner.decode_graphs = _torch_decode(runner, [1])
    runner.execute(StepPlan(0, [SeqChunk("a", [1, 2, 3], 0, [0], True), SeqChunk("b", [4, 5], 0, [1], True)],
                            {"a": GREEDY, "b": GREEDY}))
    runner.execute(_decode_plan(1, [("a", 7, 3, [0]), ("b", 8, 2, [1])]))  # 2 > largest size 1
    runner.execute(StepPlan(2, [SeqChunk("a", [9], 4, [0], True), SeqChunk("c", [1, 2], 0, [2], True)],
                            {"c": GREEDY}))  # has a prefill
    assert runner.decode_graphs.steps == 0
    runner.execute(_decode_plan(3, [("a", 7, 5, [0])]))
    assert runner.decode_graphs.steps == 1


def test_padded_static_decode_matches_hf(tiny_dir, prompts, hf_reference):
    runner = ModelRunner(str(tiny_dir), block_size=16, num_blocks=40, deterministic=False)
    runner.decode_graphs = _torch_decode(runner, [1, 2, 4, 8])
    ours = run_continuous(runner, prompts, [GREEDY] * len(prompts), arrivals=ARRIVALS)
    for plen, got, want in zip(PROMPT_LENS, ours, hf_reference):
        assert got == want, f"prompt of {plen} tokens diverged"
    assert runner.decode_graphs.steps > 10 and runner.decode_graphs.padding_rows > 0


# ---------------------------------------------------------------- flashinfer backend (fake)


@pytest.fixture
def fake_fi(monkeypatch):
    """The fake module as ``flashinfer``; fp32 and head_dim 16 admitted (the fake takes
    them, so the tiny model can be compared with HF exactly)."""
    monkeypatch.setitem(sys.modules, "flashinfer", fake_flashinfer)
    monkeypatch.setattr(flashinfer_backend, "SUPPORTED_DTYPES", (torch.float32,))
    monkeypatch.setattr(flashinfer_backend, "SUPPORTED_HEAD_DIMS", (16,))
    fake_flashinfer.PLANS.clear()
    return fake_flashinfer


def _flashinfer_runner(path, **kwargs) -> ModelRunner:
    runner = ModelRunner(str(path), deterministic=False, **kwargs)
    runner.attn_backend = flashinfer_backend.FlashInferBackend(runner.attn_spec)
    return runner


def test_flashinfer_self_check_against_fake(fake_fi):
    for heads, kv_heads, bs in ((4, 2, 16), (8, 8, 4), (4, 1, 1)):
        backend = flashinfer_backend.FlashInferBackend(
            AttentionSpec(heads, kv_heads, 16, bs, torch.float32, torch.device("cpu"), 16**-0.5))
        assert backend.self_check() < 1e-5
    assert {p["kind"] for p in fake_fi.PLANS} == {"prefill", "decode"}
    assert all(set(p["devices"].values()) == {"cpu"} for p in fake_fi.PLANS)  # host-side plans


def test_flashinfer_backend_matches_hf(fake_fi, tiny_dir, prompts, hf_reference):
    runner = _flashinfer_runner(tiny_dir, block_size=16, num_blocks=40)
    ours = run_continuous(runner, prompts, [GREEDY] * len(prompts), arrivals=ARRIVALS)
    assert ours == hf_reference
    kinds = [p["kind"] for p in fake_fi.PLANS]
    assert "prefill" in kinds and "decode" in kinds


def test_flashinfer_graph_decode_matches_hf(fake_fi, monkeypatch, tiny_dir, prompts, hf_reference):
    """The graph path exactly as on a GPU, minus capture: per-size graph-mode wrappers over
    fixed buffers (which the fake reads at run time, as a replay does), re-planned each
    step, one metadata object per size."""
    runner = _flashinfer_runner(tiny_dir, block_size=8, num_blocks=120)
    runner.decode_graphs = runner.static_decode([1, 2, 4, 8])
    assert runner.decode_graphs.capture() == 0  # nothing to capture on CPU: runs eagerly
    metas = {}
    original = flashinfer_backend.GraphDecodeAttention.meta

    def meta(self, chunks, slot_mapping):
        m = original(self, chunks, slot_mapping)
        assert metas.setdefault(self.size, m) is m  # the captured metadata never changes
        return m

    monkeypatch.setattr(flashinfer_backend.GraphDecodeAttention, "meta", meta)
    ours = run_continuous(runner, prompts, [GREEDY] * len(prompts), arrivals=ARRIVALS, chunk=37)
    assert ours == hf_reference
    assert runner.decode_graphs.steps > 10 and runner.decode_graphs.padding_rows > 0
    assert len(metas) >= 2  # several sizes ran


def test_fake_signatures_match_real():
    """Where the real flashinfer is installed (a GPU box), the fake's calls we rely on
    exist there with the same names and positions."""
    real = pytest.importorskip("flashinfer")
    if real is fake_flashinfer:
        pytest.skip("the fake is installed")

    def names(fn):
        params = inspect.signature(fn).parameters
        return [n for n in params if n != "self"]

    def all_names(cls, method):
        out = names(getattr(cls, method))
        if hasattr(cls, "_plan_impl") and method == "plan":  # 0.7: extras via **kwargs
            out += names(cls._plan_impl)
        return out

    for name, n_pos in (("BatchDecodeWithPagedKVCacheWrapper", 7), ("BatchPrefillWithPagedKVCacheWrapper", 8)):
        ours, theirs = getattr(fake_flashinfer, name), getattr(real, name)
        assert names(ours.plan)[:n_pos] == names(theirs.plan)[:n_pos]
        used = {"sm_scale", "q_data_type", "kv_data_type"} | ({"causal"} if "Prefill" in name else set())
        assert used <= set(all_names(theirs, "plan"))
    assert {"use_cuda_graph", "use_tensor_cores", "paged_kv_indptr_buffer", "paged_kv_indices_buffer",
            "paged_kv_last_page_len_buffer"} <= set(names(real.BatchDecodeWithPagedKVCacheWrapper.__init__))
