"""``--hf-overrides`` (vLLM's flag, a JSON object; ``model.hf_overrides`` in a topology):
fields laid over the checkpoint's config.json before any role reads it.

Every role reads the model directory itself (the frontend its pooling, the tokenizer
worker its context and prompt format, the gpu_worker its architecture and weights), so
before any process starts the launcher gives an overridden model a directory of its own,
under ``~/.cache/candor/hf-overrides/`` (``CANDOR_HF_OVERRIDES_CACHE``): config.json with
the overrides applied, and a symbolic link to each other file of the checkpoint (nothing
is copied). The roles then read one config and agree on it, as with a GGUF file's
prepared directory (``launcher.gguf_checkpoint``); the model keeps the served name of the
directory it came from.

As vLLM: a key replaces config.json's field, except an object laid over an object that
is a sub-config (``text_config``, ``*_config``), which is merged key by key. The main use
is serving a decoder yes/no reranker as published (Qwen3-Reranker: ``cluster.
token_classifier``). At start one line says what changed, and one line names the keys
that are neither fields of this config.json nor keys Candor acts on (they are written
as given and nothing reads them); a token-classifier conversion Candor cannot make is
refused in one line.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

import msgspec

from cluster.token_classifier import TokenClassifierError, read_token_classifier
from cluster.topology import ModelSpec, Topology
from launcher.supervisor import say

# keys Candor acts on that a checkpoint's config.json often lacks
ACTED_ON = ("architectures", "classifier_from_token", "is_original_qwen3_reranker", "method",
            "num_labels", "id2label", "matryoshka_dimensions", "is_matryoshka")


class HfOverridesError(ValueError):
    """Overrides that cannot be applied (the message is one line)."""


def parse(text: str) -> dict[str, Any]:
    """The flag's JSON object (argparse calls it: a bad value is a usage error)."""
    import argparse

    try:
        value = json.loads(text)
    except ValueError as err:
        raise argparse.ArgumentTypeError(f"not JSON: {err}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError("expected a JSON object of config.json fields")
    return value


def apply(config: dict[str, Any], overrides: dict[str, Any]) -> dict[str, Any]:
    """``config`` with ``overrides`` laid over it (a copy)."""
    out = dict(config)
    for key, value in overrides.items():
        old = out.get(key)
        if isinstance(value, dict) and isinstance(old, dict) and key.endswith("_config"):
            out[key] = {**old, **value}
        else:
            out[key] = value
    return out


def unread_keys(config: dict[str, Any], overrides: dict[str, Any]) -> list[str]:
    """Keys that are not fields of ``config`` (the checkpoint's own) nor keys Candor acts
    on: nothing will read them."""
    return [k for k in overrides if k not in config and k not in ACTED_ON]


def cache_root(environ: dict[str, str] | None = None) -> Path:
    env = os.environ if environ is None else environ
    if env.get("CANDOR_HF_OVERRIDES_CACHE"):
        return Path(os.path.expanduser(env["CANDOR_HF_OVERRIDES_CACHE"]))
    base = env.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache")
    return Path(base) / "candor" / "hf-overrides"


def prepare(source: str, overrides: dict[str, Any], environ: dict[str, str] | None = None
            ) -> tuple[Path, dict[str, Any]]:
    """(the overridden directory of checkpoint ``source``, its original config.json),
    made or brought up to date now."""
    source = os.path.abspath(source)
    try:
        with open(os.path.join(source, "config.json"), encoding="utf-8") as fh:
            original = json.load(fh)
    except (OSError, ValueError) as err:
        raise HfOverridesError(f"cannot read {source}/config.json: {err}") from None
    merged = apply(original, overrides)
    try:
        read_token_classifier(merged)
    except TokenClassifierError as err:
        raise HfOverridesError(str(err)) from None
    identity = json.dumps([source, overrides], sort_keys=True)
    directory = cache_root(environ) / (f"{os.path.basename(source.rstrip('/'))}-"
                                       f"{hashlib.sha256(identity.encode()).hexdigest()[:16]}")
    directory.mkdir(parents=True, exist_ok=True)
    _link_files(Path(source), directory)
    text = json.dumps(merged, indent=2, sort_keys=True) + "\n"
    config_path = directory / "config.json"
    if not config_path.is_file() or config_path.read_text() != text:
        partial = directory / f".config.json.{os.getpid()}"
        partial.write_text(text)
        os.replace(partial, config_path)
    return directory, original


def _link_files(source: Path, directory: Path) -> None:
    """A link to every entry of ``source`` but config.json; links whose entry is gone
    are removed (the checkpoint may have changed since the last start)."""
    names = {p.name for p in source.iterdir() if p.name != "config.json"}
    for name in names:
        link, target = directory / name, source / name
        if link.is_symlink() and os.readlink(link) == str(target):
            continue
        partial = directory / f".{name}.{os.getpid()}"
        if partial.is_symlink():
            partial.unlink()
        partial.symlink_to(target)
        os.replace(partial, link)
    for link in directory.iterdir():
        if link.is_symlink() and link.name not in names and not link.name.startswith("."):
            link.unlink()


def _describe(original: dict[str, Any], overrides: dict[str, Any]) -> str:
    parts = []
    for key, value in overrides.items():
        new = json.dumps(value)
        parts.append(f"{key} {json.dumps(original[key])} -> {new}" if key in original
                     else f"{key} = {new}")
    return "; ".join(parts)


def prepare_overridden_models(topology: Topology, environ: dict[str, str] | None = None
                              ) -> Topology:
    """The topology with each overridden model's path replaced by its prepared directory
    (and its served name kept). A refusal exits in one line."""
    model = _prepared_spec(topology.model, "model", environ)
    models = [msgspec.structs.replace(served, model=_prepared_spec(served.model, f"models[{i}].model", environ))
              for i, served in enumerate(topology.models)]
    return msgspec.structs.replace(topology, model=model, models=models)


def _prepared_spec(spec: ModelSpec, label: str, environ: dict[str, str] | None) -> ModelSpec:
    if not spec.hf_overrides:
        return spec
    path = spec.resolved_path()
    if not os.path.isdir(path):
        return spec  # another node holds the checkpoint; its launcher prepares it there
    if not os.path.isfile(os.path.join(path, "config.json")):
        raise SystemExit(f"candor: {label}.hf_overrides (--hf-overrides) needs a checkpoint "
                         f"directory with a config.json; {path} has none")
    try:
        directory, original = prepare(path, spec.hf_overrides, environ)
    except HfOverridesError as err:
        raise SystemExit(f"candor: cannot apply {label}.hf_overrides (--hf-overrides) to "
                         f"{path}: {err}") from None
    name = spec.names()
    say(f"{name[0]!r}: hf-overrides over {path}/config.json: "
        f"{_describe(original, spec.hf_overrides)} (served from {directory})")
    unread = unread_keys(original, spec.hf_overrides)
    if unread:
        say(f"{name[0]!r}: hf-overrides {', '.join(unread)}: not fields of this config.json "
            f"and not keys Candor acts on ({', '.join(ACTED_ON)}); nothing reads them")
    return msgspec.structs.replace(spec, path=str(directory), hf_overrides={},
                                   served_model_name=name if len(name) > 1 else name[0])
