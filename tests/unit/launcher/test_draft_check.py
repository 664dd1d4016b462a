"""The launcher's checks of a speculative draft model, before any process starts: each
refusal is one line naming the draft and what it clashes with; a draft with the target's
tokenizer passes."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from launch_cluster import serve_args_to_topology
from launcher.draft_check import check_draft_model
from launcher.tiny_model import build_tiny_model
from tests.support import model_zoo


@pytest.fixture(scope="module")
def target(tmp_path_factory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("target") / "model")


@pytest.fixture(scope="module")
def draft(target, tmp_path_factory) -> Path:
    return model_zoo.build_draft(tmp_path_factory.mktemp("draft") / "model", target)


def _check(target: Path, draft: Path | str, *flags: str) -> None:
    spec = json.dumps({"model": str(draft), "num_speculative_tokens": 3})
    topology, _ = serve_args_to_topology([str(target), "--speculative-config", spec, *flags],
                                         environ={})
    check_draft_model(topology)


def _refusal(target: Path, draft: Path | str, *flags: str) -> str:
    with pytest.raises(SystemExit) as exc:
        _check(target, draft, *flags)
    message = str(exc.value)
    assert "\n" not in message and message.startswith(f"candor: draft model {draft} "), message
    return message


def _variant(draft: Path, tmp_path: Path, name: str, config: dict | None = None,
             tokenizer_config: dict | None = None) -> Path:
    out = tmp_path / name
    shutil.copytree(draft, out)
    for file, change in (("config.json", config), ("tokenizer_config.json", tokenizer_config)):
        if change:
            data = json.loads((out / file).read_text())
            (out / file).write_text(json.dumps({**data, **change}))
    return out


def test_a_draft_with_the_targets_tokenizer_passes(target, draft):
    _check(target, draft)
    _check(target, target)  # the target itself: every draft kept
    _check(target, draft, "--tensor-parallel-size", "2")  # rank 0 proposes
    _check(target, draft, "--enable-lora")  # the base draft drafts for adapters too


def test_a_draft_that_is_not_a_servable_checkpoint_is_refused(target, draft, tmp_path):
    assert "no config.json there" in _refusal(target, tmp_path / "absent")
    odd = _variant(draft, tmp_path, "odd", {"architectures": ["OddForCausalLM"],
                                            "model_type": "odd"})
    assert "cannot serve it" in _refusal(target, odd)


def test_another_vocabulary_or_tokenizer_is_refused_naming_both(target, draft, tmp_path):
    small = _variant(draft, tmp_path, "vocab", {"vocab_size": 1024})
    assert f"vocab_size 1024, the target {target} has 2048" in _refusal(target, small)
    eos = _variant(draft, tmp_path, "eos", tokenizer_config={"eos_token": "<|end_of_text|>"})
    message = _refusal(target, eos)
    assert f"its tokenizer differs from the target's ({target}): eos_token" in message
    short = _variant(draft, tmp_path, "short", {"max_position_embeddings": 256})
    assert "its context is 256 tokens, the served one 2048" in _refusal(target, short)
    _check(target, short, "--max-model-len", "256")


@pytest.mark.parametrize("flags,why", [
    (("--prefill-replicas", "1", "--decode-replicas", "1"), "not with a prefill/decode split"),
])
def test_combinations_it_cannot_follow_are_refused(target, draft, flags, why):
    assert why in _refusal(target, draft, *flags)


def test_a_gguf_draft_gets_its_prepared_directory_and_passes(tmp_path):
    """As the target does: a GGUF file's directory (config, tokenizer from its metadata);
    the default SmolLM2 file as its own draft passes every check."""
    from launcher.default_model import default_gguf
    from launcher.gguf_checkpoint import prepare_gguf_models

    gguf = str(default_gguf())
    spec = json.dumps({"method": "draft_model", "model": gguf, "num_speculative_tokens": 2})
    topology, _ = serve_args_to_topology([gguf, "--speculative-config", spec], environ={})
    prepared = prepare_gguf_models(topology, {"CANDOR_GGUF_CACHE": str(tmp_path)})
    draft = prepared.engine.speculative_config.model
    assert draft == prepared.model.path and Path(draft, "config.json").is_file()
    assert draft.startswith(str(tmp_path))
    check_draft_model(prepared)


# ---------------------------------------------------------------------- eagle3 heads


@pytest.fixture(scope="module")
def head(target, tmp_path_factory) -> Path:
    return model_zoo.build_eagle3(tmp_path_factory.mktemp("head") / "h", target, aux_layers=[1, 2, 4])


def _check_head(target: Path, head: Path | str, *flags: str) -> None:
    spec = json.dumps({"method": "eagle3", "model": str(head), "num_speculative_tokens": 3})
    topology, _ = serve_args_to_topology([str(target), "--speculative-config", spec, *flags],
                                         environ={})
    check_draft_model(topology)


def _head_refusal(target: Path, head: Path, *flags: str) -> str:
    with pytest.raises(SystemExit) as exc:
        _check_head(target, head, *flags)
    message = str(exc.value)
    assert "\n" not in message, message
    return message


def test_an_eagle3_head_that_fits_passes(target, head):
    _check_head(target, head)
    _check_head(target, head, "--tensor-parallel-size", "2")  # rank 0 proposes


@pytest.mark.parametrize("build,why", [
    (dict(hidden_size=96), "hidden_size 96, the target's is 64"),
    (dict(target_hidden_size=128), "target_hidden_size 128, the target's hidden_size is 64"),
    (dict(drop=("fc.weight",)), "missing tensors: fc.weight"),
    (dict(drop=("midlayer.hidden_norm.weight", "d2t"), draft_vocab=100),
     "missing tensors: d2t, midlayer.hidden_norm.weight"),
    (dict(vocab_size=1024), "vocab_size 1024, the target's is 2048"),
    (dict(architectures=["LlamaForCausalLM"]), "names no EAGLE-3 head"),
    (dict(num_hidden_layers=2), "num_hidden_layers 2: one midlayer is served"),
    (dict(aux_layers=[1, 2, 7]), r"\[7\] outside the target's 0..4"),
    (dict(eagle_aux_hidden_state_layer_ids=[1, 2]), "fc.weight has shape [64, 192], [64, 128] expected"),
])
def test_an_eagle3_head_that_does_not_fit_is_refused_in_one_line(target, tmp_path, build, why):
    bad = model_zoo.build_eagle3(tmp_path / "bad", target, **build)
    message = _head_refusal(target, bad)
    assert message.startswith(f"candor: EAGLE-3 head {bad} (--speculative-config): "), message
    assert why in message or __import__("re").search(why, message), message


def test_an_eagle3_head_is_refused_where_a_draft_model_is(target, head, tmp_path):
    message = _head_refusal(target, head, "--prefill-replicas", "1", "--decode-replicas", "1")
    assert "not with a prefill/decode split" in message
    assert "no config.json there" in _head_refusal(target, tmp_path / "absent")
