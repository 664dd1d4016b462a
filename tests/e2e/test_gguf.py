"""GGUF files against transformers' GGUF loader on the same file (tiny files written by
``tests/support/gguf_zoo.py`` with llama.cpp's writer and quantizers).

- every ggml type Candor loads, and every architecture: the dequantized weights equal
  transformers' bit for bit and greedy tokens equal its greedy tokens (runner level:
  chunked prefill, continuous batching, prompts past Gemma's windows); two TP ranks too;
- the config read from the metadata equals transformers' where transformers reads the
  field, and follows llama.cpp where it does not;
- bad files (wrong magic, truncated, unknown or unsupported type, shape or name the
  metadata contradicts, missing tensor) are refused in one line, by the launcher too.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
import torch.multiprocessing as mp
from gguf import GGMLQuantizationType as T

from launcher.gguf_checkpoint import prepare
from gpu_worker.gguf.config import hf_config
from gpu_worker.gguf.reader import GGUFError, GGUFFile
from gpu_worker.gguf.tensors import SUPPORTED_TYPES, GGUFCheckpoint
from gpu_worker.gguf.weights import GGUFWeights
from gpu_worker.model_config import load_config
from gpu_worker.model_runner import ModelRunner
from tests.support import gguf_zoo, model_zoo
from tests.support.server import REPO, free_port
from tests.unit.gpu_worker.test_model_parity import GREEDY, run_continuous

PROMPT_LENS = (1, 20, 70)  # 70: past Gemma's 24-token windows
NEW = 12


def _prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(3)
    return [[0] + torch.randint(6, gguf_zoo.VOCAB, (n - 1,), generator=g).tolist() for n in PROMPT_LENS]


@pytest.fixture(scope="module")
def files(tmp_path_factory, tiny_model_dir):
    """(GGUF file, its prepared directory) per case, written on first use. Prepared with
    the tiny model's tokenizer files (``--tokenizer``: the same vocabulary; the metadata
    route is test_gguf_tokenizer's)."""
    root = tmp_path_factory.mktemp("gguf")
    env = {"CANDOR_GGUF_CACHE": str(root / "cache")}
    made: dict[tuple, tuple] = {}

    def get(arch: str, weight_type: T, **kw):
        key = (arch, weight_type, tuple(sorted(kw.items())))
        if key not in made:
            path = gguf_zoo.write(root / f"{arch}-{weight_type.name}-{len(made)}.gguf", arch, weight_type, **kw)
            made[key] = path, prepare(str(path), str(tiny_model_dir), env)
        return made[key]

    return get


def _assert_matches_transformers(path, directory):
    hf = gguf_zoo.transformers_model(path)
    state = hf.state_dict()
    weights = GGUFWeights(path)
    assert len(weights.keys()) >= 20
    for name in weights.keys():  # the loader's floats are transformers' floats
        assert torch.equal(weights.get_tensor(name), state[name]), name
    want = [model_zoo.hf_greedy(hf, p, NEW) for p in _prompts()]
    runner = ModelRunner(str(directory), block_size=16, num_blocks=64)
    got = run_continuous(runner, _prompts(), [GREEDY] * len(PROMPT_LENS), new_tokens=NEW, arrivals=[0, 1, 0],
                         chunk=32)
    assert got == want
    assert all(len(set(w)) >= 3 for w in want[1:])  # the random model is not degenerate


@pytest.mark.parametrize("weight_type", SUPPORTED_TYPES, ids=lambda t: t.name)
def test_every_type_loads_as_transformers_reads_it(weight_type, files):
    """Llama (q/k rows permuted in the file) with every matrix in ``weight_type``."""
    _assert_matches_transformers(*files("llama", weight_type))


@pytest.mark.parametrize("arch, weight_type, kw", [
    ("qwen2", T.Q4_K, {"mixed_q6k": True, "embed_type": T.Q8_0}),  # Ollama's Q4_K_M mix; biases; tied
    ("qwen3", T.Q8_0, {}),  # per-head q/k norms, head_dim 128
    ("gemma2", T.Q5_K, {"embed_type": T.F16}),  # 1 + w norms, soft-caps, sandwich norms, windows
    ("gemma3", T.Q4_1, {}),  # 5 local : 1 global layers, local RoPE base, q/k norms
], ids=["qwen2", "qwen3", "gemma2", "gemma3"])
def test_every_architecture_matches_transformers(arch, weight_type, kw, files):
    _assert_matches_transformers(*files(arch, weight_type, **kw))


def test_tensors_carry_the_raw_blocks_in_hf_row_order(files):
    """The contract with a quantized linear method: GGUF and HF names, type, HF shape and
    the blocks of each HF row (llama's q rows gathered back from the file's order)."""
    path, _ = files("llama", T.Q4_0)
    checkpoint = GGUFCheckpoint.open(path)
    q = checkpoint.tensors["model.layers.0.self_attn.q_proj.weight"]
    assert (q.gguf_name, q.ggml_type, q.shape) == ("blk.0.attn_q.weight", T.Q4_0, (256, 256))
    assert q.rows.dtype.name == "uint8" and q.rows.shape == (256, 256 // 32 * 18)
    stored = checkpoint.file.raw(q.info)
    assert (q.rows[1] == stored[2]).all() and (q.rows[32] == stored[1]).all()  # head 0: pairs, then halves
    v = checkpoint.tensors["model.layers.0.self_attn.v_proj.weight"]
    assert v.rows.base is not None and (v.rows == checkpoint.file.raw(v.info)).all()  # a view, as stored


def test_two_ranks_give_transformers_greedy_tokens(files):
    """Column shards hold their rows of blocks, row shards their run of whole blocks along
    the input (a 256-wide K block would be cut by these tiny models' 128 columns a rank:
    that split is refused, see test_quantized_ggml)."""
    from tests.e2e.test_tensor_parallel import _generate, _prompts as tp_prompts, _rank_main

    cases = {"llama-Q4_1": files("llama", T.Q4_1), "gemma2-Q8_0": files("gemma2", T.Q8_0)}
    with mp.Manager() as manager:
        results = manager.dict()
        mp.spawn(_rank_main, args=(2, free_port(), {k: str(d) for k, (_, d) in cases.items()}, results),
                 nprocs=2, join=True)
        results = dict(results)
    for name, (path, _) in cases.items():
        hf = gguf_zoo.transformers_model(path)
        assert results[name][0] == [model_zoo.hf_greedy(hf, p, len(results[name][0][0])) for p in tp_prompts()]


# ---------------------------------------------------------------- config from metadata


_TRANSFORMERS_READS = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                       "num_key_value_heads", "rms_norm_eps", "max_position_embeddings", "vocab_size",
                       "tie_word_embeddings", "bos_token_id", "eos_token_id", "pad_token_id")


@pytest.mark.parametrize("arch", sorted(gguf_zoo.ARCHS))
def test_config_equals_transformers_where_it_reads_the_field(arch, files):
    from transformers import AutoConfig

    path, directory = files(arch, T.Q8_0)
    theirs = AutoConfig.from_pretrained(path.parent, gguf_file=path.name).to_dict()
    ours = hf_config(GGUFFile(path))
    for field in _TRANSFORMERS_READS:
        assert ours[field] == theirs[field], field
    rope = theirs["rope_parameters"]
    assert ours["rope_theta"] == (rope["full_attention"] if arch == "gemma3" else rope)["rope_theta"]
    assert load_config(directory).model_type == {"gemma3": "gemma3_text"}.get(arch, arch)


def test_config_follows_llama_cpp_where_transformers_does_not_read(files, tmp_path):
    """Head size from key_length, Gemma's query scale rule, soft-caps, RoPE scaling, the
    end-of-turn token among the stop ids."""
    path, _ = files("gemma2", T.Q8_0)
    cfg = hf_config(GGUFFile(path))
    assert (cfg["head_dim"], cfg["query_pre_attn_scalar"]) == (256, 256)
    assert (cfg["attn_logit_softcapping"], cfg["final_logit_softcapping"], cfg["sliding_window"]) == (50, 30, 24)
    scaled = gguf_zoo.write(tmp_path / "scaled.gguf", "llama", T.Q8_0, extra_metadata={
        "llama.rope.scaling.type": "linear", "llama.rope.scaling.factor": 4.0,
        "tokenizer.ggml.eot_token_id": 1})
    cfg = hf_config(GGUFFile(scaled))
    assert cfg["rope_scaling"] == {"rope_type": "linear", "factor": 4.0}
    assert cfg["eos_token_id"] == [4, 1]
    three = hf_config(GGUFFile(files("gemma3", T.Q8_0)[0]))
    assert (three["sliding_window_pattern"], three["rope_local_base_freq"], three["rope_theta"]) == (6, 1e4, 1e6)
    layers = load_config(files("gemma3", T.Q8_0)[1]).layers
    assert [layer.window for layer in layers] == [24] * 5 + [None]


# ---------------------------------------------------------------- bad files


_EDITS = {  # a tensor written wrong by the writer itself (only that is wrong)
    "unsupported-type": lambda n, t, d: (n, T.IQ4_NL if n == "blk.0.ffn_down.weight" else t, d),
    "shape": lambda n, t, d: (n, t, d[:64] if n == "blk.0.attn_k.weight" else d),
    "missing": lambda n, t, d: None if n == "blk.1.attn_v.weight" else (n, t, d),
    "unknown-name": lambda n, t, d: (n.replace("attn_v", "attn_v_extra") if n.startswith("blk.1.") else n, t, d),
}


def _bad(tmp_path, files, kind: str):
    """A file with one defect."""
    bad = tmp_path / f"{kind}.gguf"
    if kind in _EDITS:
        return gguf_zoo.write(bad, "llama", T.Q8_0, edit=_EDITS[kind])
    good, _ = files("llama", T.Q8_0)
    data = bytearray(good.read_bytes())
    if kind == "magic":
        data[:4] = b"GGML"
    elif kind == "truncated-data":
        data = data[:-1000]
    elif kind == "truncated-header":
        data = data[:200]
    elif kind == "unknown-type":
        at = _type_field(data, "blk.1.ffn_up.weight")
        data[at:at + 4] = (250).to_bytes(4, "little")
    bad.write_bytes(bytes(data))
    return bad


def _type_field(data: bytearray, name: str) -> int:
    """Where tensor ``name``'s ggml type id sits in the tensor table."""
    encoded = len(name).to_bytes(8, "little") + name.encode()
    at = data.index(encoded) + len(encoded)
    n_dims = int.from_bytes(data[at:at + 4], "little")
    return at + 4 + 8 * n_dims


BAD = {
    "magic": "not a GGUF file",
    "truncated-header": "truncated",
    "truncated-data": "truncated: tensor output.weight",
    "unknown-type": "tensor blk.1.ffn_up.weight has unknown ggml type id 250",
    "unsupported-type": "tensor blk.0.ffn_down.weight is IQ4_NL, which Candor does not load",
    "shape": "tensor blk.0.attn_k.weight has shape [64, 256], its metadata implies [128, 256]",
    "missing": "missing, first model.layers.1.self_attn.v_proj.weight",
    "unknown-name": "tensor blk.1.attn_v_extra.weight is not a parameter of the llama model",
}


@pytest.mark.parametrize("kind", sorted(BAD))
def test_a_bad_file_is_refused_in_one_line(kind, tmp_path, files):
    with pytest.raises(GGUFError) as err:
        GGUFCheckpoint.open(_bad(tmp_path, files, kind))
    assert BAD[kind] in str(err.value) and "\n" not in str(err.value)


@pytest.mark.parametrize("kind", ["truncated-data", "unsupported-type", "shape"])
def test_the_launcher_refuses_a_bad_file_before_any_process_starts(kind, tmp_path, files):
    bad = _bad(tmp_path, files, kind)
    proc = subprocess.run([sys.executable, str(REPO / "launch_cluster.py"), "serve", "--model", str(bad),
                           "--port", str(free_port())], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "CANDOR_GGUF_CACHE": str(tmp_path / "cache")})
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert proc.returncode != 0 and "Traceback" not in proc.stderr, proc.stderr
    assert len(lines) == 1 and lines[0].startswith("candor: cannot serve ") and BAD[kind] in lines[0], lines


# ---------------------------------------------------------------- the command line


def test_serve_takes_a_gguf_file_and_a_tokenizer_directory(files, tiny_model_dir, tmp_path):
    """``candor serve --model FILE.gguf --tokenizer DIR``: the launcher's topology serves
    the prepared directory under the file's name; its tokenizer files are DIR's."""
    from launcher.gguf_checkpoint import prepare_gguf_models
    from launch_cluster import serve_args_to_topology

    path, _ = files("llama", T.Q8_0)
    topology, _ = serve_args_to_topology(["--model", str(path), "--tokenizer", str(tiny_model_dir)])
    assert (topology.model.path, topology.model.tokenizer) == (str(path), str(tiny_model_dir))
    prepared = prepare_gguf_models(topology, {"CANDOR_GGUF_CACHE": str(tmp_path)}).model
    assert prepared.served_model_name == path.name.removesuffix(".gguf") and prepared.tokenizer is None
    directory = tmp_path / prepared.path.rsplit("/", 1)[1]
    assert (directory / "tokenizer.json").read_bytes() == (tiny_model_dir / "tokenizer.json").read_bytes()
    assert load_config(directory).num_layers == 2


def test_a_tokenizer_directory_is_refused_for_a_checkpoint_directory(tiny_model_dir):
    from launcher.gguf_checkpoint import prepare_gguf_models
    from launch_cluster import serve_args_to_topology

    topology, _ = serve_args_to_topology(["--model", str(tiny_model_dir), "--tokenizer", str(tiny_model_dir)])
    with pytest.raises(SystemExit, match="taken for a GGUF model only"):
        prepare_gguf_models(topology)
