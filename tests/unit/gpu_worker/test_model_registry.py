"""Every registered architecture against HF transformers, at the runner level (fp32,
random perturbed weights, chunked prefill + continuous batching, prompts longer than the
sliding windows); config refusals; the one registry covers exactly what the zoo checks."""

from __future__ import annotations

import pytest
import torch

from gpu_worker.attention.torch_backend import TorchBackend
from gpu_worker.model_config import ARCHITECTURES, UnsupportedConfig, load_config, parse_config
from gpu_worker.model_runner import ModelRunner
from tests.support import model_zoo
from tests.unit.gpu_worker.test_model_parity import GREEDY, run_continuous

PROMPT_LENS = (1, 20, 70, 120)
NEW = 16


def _prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(1)
    return [torch.randint(6, model_zoo.VOCAB, (n,), generator=g).tolist() for n in PROMPT_LENS]


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    cache: dict[str, tuple] = {}

    def get(arch: str):
        if arch not in cache:
            path = model_zoo.build(arch, tmp_path_factory.mktemp(arch) / "model")
            hf = model_zoo.hf_model(path)
            cache[arch] = path, [model_zoo.hf_greedy(hf, p, NEW) for p in _prompts()]
        return cache[arch]

    return get


@pytest.mark.parametrize("arch", list(model_zoo.ARCHS))
def test_architecture_matches_hf(arch, built):
    path, want = built(arch)
    runner = ModelRunner(str(path), block_size=16, num_blocks=64)
    got = run_continuous(runner, _prompts(), [GREEDY] * len(PROMPT_LENS), new_tokens=NEW,
                         arrivals=[0, 1, 0, 2], chunk=32)
    assert got == want
    assert all(len(set(w)) >= 4 for w in want[1:])  # the random model is not degenerate


@pytest.mark.parametrize("arch", ["mistral-window", "gemma2", "starcoder2"])
def test_windowed_torch_decode_path_matches_hf(arch, built):
    """The same with decodes through the torch group path instead of the compiled kernel
    (small groups, so windows cut across group and block boundaries)."""
    path, want = built(arch)
    runner = ModelRunner(str(path), block_size=8, num_blocks=128, deterministic=False)
    runner.attn_backend = TorchBackend(runner.attn_spec, group_blocks=6)
    got = run_continuous(runner, _prompts(), [GREEDY] * len(PROMPT_LENS), new_tokens=NEW, chunk=19)
    assert got == want


def test_window_does_not_cut_the_context(built):
    path, _ = built("mistral-window")
    cfg = load_config(path)
    assert cfg.sliding_window == 24 and all(layer.window == 24 for layer in cfg.layers)
    runner = ModelRunner(str(path), num_blocks=64)
    assert runner.max_model_len == cfg.max_position_embeddings == 512


def test_per_layer_switches_are_read():
    base = dict(vocab_size=32, hidden_size=64, intermediate_size=32, num_hidden_layers=4,
                num_attention_heads=4, head_dim=16)
    gemma2 = parse_config({**base, "model_type": "gemma2", "sliding_window": 8, "query_pre_attn_scalar": 32,
                           "attn_logit_softcapping": 50.0, "final_logit_softcapping": 30.0})
    assert [layer.window for layer in gemma2.layers] == [8, None, 8, None]  # even layers slide
    assert gemma2.scale == 32**-0.5 and gemma2.attn_softcap == 50.0 and gemma2.norm == "rms_1p"
    gemma3 = parse_config({**base, "model_type": "gemma3_text", "sliding_window": 8, "rope_theta": 1e6,
                           "rope_local_base_freq": 1e4, "sliding_window_pattern": 2})
    assert [(layer.window, gemma3.ropes[layer.rope].theta) for layer in gemma3.layers] == \
        [(8, 1e4), (None, 1e6), (8, 1e4), (None, 1e6)]
    smol = parse_config({**base, "model_type": "smollm3", "no_rope_layers": [1, 1, 1, 0]})
    assert [layer.rope for layer in smol.layers] == [0, 0, 0, None]
    moe = parse_config({**base, "model_type": "qwen3_moe", "num_experts": 4, "num_experts_per_tok": 2,
                        "moe_intermediate_size": 8, "mlp_only_layers": [0], "decoder_sparse_step": 1})
    assert [layer.moe for layer in moe.layers] == [False, True, True, True]
    qwen2 = parse_config({**base, "model_type": "qwen2", "sliding_window": 8, "use_sliding_window": False})
    assert qwen2.sliding_window is None


@pytest.mark.parametrize("patch,field,value", [
    ({"model_type": "mamba"}, "model_type", "mamba"),
    ({"hidden_act": "relu2"}, "hidden_act", "relu2"),
    ({"rope_scaling": {"rope_type": "mrope"}}, "rope_type", "mrope"),
    ({"rope_scaling": {"rope_type": "default", "partial_rotary_factor": 0.5}}, "partial_rotary_factor", 0.5),
    ({"layer_types": ["chunked_attention"] * 2}, "layer_types", "chunked_attention"),
])
def test_unsupported_config_names_field_and_value(patch, field, value):
    cfg = {"model_type": "llama", "vocab_size": 32, "hidden_size": 64, "intermediate_size": 32,
           "num_hidden_layers": 2, "num_attention_heads": 4, **patch}
    with pytest.raises(UnsupportedConfig) as err:
        parse_config(cfg)
    msg = str(err.value)
    assert "\n" not in msg and field in msg and repr(value) in msg, msg


def test_every_registered_architecture_is_checked_against_hf():
    """One table registers each model_type (its config parsing and checkpoint names in
    one family module); the decoder zoo builds every decoder, so the parity tests above
    cover them, the encoder zoo every encoder (tests/unit/gpu_worker/test_encoder_parity.py)
    and the vision zoos LLaVA, Gemma 3, Qwen2-VL and Qwen2.5-VL."""
    import transformers

    from tests.support import encoder_zoo

    zoo = {getattr(transformers, cfg_cls).model_type for cfg_cls, _, _ in model_zoo.ARCHS.values()}
    zoo |= {getattr(transformers, arch[0]).model_type for arch in encoder_zoo.ARCHS.values()}
    zoo |= {"llava"}  # tests/support/vision_zoo.py (tests/unit/gpu_worker/test_llava.py)
    zoo |= {"gemma3"}  # tests/support/gemma3_vision_zoo.py (tests/unit/gpu_worker/test_gemma3_vision.py)
    zoo |= {"qwen2_vl", "qwen2_5_vl"}  # tests/support/qwen2_vl_zoo.py (tests/unit/gpu_worker/test_qwen2_vl.py)
    assert zoo == set(ARCHITECTURES)


def test_flashinfer_per_layer_window_and_softcap(built, monkeypatch):
    """Gemma 2 through the flashinfer backend (the CPU fake, which honours window_left and
    logits_soft_cap): one plan per layer kind, tokens equal HF's."""
    import sys

    from gpu_worker.attention import flashinfer_backend
    from tests.support import fake_flashinfer

    monkeypatch.setitem(sys.modules, "flashinfer", fake_flashinfer)
    monkeypatch.setattr(flashinfer_backend, "SUPPORTED_DTYPES", (torch.float32,))
    monkeypatch.setattr(flashinfer_backend, "SUPPORTED_HEAD_DIMS", (16,))
    path, want = built("gemma2")
    runner = ModelRunner(str(path), block_size=16, num_blocks=64)
    runner.attn_backend = flashinfer_backend.FlashInferBackend(runner.attn_spec)
    assert sorted(runner.attn_backend.kinds, key=repr) == sorted({(24, 2.0), (None, 2.0)}, key=repr)
    got = run_continuous(runner, _prompts(), [GREEDY] * len(PROMPT_LENS), new_tokens=NEW, chunk=32)
    assert got == want


@pytest.mark.parametrize("arch", ["phi3", "llama-yarn-gelu", "gemma3_text"])
def test_rope_tables_equal_hf_rotary(arch, built):
    """cos/sin per position equal HF's rotary module's, past longrope's original context
    too (HF's generate re-encodes the whole sequence there with the long factors, which
    a paged cache cannot; positions from there on get the long factors, as vLLM does)."""
    from gpu_worker.models.blocks import RotaryEmbedding

    path, _ = built(arch)
    cfg = load_config(path)
    hf = model_zoo.hf_model(path)
    rotary = hf.model.rotary_emb
    x = torch.zeros(1, 1, cfg.head_dim)
    kinds = sorted({layer.rope for layer in cfg.layers if layer.rope is not None})
    layer_types = sorted(set(getattr(hf.config, "layer_types", None) or [None]))
    for rope_index in kinds:
        ours = RotaryEmbedding(cfg.head_dim, cfg.ropes[rope_index], 512, "cpu", torch.float32,
                               cfg.max_position_embeddings)
        kwargs = {} if len(cfg.ropes) == 1 else {"layer_type": layer_types[rope_index]}
        for pos in (0, 7, 255, 256, 300, 511):
            cos, sin = rotary(x, torch.tensor([[pos]]), **kwargs)
            assert torch.equal(cos[0, 0], ours.cos[pos]) and torch.equal(sin[0, 0], ours.sin[pos]), (rope_index, pos)


def test_dtype_auto_follows_the_checkpoint_on_cuda_and_is_fp32_on_cpu(tmp_path):
    from cluster.checkpoint import resolve_dtype

    (tmp_path / "config.json").write_text('{"model_type": "llama", "torch_dtype": "bfloat16"}')
    assert resolve_dtype("auto", "cuda:0", str(tmp_path))[0] == "bfloat16"
    name, why = resolve_dtype("auto", "cpu", str(tmp_path))
    assert name == "float32" and "bfloat16" in why  # says what it did instead
    assert resolve_dtype("half", "cpu", str(tmp_path))[0] == "float16"
    assert resolve_dtype("float", "cuda", str(tmp_path))[0] == "float32"
    with pytest.raises(ValueError, match="choices"):
        resolve_dtype("fp8", "cpu", str(tmp_path))
