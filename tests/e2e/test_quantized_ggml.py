"""GGUF weights kept in their GGML blocks, against ``gguf.quants`` (llama.cpp's own code).

- The kernel dequantizes every type bitwise as ``gguf.quants.dequantize``; its matmul is
  within float rounding of that dequantized weight times x in fp32, and a row's result
  is bitwise the same in every batch of 1..32 rows, at any position, at 1 and 2 threads.
- The torch path (no kernel) computes the same values.
- A tiny Qwen2 served from blocks (Q4_1 everywhere; a Q4_K_M-like mix whose fused q|k|v
  holds Q4_K and Q6_K parts apart; Q8_0 with Q5_0 / Q5_1) gives the greedy tokens of
  HF transformers on the dequantized checkpoint, alone and in a batch, also over two
  tensor-parallel ranks, and with a LoRA adapter those of PEFT on the dequantized model.
- A row-parallel split inside a block is refused in one line naming the tensor.

The GGUF reader itself is another module's: here a safetensors file holds the raw blocks
under HF names and the test gives the runner the spec the reader would build.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import msgspec
import numpy as np
import pytest
import torch
import torch.multiprocessing as mp
from gguf import GGMLQuantizationType
from gguf.quants import dequantize

from gpu_worker.cpu_extension import int_dot_flags
from gpu_worker.quantization import kernels
from gpu_worker.quantization.spec import GGML_TYPES, GgmlSpec
from tests.support import ggml_zoo, layer_programs, lora_zoo, model_zoo
from tests.support.server import REPO, free_port
from tests.support.tp_ranks import leave_group
from tests.e2e.test_tensor_parallel import _generate

TYPES = list(GGML_TYPES)
MAX_NEW = 10
# hidden 256: whole K-quant blocks of 256 along every input
SHAPE = dict(hidden_size=256, intermediate_size=512, head_dim=64, num_attention_heads=4, num_key_value_heads=2)


def _kernel():
    k = kernels.load()
    assert k is not None, "the quantized-matmul kernel did not build"
    return k


def _raw(type_name: str, rows: int, cols: int, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return ggml_zoo.blocks(type_name, rng.standard_normal((rows, cols)).astype(np.float32) * 0.3, rng)


@pytest.mark.parametrize("type_name", TYPES)
def test_kernel_dequantizes_every_type_bitwise_as_gguf(type_name):
    raw = _raw(type_name, 37, 512)
    want = dequantize(raw, GGMLQuantizationType[type_name])
    got = _kernel().ggml_dequantize(torch.from_numpy(raw), GGML_TYPES[type_name][0], 512).numpy()
    assert got.tobytes() == want.astype(np.float32).tobytes()


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("type_name", TYPES)
def test_kernel_matmul_is_the_dequantized_product_and_batch_invariant(type_name, threads):
    k, n, big = 512, 45, 32  # 45 features: a partial work item of 4
    raw = _raw(type_name, n, k, seed=1)
    w = torch.from_numpy(dequantize(raw, GGMLQuantizationType[type_name]).copy())
    blocks = torch.from_numpy(raw)
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(big, k, generator=gen)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        def run(rows: torch.Tensor) -> torch.Tensor:
            out = torch.full((rows.shape[0], n + 7), float("nan"))
            _kernel().ggml_linear(rows.contiguous(), blocks, GGML_TYPES[type_name][0], out[:, 3:3 + n])
            assert out[:, :3].isnan().all() and out[:, 3 + n:].isnan().all()  # wrote its columns only
            return out[:, 3:3 + n]

        ref = run(x)
        torch.testing.assert_close(ref, x.double().mm(w.double().T).float(), rtol=1e-5, atol=1e-4)
        for m in range(1, big + 1):
            rows = torch.randperm(big, generator=gen)[:m]
            assert torch.equal(run(x[rows]), ref[rows]), m
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("type_name", ["Q4_0", "Q4_1", "Q8_0"])
@pytest.mark.parametrize("k", [64, 224, 800])
def test_gathered_block_scales_at_every_width(type_name, k):
    """The 32-element types read their blocks' scales sixteen (panels) or four blocks by
    four outputs (few rows) at a time: widths of 2, 7 and 25 blocks leave partial groups
    at the end. Every row count gives the dequantized product, and each row its one-row
    result bitwise."""
    n, big = 13, 20  # 13 outputs: a partial work item of 4
    raw = _raw(type_name, n, k, seed=k)
    w = torch.from_numpy(dequantize(raw, GGMLQuantizationType[type_name]).copy())
    blocks, type_id = torch.from_numpy(raw), GGML_TYPES[type_name][0]
    x = torch.randn(big, k, generator=torch.Generator().manual_seed(k))

    def run(rows: torch.Tensor) -> torch.Tensor:
        out = torch.empty(rows.shape[0], n)
        _kernel().ggml_linear(rows.contiguous(), blocks, type_id, out)
        return out

    alone = torch.cat([run(x[r:r + 1]) for r in range(big)])
    torch.testing.assert_close(alone, x.double().mm(w.double().T).float(), rtol=1e-5, atol=1e-4)
    for m in (2, 3, 4, 5, 6, 7, 16, big):
        assert torch.equal(run(x[:m]), alone[:m]), m


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("type_name", ["Q4_1", "Q8_0", "Q4_K", "Q6_K"])
def test_many_row_matmul_gives_each_row_its_result_alone(type_name, threads):
    """A prefill-sized batch (tiles of rows over panels of outputs, partial ones at both
    ends, x in blocks of rows) gives every row bitwise its one-row result (the few-row
    path), within float rounding of float64's product."""
    # 70 outputs: two whole panels of 32 and a part; 403 rows of 768: two blocks of x (1 MiB
    # each, 336 rows), the second ending in a partial tile
    k, n, m = 768, 70, 403
    raw = _raw(type_name, n, k, seed=3)
    w = torch.from_numpy(dequantize(raw, GGMLQuantizationType[type_name]).copy())
    blocks, type_id = torch.from_numpy(raw), GGML_TYPES[type_name][0]
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(1))
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        batch = torch.full((m, n + 5), float("nan"))
        _kernel().ggml_linear(x, blocks, type_id, batch[:, 2:2 + n])
        assert batch[:, :2].isnan().all() and batch[:, 2 + n:].isnan().all()
        batch = batch[:, 2:2 + n]
        torch.testing.assert_close(batch, x.double().mm(w.double().T).float(), rtol=1e-5, atol=1e-4)
        for r in range(m):
            alone = torch.empty(1, n)
            _kernel().ggml_linear(x[r:r + 1], blocks, type_id, alone)
            assert torch.equal(alone[0], batch[r]), r
    finally:
        torch.set_num_threads(before)


class _Layer(torch.nn.Module):
    """What a method needs of a layer: its logical shape and the group's numerics."""

    def __init__(self, out_features: int, in_features: int) -> None:
        super().__init__()
        from gpu_worker.models.parallel import TPGroup
        from gpu_worker.tp_shard import TPShard
        self.out_features, self.in_features = out_features, in_features
        self.tp = TPGroup(TPShard(0, 1, 1, 0, 1, 0, 1, 1, 0, 1, 1))


@pytest.mark.parametrize("type_name", ["Q4_1", "Q6_K"])
def test_the_torch_path_computes_the_same_values(type_name, monkeypatch):
    from gpu_worker.quantization.ggml import GgmlLinear

    raw = torch.from_numpy(_raw(type_name, 300, 256, seed=2))  # more rows than one slab
    layer = _Layer(300, 256)
    method = GgmlLinear({None: type_name})
    method.create_weights(layer)
    layer.weight.data.copy_(raw)
    x = torch.randn(5, 256)
    bias = torch.randn(300)
    fast = method.apply(layer, x, bias)
    monkeypatch.setattr(kernels, "load", lambda: None)
    slow = method.apply(layer, x, bias)
    torch.testing.assert_close(slow, fast, rtol=1e-5, atol=1e-4)
    ids = torch.tensor([[3, 299], [0, 150]])
    want = torch.from_numpy(dequantize(raw.numpy(), GGMLQuantizationType[type_name]).copy())[ids]
    assert torch.equal(method.embed(layer, ids), want)


@pytest.mark.parametrize("type_name", ["Q4_0", "Q4_1", "Q8_0"])
def test_the_packed_layout_gives_the_rows_bits_and_lookups(type_name, monkeypatch):
    """``finish`` rearranges Q4_0 / Q4_1 / Q8_0 into the integer kernel's packed layout
    (tiles of 16 rows; 300 rows leave a part tile): every row count gives the bits the GGML
    rows gave, lookups the same rows, the torch path the same values; a second finish
    leaves it be."""
    from gpu_worker.quantization.ggml import GgmlLinear

    type_id, block, nbytes = GGML_TYPES[type_name]
    if not _kernel().ggml_packs(type_id):
        pytest.skip("no integer dot products on this CPU (the GGML rows stay as they are)")
    raw = torch.from_numpy(_raw(type_name, 300, 256, seed=3))
    layer = _Layer(300, 256)
    method = GgmlLinear({None: type_name})
    method.create_weights(layer)
    layer.weight.data.copy_(raw)
    xs = [torch.randn(m, 256, generator=torch.Generator().manual_seed(m)) for m in (1, 5, 8, 9, 40)]
    ids = torch.tensor([[3, 299], [0, 150], [15, 16]])
    before = [method.apply(layer, x, None) for x in xs]
    looked_up = method.embed(layer, ids)
    method.finish(layer)
    assert method.packed == {"weight"} and layer.weight.shape == (19, 256 // block * 16 * nbytes)
    for x, want in zip(xs, before):
        assert torch.equal(method.apply(layer, x, None), want), x.shape
    assert torch.equal(method.embed(layer, ids), looked_up)
    method.finish(layer)
    assert layer.weight.shape == (19, 256 // block * 16 * nbytes)
    monkeypatch.setattr(kernels, "load", lambda: None)
    torch.testing.assert_close(method.apply(layer, xs[1], None), before[1], rtol=1e-5, atol=1e-4)


# ---------------------------------------------------------------- served from blocks

def _q4_k_m(name: str, shape: tuple) -> str:
    """Ollama's Q4_K_M mix, roughly: Q6_K for v, down and the head, Q4_K elsewhere."""
    return "Q6_K" if any(p in name for p in ("v_proj", "down_proj", "lm_head", "embed")) else "Q4_K"


MIXES = {
    "q4_1": lambda name, shape: "Q4_1",
    "q4_k_m": _q4_k_m,
    "q8_0-q5": lambda name, shape: "Q8_0" if "self_attn" in name else ("Q5_0" if "mlp" in name else "Q5_1"),
}


@pytest.fixture(scope="module")
def zoo(tmp_path_factory):
    root = tmp_path_factory.mktemp("ggml-zoo")
    base = model_zoo.build("qwen2", root / "base", **SHAPE)
    out = {"base": base}
    for mix, type_of in MIXES.items():
        ggml_zoo.quantize_checkpoint(base, root / mix, root / f"{mix}-ref", type_of)
        out[mix], out[f"{mix}-ref"] = root / mix, root / f"{mix}-ref"
    out["adapter"] = lora_zoo.build_adapter(out["q4_k_m-ref"], root / "adapter", rank=8, alpha=16, seed=4)
    return out


def _use_ggml_specs() -> None:
    """What the GGUF reader does: the model config of a block checkpoint names its types
    (here from the ggml_types.json the zoo wrote beside it)."""
    from gpu_worker import model_runner

    load = model_runner.load_config

    def with_spec(path):
        cfg = load(path)
        types = Path(path) / "ggml_types.json"
        if types.exists():
            cfg = msgspec.structs.replace(cfg, quantization=GgmlSpec(json.loads(types.read_text())))
        return cfg

    model_runner.load_config = with_spec


@pytest.fixture
def ggml_specs(monkeypatch):
    from gpu_worker import model_runner

    monkeypatch.setattr(model_runner, "load_config", model_runner.load_config)
    _use_ggml_specs()


def _prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(7)
    return [[0] + torch.randint(6, model_zoo.VOCAB, (n - 1,), generator=g).tolist() for n in (9, 30, 4)]


@pytest.mark.parametrize("mix", list(MIXES))
def test_blocks_serve_the_greedy_tokens_of_the_dequantized_model(zoo, mix, ggml_specs):
    from gpu_worker.model_runner import ModelRunner

    runner = ModelRunner(str(zoo[mix]), num_blocks=64)
    methods = {type(m.method).__name__ for m in runner.model.modules() if hasattr(m, "method")}
    assert methods == {"GgmlLinear"}, methods  # every linear layer and the embedding/head
    assert runner.deterministic
    hf = model_zoo.hf_model(zoo[f"{mix}-ref"])
    want = [model_zoo.hf_greedy(hf, p, MAX_NEW) for p in _prompts()]
    assert _generate(runner, _prompts(), MAX_NEW) == want
    for i, p in enumerate(_prompts()):  # alone as in the batch
        assert _generate(ModelRunner(str(zoo[mix]), num_blocks=64), [p], MAX_NEW) == [want[i]]
    held = sum(p.numel() * p.element_size() for p in runner.model.parameters())
    dense = (zoo[f"{mix}-ref"] / "model.safetensors").stat().st_size  # float32
    assert held < dense * (0.2 if mix == "q4_1" else 0.3), (held, dense)  # 5 bits of 32 (Q4_1)


@pytest.mark.parametrize("deterministic", [True, False], ids=["deterministic", "fast"])
@pytest.mark.parametrize("mix", ["q4_1", "q4_k_m"])
def test_layer_programs_give_the_modules_bits_on_blocks(zoo, mix, deterministic, ggml_specs):
    """Flat layer programs (gpu_worker/models/layer_program.py) call a packed tensor's
    kernel directly (Q4_1 where the integer kernels pack it) and a fused layer of parts
    (Q4_K_M's q|k|v) through its method; packed layers only also run as one C++ loop
    (layer_loop.py), for the batch-invariant attention's steps: the modules' bits in
    every way."""
    from gpu_worker.model_runner import ModelRunner

    runner = ModelRunner(str(zoo[mix]), num_blocks=16, deterministic=deterministic)
    qkv = runner.model.model.layers[0].self_attn.qkv_proj.method
    packs = _kernel().ggml_packs(GGML_TYPES["Q4_1"][0])
    assert (len(qkv.segments), bool(qkv.packed)) == ((1, packs) if mix == "q4_1" else (3, False))  # q, k: Q4_K; v: Q6_K
    assert (runner.model.loop is not None) == (mix == "q4_1" and packs)
    assert layer_programs.assert_same_bits(runner) == SHAPE.get("num_hidden_layers", 3)


def test_the_layer_loop_refuses_a_kernel_of_another_type(monkeypatch):
    """The loop casts each kernel's address to the type it expects: a kernel module that
    declares another type (a signature changed on one side only) leaves the programs in
    Python, naming it, rather than calling through the wrong type."""
    from gpu_worker.models import layer_loop

    loop = layer_loop.load()
    assert loop is not None, "the layer loop did not build"
    assert len(layer_loop._kernel_addresses(loop)) == len(loop.kernel_types())
    real = _kernel()

    class Changed:  # ggml_apply_packed taking its x first
        def kernel_abi(self):
            abi = dict(real.kernel_abi())
            address, _ = abi["ggml_apply_packed"]
            abi["ggml_apply_packed"] = (address, "torch::Tensor (*)(torch::Tensor, torch::Tensor, int64_t, int64_t)")
            return abi

    monkeypatch.setattr(layer_loop.quant_kernels, "load", lambda: Changed())
    why = layer_loop._kernel_addresses(loop)
    assert isinstance(why, str) and "ggml_apply_packed" in why and "(torch::Tensor, torch::Tensor, int64_t" in why


def _rank_main(rank: int, size: int, port: int, path: str, results) -> None:
    torch.set_num_threads(1)
    _use_ggml_specs()
    from gpu_worker.distributed import init_ranks
    from gpu_worker.model_runner import ModelRunner

    ranks = init_ranks(rank, size, f"tcp://127.0.0.1:{port}", torch.device("cpu"))
    tokens = _generate(ModelRunner(path, num_blocks=64, ranks=ranks), _prompts(), MAX_NEW)
    if rank == 0:
        results["tokens"] = tokens
    leave_group()


def test_two_tensor_parallel_ranks_split_rows_and_whole_blocks(zoo):
    """Q4_1's 32-element blocks: column layers split rows of blocks, row layers whole
    blocks along the input (o_proj 128 columns per rank, down_proj 256)."""
    with mp.Manager() as manager:
        results = manager.dict()
        mp.spawn(_rank_main, args=(2, free_port(), str(zoo["q4_1"]), results), nprocs=2, join=True)
        tokens = results["tokens"]
    hf = model_zoo.hf_model(zoo["q4_1-ref"])
    assert tokens == [model_zoo.hf_greedy(hf, p, MAX_NEW) for p in _prompts()]


def test_a_row_split_inside_a_block_is_refused_naming_the_tensor(zoo, ggml_specs):
    """Two ranks over Q4_K's 256-element blocks: o_proj's 256 input columns would split
    into 128 each, half a block."""
    from gpu_worker.distributed import Ranks
    from gpu_worker.model_runner import ModelRunner

    with pytest.raises(ValueError) as err:
        ModelRunner(str(zoo["q4_k_m"]), num_blocks=64, ranks=Ranks(1, 2))  # rank 1's shard: fails before any collective
    message = str(err.value)
    assert "\n" not in message and "layers.0.self_attn.o_proj" in message
    assert "cut a Q4_K block of 256" in message


def test_lora_on_a_quantized_base_gives_peft_tokens_on_the_dequantized_model(zoo, ggml_specs):
    from cluster.topology import LoraModuleSpec, LoraSpec
    from gpu_worker.model_runner import ModelRunner

    spec = LoraSpec(enabled=True, modules=[LoraModuleSpec(name="a", path=str(zoo["adapter"]))], max_loras=2)
    runner = ModelRunner(str(zoo["q4_k_m"]), num_blocks=64, lora=spec)
    prompts = _prompts()
    got = _generate(runner, prompts, MAX_NEW, [0, 1, 1])
    peft = lora_zoo.peft_model(zoo["q4_k_m-ref"], zoo["adapter"])
    hf = model_zoo.hf_model(zoo["q4_k_m-ref"])
    want = [model_zoo.hf_greedy(hf, prompts[0], MAX_NEW)] + [lora_zoo.peft_greedy(peft, p, MAX_NEW)
                                                            for p in prompts[1:]]
    assert got == want
    assert got[1] != model_zoo.hf_greedy(hf, prompts[1], MAX_NEW)  # the adapter changes them


def _hard_rows(k: int, rows: int, seed: int) -> torch.Tensor:
    """Rows whose blocks mix what the integer path's digits must keep: a large value
    beside tiny negative ones (their fraction of the block's scale rounds up to a whole
    unit in float arithmetic), exact zeros and negative zeros, values at powers of two
    (the block's scale steps there), halves of the last digit, and blocks of only tiny
    values."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, k, generator=gen) * torch.logspace(-4, 2, k)[torch.randperm(k, generator=gen)]
    x[:, 5::32] = -3.5e-8
    x[:, 7::32] = 454.5757
    x[:, 9::32] = 0.0
    x[:, 10::32] = -0.0
    x[:, 11::32] = -128.0
    x[:, 12::32] = 2.0 ** -17 * 3  # with 454's scale of 4: 1.5 units of the last digit
    x[1::3, 64:96] = torch.randn(len(range(1, rows, 3)), 32, generator=gen) * 1e-30
    x[2::3, 96:128] = -(2.0 ** 9)  # a block's largest value at a power of two
    return x


@pytest.mark.parametrize("type_name", ["Q4_0", "Q4_1", "Q8_0"])
def test_integer_digits_keep_every_value_of_a_block(type_name):
    """The 32-element types multiply integer codes by x's digits against a per-block
    power-of-two scale (quant_linear.cpp, "exact integer dot products"): each value is
    kept to the block's largest value's fp32 resolution, so the product stays within
    fp32 rounding of float64's, on the few-row path (1-8 rows) and on the tiled one (9+),
    and the rows agree bitwise between them."""
    k, n, m = 256, 37, 24
    raw = _raw(type_name, n, k, seed=11)
    w = torch.from_numpy(dequantize(raw, GGMLQuantizationType[type_name]).copy())
    blocks, type_id = torch.from_numpy(raw), GGML_TYPES[type_name][0]
    x = _hard_rows(k, m, seed=5)
    out = torch.empty(m, n)
    _kernel().ggml_linear(x, blocks, type_id, out)
    ref = x.double().mm(w.double().T)
    # fp32 rounding over |x| |w| (2^-19: Q4's codes and offsets cancel, as in the float
    # kernel; a lost digit costs 2^-8 of a block's largest value)
    bound = x.double().abs().mm(w.double().abs().T) * 2.0 ** -19
    assert ((out.double() - ref).abs() <= bound + 1e-30).all()
    for r in range(m):
        alone = torch.empty(1, n)
        _kernel().ggml_linear(x[r:r + 1], blocks, type_id, alone)
        assert torch.equal(alone[0], out[r]), r


@pytest.mark.parametrize("rows", [3, 20])
def test_a_non_finite_value_spoils_only_its_own_row(rows):
    """NaN or inf in a row's x makes that row's outputs NaN (a scale that is not finite),
    never a finite wrong number, and leaves the other rows' bits alone."""
    k, n = 128, 21
    raw = _raw("Q4_1", n, k, seed=2)
    blocks, type_id = torch.from_numpy(raw), GGML_TYPES["Q4_1"][0]
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(3))
    clean = torch.empty(rows, n)
    _kernel().ggml_linear(x, blocks, type_id, clean)
    x[1, 40] = float("nan")
    x[2, 100] = float("inf")
    out = torch.empty(rows, n)
    _kernel().ggml_linear(x, blocks, type_id, out)
    assert out[1].isnan().all() and out[2].isnan().all()
    keep = [r for r in range(rows) if r not in (1, 2)]
    assert torch.equal(out[keep], clean[keep])


_AMX_OFF_SCRIPT = """
import sys, torch
from gpu_worker.quantization import kernels
x, blocks, type_id, n = torch.load(sys.argv[1])
out = torch.empty(x.shape[0], n)
kernels.load().ggml_linear(x, blocks, type_id, out)
torch.save(out, sys.argv[2])
"""


@pytest.mark.parametrize("type_name", ["Q4_0", "Q4_1", "Q8_0"])
def test_the_tiled_and_the_few_row_paths_give_the_same_bits_at_every_row_count(type_name, tmp_path):
    """The integer path's claim, checked where it matters: 40 rows on AMX tiles, and the
    same 40 rows with AMX turned off (``CANDOR_CPU_AMX=0``: every row count on VNNI, eight
    rows at a time), in another process, give the same bits. Skipped where the CPU has no
    AMX (then there is one path)."""
    if "-mamx-int8" not in int_dot_flags():
        pytest.skip("no AMX on this CPU: the VNNI path serves every row count")
    k, n, m = 320, 53, 40
    raw = _raw(type_name, n, k, seed=4)
    blocks, type_id = torch.from_numpy(raw), GGML_TYPES[type_name][0]
    x = _hard_rows(k, m, seed=9)
    tiled = torch.empty(m, n)
    _kernel().ggml_linear(x, blocks, type_id, tiled)
    torch.save((x, blocks, type_id, n), tmp_path / "in.pt")
    env = {**os.environ, "CANDOR_CPU_AMX": "0",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    subprocess.run([sys.executable, "-c", _AMX_OFF_SCRIPT, str(tmp_path / "in.pt"), str(tmp_path / "out.pt")],
                   check=True, env=env, timeout=600)
    assert torch.equal(torch.load(tmp_path / "out.pt"), tiled)


@pytest.mark.parametrize("type_name", ["Q4_0", "Q4_1"])
def test_q4s_two_ways_to_a_blocks_sum_agree_where_the_sums_are_largest(type_name):
    """Q4's many-row path sums codes times x's halves (X = 4096 H + L) where the few-row
    path sums them times three digits, and both round sum q X once (quant_linear.cpp's
    note: the digits' inner fma is exact because |S0 + S1 / 256| < 2^16). Checked where
    that bound is tightest: codes all 15 against X = -(2^23 - 2^16 + 1) (D0 = -128, D1 =
    D2 = 255) and X = 2^23 - 1, and against their mixes with every low bit set, tiled
    (20 rows) and alone, bitwise, and within fp32 rounding of float64."""
    k, n, m = 128, 35, 20
    raw = _raw(type_name, n, k, seed=6)
    codes_at = 2 if type_name == "Q4_0" else 4  # after d (and m)
    per_block = raw.reshape(n, k // 32, -1)
    per_block[::2, :, codes_at:] = 0xFF  # every other output: all codes 15
    blocks, type_id = torch.from_numpy(per_block.reshape(n, -1).copy()), GGML_TYPES[type_name][0]
    w = torch.from_numpy(dequantize(blocks.numpy(), GGMLQuantizationType[type_name]).copy())
    low = -(127.0 + 2.0 ** -16)  # X = -8323073: D0 = -128, D1 = D2 = 255
    high = 128.0 - 2.0 ** -16  # X = 2^23 - 1
    gen = torch.Generator().manual_seed(8)
    x = torch.full((m, k), low)
    x[1] = high
    x[2::3] = torch.where(torch.rand(len(range(2, m, 3)), k, generator=gen) < 0.5, low, high)
    x[3::3] = low + torch.randint(0, 2 ** 16, (len(range(3, m, 3)), k), generator=gen) * 2.0 ** -16
    x[4::3] *= 2.0 ** torch.randint(-20, 20, (len(range(4, m, 3)), 1), generator=gen)
    tiled = torch.empty(m, n)
    _kernel().ggml_linear(x, blocks, type_id, tiled)
    for r in range(m):
        alone = torch.empty(1, n)
        _kernel().ggml_linear(x[r:r + 1], blocks, type_id, alone)
        assert torch.equal(alone[0], tiled[r]), r
    ref = x.double().mm(w.double().T)
    bound = x.double().abs().mm(w.double().abs().T) * 2.0 ** -19
    assert ((tiled.double() - ref).abs() <= bound).all()
