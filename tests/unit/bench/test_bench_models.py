"""The GPU benchmark's checkpoints that can be built without a GPU."""

import json

from tokenizers import Tokenizer

from bench.models import LLAMA3_8B, build_llama3_8b_dummy
from tests.unit.gpu_worker.test_model_parity import tiny_dir  # noqa: F401  (pytest fixture)


def test_llama3_8b_dummy_checkpoint(tiny_dir, tmp_path):
    path = build_llama3_8b_dummy(tmp_path, tiny_dir)
    cfg = json.loads((path / "config.json").read_text())
    assert {k: cfg[k] for k in LLAMA3_8B} == LLAMA3_8B and cfg["torch_dtype"] == "bfloat16"
    wide = Tokenizer.from_file(str(path / "tokenizer.json"))
    tiny = Tokenizer.from_file(str(tiny_dir / "tokenizer.json"))
    assert wide.get_vocab_size() == 128256
    assert wide.decode([100000, 128255]) == " w100000 w128255"  # every sampled id is text
    text = "The quick brown fox jumps over the lazy dog."
    assert wide.encode(text).ids == tiny.encode(text).ids
    for token in ("<|begin_of_text|>", "</tool_call>"):  # special tokens keep their ids
        assert wide.token_to_id(token) == tiny.token_to_id(token)
    assert build_llama3_8b_dummy(tmp_path, tiny_dir) == path  # built once
