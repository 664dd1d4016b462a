"""HF quantized checkpoints (``quantization_config``) served with their weights quantized.

Per format (``tests/support/quant_zoo.py`` writes each from a tiny Qwen2): the greedy tokens of
the quantized model equal transformers' on the same model dequantized to float32 (for
weight-only formats) and transformers' on the quantized checkpoint itself where it loads
it on CPU (compressed-tensors, whose W8A8 and FP8 schemes also quantize activations per
token, which Candor does the same way: each layer is checked equal to the library's on the
same input, and the tokens equal until a near tie of the reference's own); batched as alone; over two tensor-parallel
ranks. A format, scheme or split Candor cannot serve exactly is refused in one line
naming it, before any process starts (``launcher.preflight``).
"""

from __future__ import annotations

import json

import pytest
import torch
import torch.multiprocessing as mp
from safetensors.torch import load_file

from gpu_worker.model_config import load_config
from gpu_worker.tp_shard import shard_problems
from tests.support import model_zoo, quant_zoo
from tests.support.server import free_port
from tests.support.tp_ranks import leave_group
from tests.e2e.test_tensor_parallel import _generate

MAX_NEW = 10
SHAPE = dict(hidden_size=256, intermediate_size=512, head_dim=64, num_attention_heads=4, num_key_value_heads=2)
# name -> (writer, what its layers run, whether transformers runs the quantized checkpoint)
FORMATS = {
    "gptq": (lambda s, o, r: quant_zoo.write_int4(s, o, r, "gptq"), "int4", False),
    "gptq-asym-actorder": (lambda s, o, r: quant_zoo.write_int4(s, o, r, "gptq", group=64, symmetric=False,
                                                                 act_order=True), "int4", False),
    "awq": (lambda s, o, r: quant_zoo.write_int4(s, o, r, "awq", group=64, symmetric=False), "int4", False),
    "ct-w4a16": (lambda s, o, r: quant_zoo.write_compressed(s, o, r, "w4a16"), "int4", True),
    # (transformers 5 does not load compressed-tensors' packed zero points: their shape
    # mismatches the one it allocates; the reference is the library's own dequantization)
    "ct-w4a16-asym": (lambda s, o, r: quant_zoo.write_compressed(s, o, r, "w4a16-asym"), "int4", False),
    "ct-w8a8": (lambda s, o, r: quant_zoo.write_compressed(s, o, r, "w8a8"), "w8a8-int8", True),
    "ct-fp8-dynamic": (lambda s, o, r: quant_zoo.write_compressed(s, o, r, "fp8-dynamic"), "fp8", True),
    "fp8-block": (lambda s, o, r: quant_zoo.write_fp8(s, o, r), "fp8", False),
    "fp8-tensor": (lambda s, o, r: quant_zoo.write_fp8(s, o, r, block=None), "fp8", False),
}
ACTIVATIONS_QUANTIZED = {"ct-w8a8", "ct-fp8-dynamic"}


@pytest.fixture(scope="module")
def zoo(tmp_path_factory):
    root = tmp_path_factory.mktemp("quant-zoo")
    base = model_zoo.build("qwen2", root / "base", **SHAPE)
    return {name: writer(base, root / name, root / f"{name}-ref") for name, (writer, _, _) in FORMATS.items()}


def _prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(3)
    return [[0] + torch.randint(6, model_zoo.VOCAB, (n - 1,), generator=g).tolist() for n in (11, 27, 5)]


@pytest.mark.parametrize("name", list(FORMATS))
def test_quantized_checkpoint_gives_the_reference_greedy_tokens(zoo, name):
    from gpu_worker.model_runner import ModelRunner

    path, ref = zoo[name]
    _, method, hf_runs_it = FORMATS[name]
    runner = ModelRunner(str(path), num_blocks=64)
    layers = [m for n, m in runner.model.named_modules() if n.endswith(("_proj",))]
    assert layers and {m.method.name for m in layers} == {method}
    assert runner.model.lm_head.method.name == "dense"  # (the formats leave the head alone)
    assert runner.deterministic
    got = _generate(runner, _prompts(), MAX_NEW)
    for i, p in enumerate(_prompts()):  # alone as in the batch
        assert _generate(ModelRunner(str(path), num_blocks=64), [p], MAX_NEW) == [got[i]]
    if hf_runs_it:  # transformers on the quantized checkpoint itself
        hf = model_zoo.hf_model(path)
        want = [model_zoo.hf_greedy(hf, p, MAX_NEW) for p in _prompts()]
        if name in ACTIVATIONS_QUANTIZED:
            _layers_compute_as_the_library_does(runner, hf)
            for p, g, w in zip(_prompts(), got, want):
                _agree_until_a_near_tie(hf, p, g, w)
        else:
            assert got == want
    dense = [model_zoo.hf_greedy(model_zoo.hf_model(ref), p, MAX_NEW) for p in _prompts()]
    if name not in ACTIVATIONS_QUANTIZED:  # weight-only: the dequantized model's tokens
        assert got == dense
    held = sum(p.numel() * p.element_size() for n, p in runner.model.named_parameters() if "layers." in n)
    full = sum(t.numel() * 4 for n, t in load_file(str(ref / "model.safetensors")).items()
               if "layers." in n and t.dim() == 2)  # the float32 matrices
    assert held < full * (0.2 if method == "int4" else 0.3), (held, full)


# Candor's fused layers -> transformers' separate ones: (fused name, which slice of its output)
FUSED = {"q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
         "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}
# How far below transformers' top logit the token Candor chose may be, at the first step the
# two differ (see _agree_until_a_near_tie)
NEAR_TIE = 0.25


def _layers_compute_as_the_library_does(runner, hf) -> None:
    """Every quantized layer of Candor, given the input transformers' layer saw, returns
    what compressed-tensors' own forward returned (activations quantized per token): the
    scheme is computed as defined, within float rounding of the sums' order."""
    seen = {}
    hooks = [m.register_forward_hook(lambda mod, i, o, n=n: seen.setdefault(n, (i[0].detach(), o.detach())) and None)
             for n, m in hf.named_modules() if n.endswith("_proj")]
    with torch.no_grad():
        hf(torch.tensor([_prompts()[1]]))
    for h in hooks:
        h.remove()
    ours = dict(runner.model.named_modules())
    assert len(seen) == 7 * hf.config.num_hidden_layers
    for name, (x, y) in seen.items():
        parent, leaf = name.rsplit(".", 1)
        fused, part = FUSED.get(leaf, (leaf, 0))
        layer = ours[f"{parent}.{fused}"]
        with torch.no_grad():
            out = layer.method.apply(layer, x[0], getattr(layer, "bias", None))
        start = sum(hf.get_submodule(f"{parent}.{k}").out_features for k, (f, i) in FUSED.items()
                    if f == fused and i < part)
        mine = out[:, start:start + y.shape[-1]]
        torch.testing.assert_close(mine, y[0], rtol=1e-4, atol=1e-5 * float(y.abs().max()), msg=name)


def _agree_until_a_near_tie(hf, prompt: list[int], got: list[int], want: list[int]) -> None:
    """Greedy tokens equal transformers' up to a step where transformers' own top two
    logits are within ``NEAR_TIE``, and there Candor's token is one of them.

    Quantizing activations per token rounds each value to one of 256 steps: float noise
    of 1e-4 in a layer's input (another summation order) moves a value near a step's edge
    to the next step, which moved a down_proj output by 0.5 in this tiny random model. The
    layers themselves are checked exact above; end to end, the tokens can only part where
    the reference itself hardly decides (vLLM's ``check_logprobs_close`` reads W8A8 so)."""
    same = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), None)
    if same is None:
        return
    with torch.no_grad():
        logits = hf(torch.tensor([prompt + want[:same]])).logits[0, -1]
    top = logits.topk(2)
    assert got[same] in top.indices.tolist() and float(top.values[0] - logits[got[same]]) < NEAR_TIE, (
        f"step {same}: Candor chose {got[same]} (logit {float(logits[got[same]]):.4f}), transformers "
        f"{want[same]} (top two {top.values.tolist()} at {top.indices.tolist()})")


def _rank_main(rank: int, size: int, port: int, paths: dict, results) -> None:
    torch.set_num_threads(1)
    from gpu_worker.distributed import init_ranks
    from gpu_worker.model_runner import ModelRunner

    ranks = init_ranks(rank, size, f"tcp://127.0.0.1:{port}", torch.device("cpu"))
    for name, path in paths.items():
        tokens = _generate(ModelRunner(path, num_blocks=64, ranks=ranks), _prompts(), MAX_NEW)
        if rank == 0:
            results[name] = tokens
    leave_group()


def test_two_tensor_parallel_ranks_slice_packed_words_groups_and_blocks(zoo):
    """Column layers split packed output words (AWQ, zero points) and per-tensor scales
    repeated over their rows, row layers whole groups along the input."""
    names = ("awq", "ct-w4a16-asym", "fp8-tensor", "ct-w8a8")
    with mp.Manager() as manager:
        results = manager.dict()
        mp.spawn(_rank_main, args=(2, free_port(), {n: str(zoo[n][0]) for n in names}, results), nprocs=2,
                 join=True)
        results = dict(results)
    from gpu_worker.model_runner import ModelRunner
    for name in names:
        assert results[name] == _generate(ModelRunner(str(zoo[name][0]), num_blocks=64), _prompts(), MAX_NEW), name


def _edit(path, **fields):
    cfg = json.loads((path / "config.json").read_text())
    cfg["quantization_config"].update(fields)
    (path / "config.json").write_text(json.dumps(cfg))


@pytest.mark.parametrize("fields, named", [
    ({"quant_method": "bitsandbytes"}, "quantization_config.quant_method='bitsandbytes'"),
    ({"bits": 8}, "quantization_config.bits=8"),
    ({"group_size": 48}, "quantization_config.group_size=48"),
    ({"lm_head": True}, "quantization_config.lm_head=True"),
])
def test_a_format_candor_cannot_serve_is_refused_before_start_naming_it(zoo, tmp_path, fields, named):
    import shutil

    import msgspec

    from launcher.preflight import check_model_config
    from cluster.topology import Topology

    path = tmp_path / "ckpt"
    shutil.copytree(zoo["gptq"][0], path)
    _edit(path, **fields)
    with pytest.raises(SystemExit) as err:
        check_model_config(msgspec.yaml.decode(f"model: {{path: {path}}}".encode(), type=Topology))
    message = str(err.value)
    assert "\n" not in message and named in message and "not supported" in message


def test_a_split_that_cuts_a_block_is_refused_naming_it(zoo):
    """128 x 128 FP8 blocks: two ranks hold one 64-row KV head each, half a block."""
    assert shard_problems(load_config(zoo["awq"][0]), 2) == []
    problems = shard_problems(load_config(zoo["fp8-block"][0]), 2)
    assert problems == ["KV heads' rows per rank (64) cut a block of 128 (output dimension) with "
                        "tensor_parallel=2"], problems


def test_the_quantization_flag_is_checked_against_the_checkpoint(zoo):
    """vLLM's ``--quantization`` names (and ``_marlin`` aliases) must name the checkpoint's
    own format; an unquantized checkpoint is refused (Candor quantizes nothing at load)."""
    from cluster.topology import QUANTIZATION_CHOICES
    from gpu_worker.quantization.spec import QUANTIZATION_NAMES
    from launch_cluster import serve_args_to_topology
    from launcher.preflight import check_model_config

    assert set(QUANTIZATION_CHOICES) == set(QUANTIZATION_NAMES)  # the flag's names, one list each side of the floor

    gptq, dense = str(zoo["gptq"][0]), str(zoo["gptq"][1])
    for name in ("gptq", "gptq_marlin"):
        check_model_config(serve_args_to_topology([gptq, "--quantization", name], environ={})[0])
    with pytest.raises(SystemExit, match=r"^candor: --quantization awq: .* is quantized with gptq \(its "
                                         r"quantization_config.quant_method\)$"):
        check_model_config(serve_args_to_topology([gptq, "-q", "awq"], environ={})[0])
    with pytest.raises(SystemExit, match=r"--quantization fp8: .* is not quantized"):
        check_model_config(serve_args_to_topology([dense, "--quantization", "fp8"], environ={})[0])
