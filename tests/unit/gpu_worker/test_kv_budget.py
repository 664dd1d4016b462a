"""The KV cache's default size on CPU: what the model and its traffic can use, within a
share of free memory, and the reason logged says which of those decided."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from gpu_worker.kv_budget import (CPU_FLOOR, CPU_SHARE, KV_PER_WEIGHT, GiB, KvDemand, MiB,
                                  auto_kv_bytes, resident_bytes)
from gpu_worker.model_runner import ModelRunner
from launcher.tiny_model import build_tiny_model

CPU = torch.device("cpu")
# SmolLM2-135M in Q4_1 as the worker holds it: 92 MiB of weights, fp32 K and V of
# 30 layers x 3 KV heads x 64 dims (720 KiB per 16-token block), an 8192-token context
SMOLLM2 = KvDemand(block_bytes=737280, block_size=16, max_num_seqs=64, max_model_len=8192,
                   weight_bytes=92 * MiB)


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("tiny") / "model")


def test_a_small_model_gets_a_multiple_of_its_weights_not_a_flat_share():
    nbytes, why = auto_kv_bytes(CPU, SMOLLM2, 0.9, available=22 * GiB)
    # 64 x 8192 tokens would be 22.5 GiB and 25% of free memory 5.5 GiB; 4x the weights is
    # 368 MiB, just above one 8192-token sequence (361 MiB)
    assert SMOLLM2.full_batch > 20 * GiB and SMOLLM2.one_sequence < 368 * MiB
    assert nbytes == KV_PER_WEIGHT * 92 * MiB == 368 * MiB
    assert why.startswith("368 MiB: 4x the weights' 92 MiB")
    assert "64 sequences x 8192 tokens would take 22.5 GiB" in why
    assert "at most 25% of 22.0 GiB free memory (--kv-cache-memory to choose)" in why


def test_the_served_models_default_holds_the_real_workloads_with_room():
    """make serve's model at bench.compare's --max-model-len 2048: 522 blocks. r16 holds
    16 x 17 (about 130 prompt tokens as text + 128 out), r2k 120: the cache the rule
    gives is about twice what 16 streams use, so halving it would preempt them (issue 34)."""
    served = KvDemand(737280, 16, 64, 2048, 92 * MiB)
    nbytes, _ = auto_kv_bytes(CPU, served, 0.9, available=22 * GiB)
    blocks = nbytes // served.block_bytes - 1  # less the scratch block, as the runner counts
    assert blocks == 522
    r16, r2k = 16 * -(-(130 + 128) // 16), -(-1920 // 16)
    assert r16 == 272 and r2k == 120
    assert r16 <= blocks < 2 * r16 and r2k <= blocks
    assert (nbytes // 2) // served.block_bytes - 1 < r16  # half the cache: r16 preempts


def test_one_full_context_always_fits():
    long = KvDemand(737280, 16, 64, 32768, 92 * MiB)
    nbytes, why = auto_kv_bytes(CPU, long, 0.9, available=22 * GiB)
    assert nbytes == long.one_sequence == (2048 + 1) * 737280
    assert "one sequence at the full 32768-token context" in why


def test_never_more_than_every_sequence_at_full_context():
    few = KvDemand(737280, 16, 2, 512, 92 * MiB)
    nbytes, why = auto_kv_bytes(CPU, few, 0.9, available=22 * GiB)
    assert nbytes == few.full_batch == (2 * 32 + 1) * 737280
    assert "enough for 2 sequences x 512 tokens" in why


def test_free_memory_caps_it():
    nbytes, why = auto_kv_bytes(CPU, SMOLLM2, 0.9, available=GiB)
    assert nbytes == int(GiB * CPU_SHARE)
    assert why.startswith("256 MiB: at most 25% of 1.0 GiB free memory; wanted")
    assert auto_kv_bytes(CPU, SMOLLM2, 0.9, available=10 * MiB)[0] == CPU_FLOOR


def test_resident_bytes_counts_tied_weights_once():
    emb = torch.nn.Embedding(100, 8)
    head = torch.nn.Linear(8, 100, bias=False)
    head.weight = emb.weight
    model = torch.nn.ModuleDict({"emb": emb, "head": head})
    model.register_buffer("scale", torch.zeros(10, dtype=torch.uint8))
    assert resident_bytes(model) == 100 * 8 * 4 + 10


def test_runner_sizes_its_cache_from_its_own_demand(tiny_dir):
    runner = ModelRunner(str(tiny_dir), kv_cache_memory_bytes=None, max_model_len=100,
                         max_num_seqs=2, deterministic=False)
    # 2 sequences of 7 blocks and the scratch block: the whole demand, far under the floor
    assert runner.num_blocks == 2 * 7
    assert runner.kv_reason.startswith("240 KiB: enough for 2 sequences x 100 tokens")
    asked = ModelRunner(str(tiny_dir), kv_cache_memory_bytes=2**20, max_model_len=100,
                        max_num_seqs=2, deterministic=False)
    assert asked.num_blocks == 63 and asked.kv_reason == "1 MiB asked for"  # the flag wins
