"""The tiny checkpoint builder: determinism, HF loadability, tokenizer and chat template."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from gpu_worker.model_config import load_config, parse_config
from launcher.tiny_model import SPECIAL_TOKENS, TOOL_TOKENS, build_tiny_model

REPO = Path(__file__).resolve().parents[3]


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory) -> Path:
    t0 = time.perf_counter()
    path = build_tiny_model(tmp_path_factory.mktemp("tiny") / "model")
    print(f"tiny model built in {time.perf_counter() - t0:.2f}s")
    return path


@pytest.fixture(scope="module")
def tokenizer(tiny_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_dir)


def _digests(path: Path) -> dict[str, str]:
    return {f.name: hashlib.sha256(f.read_bytes()).hexdigest() for f in sorted(path.iterdir())}


def test_build_is_byte_identical(tiny_dir, tmp_path):
    # Second build in a fresh process: also catches per-process hash-seed effects.
    other = tmp_path / "again"
    code = f"from launcher.tiny_model import build_tiny_model; build_tiny_model({str(other)!r})"
    subprocess.run([sys.executable, "-c", code], cwd=REPO, check=True, capture_output=True)
    a, b = _digests(tiny_dir), _digests(other)
    assert set(a) >= {"config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
                      "tokenizer_config.json", "chat_template.jinja"}
    assert a == b


def test_refuses_to_overwrite(tiny_dir, tmp_path):
    with pytest.raises(FileExistsError):
        build_tiny_model(tiny_dir)
    target = tmp_path / "m"
    target.mkdir()
    (target / "stale.txt").write_text("x")
    build_tiny_model(target, overwrite=True)
    assert not (target / "stale.txt").exists()
    assert _digests(target) == _digests(tiny_dir)


def test_hf_config_and_generation_config(tiny_dir):
    from transformers import AutoConfig

    cfg = AutoConfig.from_pretrained(tiny_dir)
    assert cfg.model_type == "llama" and cfg.tie_word_embeddings
    assert (cfg.hidden_size, cfg.num_hidden_layers, cfg.num_attention_heads, cfg.num_key_value_heads) == (64, 4, 4, 2)
    assert cfg.head_dim == 16 and cfg.vocab_size == 2048
    assert cfg.rope_parameters["rope_type"] == "llama3"
    gen = json.loads((tiny_dir / "generation_config.json").read_text())
    assert gen["eos_token_id"] == cfg.eos_token_id == [4, 1]

    ours = load_config(tiny_dir)
    assert ours.rope.type == "llama3" and ours.rope.factor == 8.0
    assert ours.rope.original_max_position_embeddings == 512
    assert ours.eos_token_ids == [4, 1] and ours.bos_token_id == 0
    assert not ours.qkv_bias and ours.tie_word_embeddings


def test_tokenizer_specials_and_roundtrip(tokenizer):
    assert len(tokenizer) == 2048
    assert tokenizer.bos_token == "<|begin_of_text|>" and tokenizer.eos_token == "<|eot_id|>"
    assert tokenizer.pad_token == "<|pad|>"
    for tok in SPECIAL_TOKENS + TOOL_TOKENS:
        assert len(tokenizer.encode(tok, add_special_tokens=False)) == 1, tok
    text = 'Hello, wörld! café 中文 😀 — x² ≈ 3.14\n\tdef f(x): return {"a": [1, 2]}'
    ids = tokenizer.encode(text)
    assert ids[0] == tokenizer.bos_token_id and ids.count(tokenizer.bos_token_id) == 1
    assert tokenizer.decode(ids, skip_special_tokens=True) == text
    # Tool tags are single tokens that survive skip_special_tokens (a parser needs them).
    call = '<tool_call>{"name": "f", "arguments": {}}</tool_call><|eot_id|>'
    ids = tokenizer.encode(call, add_special_tokens=False)
    assert tokenizer.decode(ids, skip_special_tokens=True) == call.replace("<|eot_id|>", "")


def test_chat_template_basic(tokenizer):
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi!"}]
    s = tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    assert s == (
        "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nBe brief.<|eot_id|>"
        "<|start_header_id|>user<|end_header_id|>\n\nHi!<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\n"
    )
    s = tokenizer.apply_chat_template(msgs[1:], tokenize=False, add_generation_prompt=False)
    assert s == "<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\nHi!<|eot_id|>"
    ids = tokenizer.apply_chat_template(msgs, tokenize=True, add_generation_prompt=True)
    ids = ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids
    assert ids.count(tokenizer.bos_token_id) == 1 and ids[0] == tokenizer.bos_token_id


def test_chat_template_tools(tokenizer):
    tools = [{"type": "function", "function": {"name": "get_weather", "description": "Weather.",
              "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]
    msgs = [
        {"role": "user", "content": [{"type": "text", "text": "Weather in "}, {"type": "text", "text": "Zürich?"}]},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Zürich"}'}},
            {"id": "c2", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Bern"}}},
        ]},
        {"role": "tool", "tool_call_id": "c1", "content": '{"t": 17}'},
    ]
    s = tokenizer.apply_chat_template(msgs, tools=tools, tokenize=False, add_generation_prompt=True)
    assert s.startswith("<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\n")
    assert json.dumps(tools[0], ensure_ascii=False) in s
    assert "<|start_header_id|>user<|end_header_id|>\n\nWeather in Zürich?<|eot_id|>" in s
    assert ('<|start_header_id|>assistant<|end_header_id|>\n\n'
            '<tool_call>{"name": "get_weather", "arguments": {"city": "Zürich"}}</tool_call>'
            '<tool_call>{"name": "get_weather", "arguments": {"city": "Bern"}}</tool_call><|eot_id|>') in s
    assert s.endswith('<|start_header_id|>tool<|end_header_id|>\n\n{"t": 17}<|eot_id|>'
                      "<|start_header_id|>assistant<|end_header_id|>\n\n")
    # A system message and tools share one system block.
    s = tokenizer.apply_chat_template([{"role": "system", "content": "Sys."}] + msgs[:1], tools=tools, tokenize=False)
    assert s.count("<|start_header_id|>system") == 1 and "\n\nSys.\n\nYou can call these tools" in s


def test_parse_config_variants():
    base = dict(vocab_size=100, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4)
    # transformers 4 layout, no kv heads / head_dim given.
    c = parse_config({**base, "model_type": "llama", "rope_theta": 500000.0,
                      "rope_scaling": {"type": "linear", "factor": 2.0}, "eos_token_id": 7})
    assert (c.num_kv_heads, c.head_dim, c.rope.type, c.rope.theta, c.eos_token_ids) == (4, 16, "linear", 500000.0, [7])
    assert not c.tie_word_embeddings
    c = parse_config({**base, "model_type": "qwen2", "sliding_window": 4096, "use_sliding_window": False},
                     {"eos_token_id": [3, 4]})
    assert c.qkv_bias and not c.o_bias and c.sliding_window is None and c.eos_token_ids == [3, 4]
    c = parse_config({**base, "model_type": "llama", "attention_bias": True, "rope_scaling": None})
    assert c.qkv_bias and c.o_bias and c.rope.type == "default"
    with pytest.raises(ValueError):
        parse_config({**base, "model_type": "llama", "rope_scaling": {"rope_type": "mrope", "factor": 4.0}})
    with pytest.raises(ValueError):
        parse_config({**base, "model_type": "gpt2"})
