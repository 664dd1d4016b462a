"""LoRA adapters in the gpu_worker, against PEFT as the reference, without the processes.

- Mixed batches: the base model and several adapters (ranks 8 and 4, rslora, all seven
  projections or a few, every layer or some) in one step each give PEFT's greedy tokens
  for their own adapter alone; Phi-3's fused ``qkv_proj`` / ``gate_up_proj`` targets too.
- Two tensor-parallel ranks (gloo) give the same tokens.
- The host cache (``max_cpu_loras``) reads an evicted adapter again; a step never holds
  more than ``max_loras`` adapters on the device.
- What is not plain LoRA on the seven projections is refused in one line naming it.
"""

from __future__ import annotations

import pytest
import torch
import torch.multiprocessing as mp

from cluster.topology import LoraModuleSpec, LoraSpec
from gpu_worker.lora.peft_files import AdapterError, read_adapter
from gpu_worker.model_config import load_config
from protocol.ipc import StepPlan
from tests.support import lora_zoo, model_zoo
from tests.support.server import free_port
from tests.support.tp_ranks import leave_group
from tests.e2e.test_tensor_parallel import _generate

MAX_NEW = 10


def _prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(11)
    return [[0] + torch.randint(6, model_zoo.VOCAB, (n - 1,), generator=g).tolist()
            for n in (9, 33, 17, 5, 24)]


@pytest.fixture(scope="module")
def zoo(tmp_path_factory):
    """Two base checkpoints (separate and fused projections) and their adapters."""
    root = tmp_path_factory.mktemp("lora-zoo")
    qwen2 = model_zoo.build("qwen2", root / "qwen2")
    phi3 = model_zoo.build("phi3", root / "phi3")
    return {
        "qwen2": qwen2, "phi3": phi3,
        **lora_zoo.build_named(qwen2, root),
        "phi3-a": lora_zoo.build_adapter(phi3, root / "phi3-a", rank=8, alpha=8, seed=3,
                                         targets=["qkv_proj", "o_proj", "gate_up_proj", "down_proj"]),
    }


def _spec(zoo, *names: str, **kw) -> LoraSpec:
    return LoraSpec(enabled=True, modules=[LoraModuleSpec(name=n, path=str(zoo[n])) for n in names],
                    **{"max_loras": 4, **kw})


def _expected(zoo, base: str, prompts, adapters: list[str | None]) -> list[list[int]]:
    """Each prompt alone: HF for the base model, PEFT for its adapter."""
    models = {}
    out = []
    for prompt, name in zip(prompts, adapters):
        if name not in models:
            models[name] = (model_zoo.hf_model(zoo[base]) if name is None
                            else lora_zoo.peft_model(zoo[base], zoo[name]))
        generate = model_zoo.hf_greedy if name is None else lora_zoo.peft_greedy
        out.append(generate(models[name], prompt, MAX_NEW))
    return out


def test_a_mixed_batch_gives_each_row_peft_tokens_for_its_own_adapter(zoo):
    from gpu_worker.model_runner import ModelRunner

    runner = ModelRunner(str(zoo["qwen2"]), num_blocks=64, lora=_spec(zoo, "full", "qv"))
    names = [None, "full", "qv", "full", "qv"]
    ids = [0, 1, 2, 1, 2]
    prompts = _prompts()
    got = _generate(runner, prompts, MAX_NEW, ids)
    expected = _expected(zoo, "qwen2", prompts, names)
    assert got == expected
    # the adapters change the tokens: the comparison above could fail
    base = _expected(zoo, "qwen2", prompts, [None] * len(prompts))
    assert all(got[i] != base[i] for i in (1, 2, 3, 4))


def test_fused_projections_take_their_adapter(zoo):
    from gpu_worker.model_runner import ModelRunner

    runner = ModelRunner(str(zoo["phi3"]), num_blocks=64, lora=_spec(zoo, "phi3-a"))
    prompts = _prompts()[:3]
    names = [None, "phi3-a", "phi3-a"]
    got = _generate(runner, prompts, MAX_NEW, [0, 1, 1])
    assert got == _expected(zoo, "phi3", prompts, names)
    assert got[1] != _expected(zoo, "phi3", prompts[1:2], [None])[0]


def _rank_main(rank: int, size: int, port: int, zoo: dict, results) -> None:
    torch.set_num_threads(1)
    from gpu_worker.distributed import init_ranks
    from gpu_worker.model_runner import ModelRunner

    ranks = init_ranks(rank, size, f"tcp://127.0.0.1:{port}", torch.device("cpu"))
    runner = ModelRunner(str(zoo["qwen2"]), num_blocks=64, ranks=ranks, lora=_spec(zoo, "full", "qv"))
    tokens = _generate(runner, _prompts(), MAX_NEW, [0, 1, 2, 1, 2])
    try:  # a load that one rank cannot read fails on every rank, naming that rank
        runner.adapters.register(9, "broken", str(zoo["full"]) if rank == 0 else "/nonexistent")
        error = ""
    except AdapterError as err:
        error = str(err)
    if rank == 0:
        results["tokens"], results["error"] = tokens, error
        results["registered"] = sorted(runner.adapters.registered)
    leave_group()


def test_two_tensor_parallel_ranks_give_peft_tokens(zoo):
    with mp.Manager() as manager:
        results = manager.dict()
        mp.spawn(_rank_main, args=(2, free_port(), dict(zoo), results), nprocs=2, join=True)
        results = dict(results)
    names = [None, "full", "qv", "full", "qv"]
    assert results["tokens"] == _expected(zoo, "qwen2", _prompts(), names)
    assert "tensor-parallel rank 1" in results["error"] and "/nonexistent" in results["error"]
    assert results["registered"] == [1, 2]  # rank 0 read it, but kept nothing


def test_an_adapter_evicted_from_host_memory_is_read_again(zoo):
    from gpu_worker.model_runner import ModelRunner

    runner = ModelRunner(str(zoo["qwen2"]), num_blocks=128,
                         lora=_spec(zoo, "full", "qv", max_loras=1, max_cpu_loras=1))
    assert list(runner.adapters.host) == [2]  # registering "qv" evicted "full"
    prompts = _prompts()[:2]
    for ids, names in (([1, 0], ["full", None]), ([0, 2], [None, "qv"]), ([1, 1], ["full", "full"])):
        assert _generate(runner, prompts, MAX_NEW, ids) == _expected(zoo, "qwen2", prompts, names)
        runner.execute(StepPlan(0, [], released=["r0", "r1"]))  # the rids are used again
    with pytest.raises(ValueError, match="more than max_loras=1"):
        _generate(runner, prompts, 1, [1, 2])  # the scheduler never plans this


# ---------------------------------------------------------------- batch invariance


@pytest.fixture(scope="module")
def two_adapters(zoo):
    """A deterministic runner with "full" (id 1) and "qv" (id 2), built at 2 threads (its
    adapters' row counts are measured for 1 and 2 threads either way)."""
    from gpu_worker.model_runner import ModelRunner

    runner = ModelRunner(str(zoo["qwen2"]), num_blocks=16, lora=_spec(zoo, "full", "qv"))
    assert runner.deterministic, runner.deterministic_note
    return runner


def _layer_out(runner, layer, x: torch.Tensor, spans) -> torch.Tensor:
    """``layer`` (an adapted layer) on rows ``x`` grouped as ``spans``: (adapter id, runs)."""
    store = runner.adapters
    store.batch.set([(store.host[a], runs) for a, runs in spans], x.device)
    try:
        with torch.inference_mode():
            return layer(x)
    finally:
        store.batch.clear()


@pytest.mark.parametrize("module", ["qkv_proj", "o_proj", "gate_up_proj", "down_proj"])
def test_an_adapter_row_is_the_same_alone_and_in_a_group_of_any_size(two_adapters, threads, module):
    """The deterministic mode's promise for adapter rows: a row's output (base + delta) has
    the same bits alone as among 1..16 rows of its adapter, contiguous or split in two
    runs, beside base rows and another adapter's rows."""
    from gpu_worker.lora.weights import adapted_layer

    runner = two_adapters
    layer = adapted_layer(runner.model, 0, module)
    g = torch.Generator().manual_seed(len(module))
    x = torch.randn(16, layer.weight.shape[1], generator=g)
    base = torch.randn(5, layer.weight.shape[1], generator=g)
    alone = [_layer_out(runner, layer, x[i:i + 1], [(1, [(0, 1)])])[0] for i in range(16)]
    for m in range(1, 17):
        # 3 base rows, the first half of the adapter's rows, 2 rows of "qv", the rest
        half = m // 2
        rows = torch.cat([base[:3], x[:half], base[3:5], x[half:m]])
        runs = [(3, half), (5 + half, m - half)] if half else [(5, m)]
        out = _layer_out(runner, layer, rows, [(1, runs), (2, [(3 + half, 2)])])
        got = torch.cat([out[3:3 + half], out[5 + half:5 + m]])
        for i in range(m):
            assert torch.equal(got[i], alone[i]), (
                f"{module}: adapter row {i} among {m} of its adapter's rows ({threads} threads) "
                "differs from the row alone")
        contiguous = _layer_out(runner, layer, torch.cat([base[:2], x[:m]]), [(1, [(2, m)])])[2:]
        assert all(torch.equal(contiguous[i], alone[i]) for i in range(m)), f"{module}: one run of {m}"


# ---------------------------------------------------------------- refusals


@pytest.mark.parametrize("extra, named", [
    ({"use_dora": True}, "DoRA"),
    ({"modules_to_save": ["lm_head"]}, "modules_to_save"),
    ({"targets": ["q_proj", "embed_tokens"]}, "embed_tokens"),
    ({"rank": 32}, "max_lora_rank 16"),
    ({"rank_pattern": {"q_proj": 2}}, "rank_pattern"),
    ({"bias": "lora_only"}, "bias='lora_only'"),
])
def test_what_is_not_plain_lora_on_the_projections_is_refused_naming_it(zoo, tmp_path, extra, named):
    kw = {"rank": 8, "alpha": 16, **extra}
    path = lora_zoo.build_adapter(zoo["qwen2"], tmp_path / "a", **kw)
    with pytest.raises(AdapterError, match=named) as err:
        read_adapter(str(path), load_config(zoo["qwen2"]), max_rank=16)
    assert "\n" not in str(err.value)


def test_an_adapter_for_another_model_or_without_its_files_is_refused(zoo, tmp_path):
    base = load_config(zoo["qwen2"])
    wider = model_zoo.build("qwen2", tmp_path / "wider", intermediate_size=96)
    other = lora_zoo.build_adapter(wider, tmp_path / "other", rank=8, alpha=8)
    with pytest.raises(AdapterError, match=r"mlp.down_proj: lora_A \[8, 96\] .* do not fit"):
        read_adapter(str(other), base, 16)
    with pytest.raises(AdapterError, match=r"'model\.layers\.0\.mlp\.gate_up_proj' is not served"):
        read_adapter(str(zoo["phi3-a"]), base, 16)  # fused names where the base is separate
    tmp_path = tmp_path / "empty"
    tmp_path.mkdir()
    with pytest.raises(AdapterError, match="has no adapter_config.json"):
        read_adapter(str(tmp_path), base, 16)
    (tmp_path / "adapter_config.json").write_text('{"peft_type": "LORA", "r": 8, "lora_alpha": 8}')
    (tmp_path / "adapter_model.bin").write_bytes(b"pickle")
    with pytest.raises(AdapterError, match="is a pickle"):
        read_adapter(str(tmp_path), base, 16)
    (tmp_path / "adapter_model.safetensors").write_bytes(b"\xff" * 16)
    with pytest.raises(AdapterError, match="not a safetensors file"):
        read_adapter(str(tmp_path), base, 16)
    lora_zoo.edit_config(zoo["full"], peft_type="LOHA")
    try:
        with pytest.raises(AdapterError, match="peft_type 'LOHA'"):
            read_adapter(str(zoo["full"]), base, 16)
    finally:
        lora_zoo.edit_config(zoo["full"], peft_type="LORA")
