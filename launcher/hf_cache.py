"""Turn ``candor serve MODEL`` into a checkpoint directory, as ``vllm serve`` users expect:
a local directory as is, otherwise a Hugging Face repo id looked up in the local hub cache
(``models--org--name/snapshots/<rev>``, ``refs/<revision>``), offline. Nothing is
downloaded: a missing model is an error that names the directory searched and how to fill it.
"""

from __future__ import annotations

import os
import re

import msgspec

_REPO_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*(/[A-Za-z0-9][A-Za-z0-9._-]*)?$")


class ModelNotFound(Exception):
    """The model is neither a directory nor a repo id present in the local hub cache."""


class ResolvedModel(msgspec.Struct, frozen=True):
    path: str  # the checkpoint directory
    repo_id: str | None = None  # set when it came from the hub cache
    revision: str | None = None  # the snapshot's commit hash


def hub_cache_dir(environ: dict[str, str] | None = None) -> str:
    """The hub cache huggingface_hub itself uses: HF_HUB_CACHE, else HF_HOME/hub, else
    XDG_CACHE_HOME/huggingface/hub (read now, not at import, so tests and launchers can
    point it elsewhere)."""
    env = os.environ if environ is None else environ
    if env.get("HF_HUB_CACHE"):
        return os.path.expanduser(env["HF_HUB_CACHE"])
    if env.get("HUGGINGFACE_HUB_CACHE"):
        return os.path.expanduser(env["HUGGINGFACE_HUB_CACHE"])
    home = env.get("HF_HOME") or os.path.join(
        env.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "huggingface")
    return os.path.join(os.path.expanduser(home), "hub")


def resolve_model(model: str, revision: str | None = None,
                  environ: dict[str, str] | None = None) -> ResolvedModel:
    expanded = os.path.expanduser(model)
    if os.path.isdir(expanded) or (os.path.isfile(expanded) and expanded.endswith(".gguf")):
        return ResolvedModel(os.path.abspath(expanded))  # (a GGUF file: launcher.gguf_checkpoint)
    cache = hub_cache_dir(environ)
    if not _REPO_ID.match(model) or "/" not in model:
        raise ModelNotFound(
            f"{model!r} is not a directory, nor a Hugging Face repo id (org/name) to look "
            f"up in the hub cache {cache}")
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    try:
        path = snapshot_download(model, revision=revision, cache_dir=cache,
                                 local_files_only=True)
    except (LocalEntryNotFoundError, FileNotFoundError, OSError) as err:
        where = os.path.join(cache, "models--" + model.replace("/", "--"))
        raise ModelNotFound(
            f"{model!r} (revision {revision or 'main'}) is not in the local Hugging Face "
            f"cache: looked in {where} (hub cache {cache}, from HF_HUB_CACHE / HF_HOME). "
            f"Candor does not download; fetch it first (`hf download {model}`) or pass a "
            f"checkpoint directory ({type(err).__name__})") from None
    if not os.path.isfile(os.path.join(path, "config.json")):
        raise ModelNotFound(f"the cached snapshot {path} of {model!r} has no config.json")
    return ResolvedModel(path, model, os.path.basename(path.rstrip("/")))
