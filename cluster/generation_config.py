"""Sampling defaults from a checkpoint's generation_config.json (vLLM's
``--generation-config``): model authors publish the temperature/top_p/top_k their model
was tuned for, and vLLM applies them to requests that omit those fields. Read with the
standard library only (the launcher resolves them once; every frontend applies them)."""

from __future__ import annotations

import json
import os

import msgspec

from cluster.topology import SAMPLING_DEFAULT_FIELDS, SamplingDefaults


class GenerationConfigError(Exception):
    """The named generation config cannot be read."""


def sampling_defaults(mode: str, model_path: str) -> SamplingDefaults:
    """auto: ``model_path``'s file (absent file: no defaults); vllm/none: no defaults;
    anything else: a directory that must hold generation_config.json."""
    if mode in ("vllm", "none"):
        return SamplingDefaults(source=f"--generation-config {mode}")
    directory = model_path if mode == "auto" else os.path.expanduser(mode)
    path = os.path.join(directory, "generation_config.json")
    if not os.path.isfile(path):
        if mode == "auto":
            return SamplingDefaults(source="checkpoint (no generation_config.json)")
        raise GenerationConfigError(f"--generation-config {mode}: no generation_config.json "
                                    f"in {directory}")
    try:
        with open(path, encoding="utf-8") as fh:
            raw = json.load(fh)
    except (OSError, ValueError) as err:
        raise GenerationConfigError(f"cannot read {path}: {err}") from None
    found = {k: raw[k] for k in SAMPLING_DEFAULT_FIELDS if raw.get(k) is not None}
    if found.get("top_k") == 0:  # HF's "no top-k"
        found["top_k"] = -1
    source = "checkpoint generation_config.json" if mode == "auto" else path
    try:
        return msgspec.convert({**found, "source": source}, SamplingDefaults)
    except msgspec.ValidationError as err:
        raise GenerationConfigError(f"{path}: {err}") from None
