"""Fill a model from HF safetensors or a GGUF file, or with seeded random weights.

The model is expected to be freshly materialised (e.g. built on the meta device then
``to_empty``), so every parameter must be written exactly once: missing or unknown
checkpoint tensors are errors rather than silently left uninitialised. Which parameter
a tensor feeds is the model's business (``checkpoint_target``: its architecture's
names); which part of the tensor this rank reads, and where in the parameter it goes,
is the owning layer's (``weight_loader``: fused q/k/v and gate/up, stacked experts,
this rank's shard), read straight from the file so a rank never reads more than its
shard (``models/weights.py``).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import torch
from torch import nn

from gpu_worker.gguf.prepared import gguf_file_of
from gpu_worker.models.weights import CheckpointTensor, copy_into
from gpu_worker.progress import Progress

LOAD_FORMATS = ("auto", "safetensors", "dummy")


def safetensors_files(path: str | Path) -> list[Path]:
    """Shards listed by model.safetensors.index.json, else every *.safetensors file."""
    path = Path(path)
    index = path / "model.safetensors.index.json"
    if index.exists():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [path / n for n in names]
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors files in {path}")
    return files


def checkpoint_files(path: str | Path) -> list[tuple[Callable[[], Any], int]]:
    """(open it, the bytes its tensors yield) for each file of the checkpoint: the
    safetensors shards, or the GGUF file a prepared directory points at (float tensors
    read as fp32, quantized ones as their blocks: ``gpu_worker.gguf.weights``)."""
    gguf = gguf_file_of(path)
    if gguf is not None:
        from gpu_worker.gguf.weights import GGUFWeights
        weights = GGUFWeights(gguf)
        return [(lambda: weights, weights.read_bytes)]
    from safetensors import safe_open
    return [(partial(safe_open, str(file), framework="pt", device="cpu"), file.stat().st_size)
            for file in safetensors_files(path)]


def load_weights(model: nn.Module, path: str | Path | None, load_format: str = "auto", *, seed: int = 0) -> None:
    """Load weights into ``model`` in place (see module docstring)."""
    if load_format == "dummy":
        _fill_dummy(model, seed)
        return
    if load_format not in LOAD_FORMATS:
        raise ValueError(f"unknown load_format {load_format!r} (expected one of {LOAD_FORMATS})")
    params = dict(model.named_parameters())
    owners = {name: model.get_submodule(name.rpartition(".")[0]) for name in params}
    # Elements written so far per parameter, so we can prove full coverage at the end.
    written: dict[str, int] = {name: 0 for name in params}
    unknown: list[str] = []
    sources = checkpoint_files(path)
    progress = Progress("loading weights", sum(size for _, size in sources))
    with torch.no_grad():
        for open_file, _ in sources:
            with open_file() as f:
                for hf_name in f.keys():
                    for target in _targets(model, hf_name):
                        if target is None:
                            continue
                        name, ids = target
                        name = _stored_name(model, name, ids)
                        if name is None:  # carried by the checkpoint, not stored (a quantized layer's metadata)
                            continue
                        if name not in params:
                            unknown.append(hf_name)
                            continue
                        source = CheckpointTensor(f, hf_name)
                        owner = owners[name]
                        if getattr(owner, "method", None) is not None:
                            source = owner.method.source(owner, name.rpartition(".")[2], ids, source)
                        written[name] += _load(owner, params[name], source, ids)
                        progress.advance(source.bytes_read)
    progress.finish()
    if unknown:
        raise ValueError(f"checkpoint tensors with no matching parameter: {unknown[:10]}")
    missing = [n for n, p in params.items() if written[n] != p.numel()]
    if missing:
        raise ValueError(f"parameters not (fully) loaded from checkpoint: {missing[:10]}")
    params.clear()  # (its references would keep the checkpoint's layout alive past finish)
    finish_methods(model)


def _targets(model: nn.Module, hf_name: str) -> list[tuple[str, tuple] | None]:
    """The parameters one checkpoint tensor feeds: one, unless the model reads it twice
    (``checkpoint_targets``: a score head made of the LM head's rows)."""
    several = getattr(model, "checkpoint_targets", None)
    return several(hf_name) if several is not None else [model.checkpoint_target(hf_name)]


def finish_methods(model: nn.Module) -> None:
    """Each quantized layer turns what its checkpoint stored into what its kernel reads."""
    for module in model.modules():
        method = getattr(module, "method", None)
        if method is not None:
            method.finish(module)


def _stored_name(model: nn.Module, name: str, ids: tuple) -> str | None:
    """The stored tensor a checkpoint tensor loads into: its layer's method may keep a
    part apart (GGUF's q, k, v of different types) or not store it at all (None)."""
    owner, _, attr = name.rpartition(".")
    try:
        method = getattr(model.get_submodule(owner), "method", None)
    except AttributeError:  # no such module: the caller names the tensor
        return name
    if method is None:
        return name
    stored = method.param_name(attr, ids)
    return None if stored is None else f"{owner}.{stored}"


def checkpoint_names(path: str | Path) -> list[str]:
    """Every tensor name of a safetensors checkpoint (headers only: no data is read)."""
    from safetensors import safe_open

    names = []
    for file in safetensors_files(path):
        with safe_open(str(file), framework="pt", device="cpu") as f:
            names += list(f.keys())
    return names


def _load(owner: nn.Module, param: nn.Parameter, source: CheckpointTensor, ids: tuple) -> int:
    """Its layer's ``weight_loader`` reads the part this rank holds; a plain module's
    parameter takes the whole tensor."""
    loader = getattr(owner, "weight_loader", None)
    if loader is not None:
        return loader(param, source, *ids)
    if ids:
        raise ValueError(f"{source.name}: a part {ids} of a layer that takes no parts")
    return copy_into(param, source)


def _fill_dummy(model: nn.Module, seed: int) -> None:
    """Seeded random weights of the right shapes, without reading any file.

    Small normal weights keep activations finite in any dtype; norms are 1 as in a real
    checkpoint. Drawn on the parameter's device so large models stay fast on GPU.
    """
    with torch.no_grad():
        for name, p in sorted(model.named_parameters()):
            if not p.is_floating_point():
                raise ValueError(f"load_format dummy: {name} is quantized ({p.dtype}); random "
                                 "weights are float only")
            if "norm" in name:
                p.fill_(0.0 if model.config.norm == "rms_1p" or name.endswith(".bias") else 1.0)
            else:
                gen = torch.Generator(device=p.device).manual_seed(seed)
                seed += 1
                p.normal_(0.0, 0.02, generator=gen)
