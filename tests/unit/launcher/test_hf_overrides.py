"""--hf-overrides (launcher/hf_overrides.py): the flag reaches the topology, the served
directory's config.json carries the overrides and links every other file, the served
name stays the checkpoint's, unread keys are named in one line and a conversion Candor
cannot make is refused in one line."""

from __future__ import annotations

import json
import os

import pytest

from cluster.pooling import UnsupportedPooling, read_pooling_config
from launch_cluster import serve_args_to_topology
from launcher.hf_overrides import HfOverridesError, apply, prepare, prepare_overridden_models
from tests.support.reranker_zoo import HF_OVERRIDES


def _checkpoint(tmp_path, **config):
    path = tmp_path / "Qwen3-Reranker-tiny"
    (path / "sub").mkdir(parents=True)
    base = {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "hidden_size": 8,
            "max_position_embeddings": 64, "text_config": {"a": 1, "b": 2}}
    (path / "config.json").write_text(json.dumps({**base, **config}))
    (path / "tokenizer.json").write_text("{}")
    (path / "sub" / "f").write_text("x")
    return path


def test_the_flag_reaches_the_topology(tmp_path):
    path = _checkpoint(tmp_path)
    topology, _ = serve_args_to_topology(["--model", str(path), "--runner", "pooling",
                                          "--hf-overrides", json.dumps(HF_OVERRIDES)])
    assert topology.model.hf_overrides == HF_OVERRIDES
    with pytest.raises(SystemExit):
        serve_args_to_topology(["--model", str(path), "--hf-overrides", "[1]"])


def test_a_served_directory_of_its_own_with_the_name_kept(tmp_path, monkeypatch, capsys):
    path = _checkpoint(tmp_path)
    monkeypatch.setenv("CANDOR_HF_OVERRIDES_CACHE", str(tmp_path / "cache"))
    topology, _ = serve_args_to_topology(["--model", str(path), "--runner", "pooling",
                                          "--hf-overrides", json.dumps(HF_OVERRIDES)])
    served = prepare_overridden_models(topology)
    directory = served.model.resolved_path()
    assert directory.startswith(str(tmp_path / "cache"))
    assert served.model.name() == "Qwen3-Reranker-tiny" and served.model.hf_overrides == {}
    config = json.loads(open(f"{directory}/config.json").read())
    assert config == {**json.loads((path / "config.json").read_text()), **HF_OVERRIDES}
    assert open(f"{directory}/sub/f").read() == "x"  # linked, not copied
    assert json.loads((path / "config.json").read_text())["architectures"] == ["Qwen3ForCausalLM"]
    pooling = read_pooling_config(directory)
    assert (pooling.task, pooling.dimension, pooling.labels) == ("classify", 1, ["yes"])
    line = [ln for ln in capsys.readouterr().err.splitlines() if "hf-overrides over" in ln]
    assert len(line) == 1 and "architectures [\"Qwen3ForCausalLM\"] -> " in line[0], line
    # a second start finds the same directory, brought up to date with the checkpoint
    (path / "tokenizer.json").unlink()
    (path / "new.txt").write_text("n")
    again = prepare_overridden_models(topology).model.resolved_path()
    assert again == directory
    assert open(f"{directory}/new.txt").read() == "n"
    assert "tokenizer.json" not in os.listdir(directory)


def test_keys_nothing_reads_are_named_in_one_line(tmp_path, monkeypatch, capsys):
    path = _checkpoint(tmp_path)
    monkeypatch.setenv("CANDOR_HF_OVERRIDES_CACHE", str(tmp_path / "cache"))
    topology, _ = serve_args_to_topology([
        "--model", str(path), "--hf-overrides",
        json.dumps({"max_position_embeddings": 32, "use_sep_token": True, "bogus": 1})])
    prepare_overridden_models(topology)
    err = capsys.readouterr().err.splitlines()
    unread = [ln for ln in err if "nothing reads them" in ln]
    assert len(unread) == 1 and "use_sep_token, bogus:" in unread[0], err
    assert "max_position_embeddings" not in unread[0]  # a field of this config.json


def test_sub_configs_merge_and_other_fields_are_replaced():
    config = {"text_config": {"a": 1, "b": 2}, "rope_scaling": {"type": "x", "factor": 2}}
    out = apply(config, {"text_config": {"b": 3}, "rope_scaling": {"type": "y"}})
    assert out == {"text_config": {"a": 1, "b": 3}, "rope_scaling": {"type": "y"}}
    assert config["text_config"] == {"a": 1, "b": 2}


@pytest.mark.parametrize("overrides, says", [
    ({**HF_OVERRIDES, "classifier_from_token": ["no", "maybe", "yes"]}, "reads two tokens"),
    ({"classifier_from_token": ["no", "yes"], "is_original_qwen3_reranker": True},
     "ForSequenceClassification architecture"),
    ({**HF_OVERRIDES, "is_original_qwen3_reranker": False}, "needs is_original_qwen3_reranker"),
    ({**HF_OVERRIDES, "method": "from_3_way"}, "scores by from_2_way_softmax"),
    ({"architectures": ["Qwen3ForSequenceClassification"], "is_original_qwen3_reranker": True},
     "need classifier_from_token"),
])
def test_a_conversion_candor_cannot_make_is_refused_in_one_line(tmp_path, overrides, says):
    path = _checkpoint(tmp_path)
    with pytest.raises(HfOverridesError, match=says):
        prepare(str(path), overrides, {"CANDOR_HF_OVERRIDES_CACHE": str(tmp_path / "c")})
    topology, _ = serve_args_to_topology(["--model", str(path), "--runner", "pooling",
                                          "--hf-overrides", json.dumps(overrides)])
    with pytest.raises(SystemExit) as exc:
        prepare_overridden_models(topology, {"CANDOR_HF_OVERRIDES_CACHE": str(tmp_path / "c")})
    assert "\n" not in str(exc.value) and says in str(exc.value)


def test_token_classifier_keys_written_into_config_json_itself_are_checked_too(tmp_path):
    path = _checkpoint(tmp_path, **{**HF_OVERRIDES, "classifier_from_token": ["yes"]})
    with pytest.raises(UnsupportedPooling, match="reads two tokens"):
        read_pooling_config(str(path))


def test_tokens_outside_the_vocabulary_are_refused_before_the_workers_start(tmp_path, tiny_model_dir):
    from gpu_worker.model_config import UnsupportedConfig, load_config
    from tests.support import model_zoo

    lm = model_zoo.build("qwen3", tmp_path / "lm", tiny_model_dir)  # no "yes" / "no" tokens
    served, _ = prepare(str(lm), HF_OVERRIDES, {"CANDOR_HF_OVERRIDES_CACHE": str(tmp_path / "c")})
    with pytest.raises(UnsupportedConfig, match=r"\['no', 'yes'\] are not tokens"):
        load_config(served)
