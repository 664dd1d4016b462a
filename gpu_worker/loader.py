"""Fill a model from HF safetensors, or with seeded random weights.

The model is expected to be freshly materialised (e.g. built on the meta device then
``to_empty``), so every parameter must be written exactly once: missing or unknown
checkpoint tensors are errors rather than silently left uninitialised. Where a tensor
goes is the model class's business (``weight_pieces``: fused q/k/v, gate/up, stacked
experts, and under tensor parallelism this rank's slice, which is read straight from
the file with ``get_slice`` so a rank never reads more than its shard; see
``models/decoder.py``).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import nn

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


def load_weights(model: nn.Module, path: str | Path | None, load_format: str = "auto", *, seed: int = 0) -> None:
    """Load weights into ``model`` in place (see module docstring)."""
    if load_format == "dummy":
        _fill_dummy(model, seed)
        return
    if load_format not in LOAD_FORMATS:
        raise ValueError(f"unknown load_format {load_format!r} (expected one of {LOAD_FORMATS})")
    from safetensors import safe_open

    params = dict(model.named_parameters())
    # Elements written so far per parameter, so we can prove full coverage at the end.
    written: dict[str, int] = {name: 0 for name in params}
    unknown: list[str] = []
    files = safetensors_files(path)
    progress = Progress("loading weights", sum(f.stat().st_size for f in files))
    with torch.no_grad():
        for name, rows in model.padding_rows().items():
            params[name][-rows:].zero_()
            written[name] += params[name][-rows:].numel()
        for file in files:
            with safe_open(str(file), framework="pt", device="cpu") as f:
                for hf_name in f.keys():
                    pieces = model.weight_pieces(hf_name)
                    if pieces is None:
                        continue
                    for target, index, cut in pieces:
                        if target not in params:
                            unknown.append(hf_name)
                            continue
                        tensor = _read(f, hf_name, cut)
                        dst = params[target][index] if index else params[target]
                        if dst.shape != tensor.shape:
                            raise ValueError(f"{hf_name}: checkpoint shape {tuple(tensor.shape)} "
                                             f"(this rank's part) != {tuple(dst.shape)}")
                        dst.copy_(tensor)
                        written[target] += tensor.numel()
                        progress.advance(tensor.numel() * tensor.element_size())
    progress.finish()
    if unknown:
        raise ValueError(f"checkpoint tensors with no matching parameter: {unknown[:10]}")
    missing = [n for n, p in params.items() if written[n] != p.numel()]
    if missing:
        raise ValueError(f"parameters not (fully) loaded from checkpoint: {missing[:10]}")


def _read(f, name: str, cut: tuple[int, int, int] | None) -> torch.Tensor:
    """The whole tensor, or rows/columns ``start..start+size`` along ``dim`` only."""
    if cut is None:
        return f.get_tensor(name)
    dim, start, size = cut
    index = (slice(None),) * dim + (slice(start, start + size),)
    return f.get_slice(name)[index]


def _fill_dummy(model: nn.Module, seed: int) -> None:
    """Seeded random weights of the right shapes, without reading any file.

    Small normal weights keep activations finite in any dtype; norms are 1 as in a real
    checkpoint. Drawn on the parameter's device so large models stay fast on GPU.
    """
    with torch.no_grad():
        for name, p in sorted(model.named_parameters()):
            if "norm" in name:
                p.fill_(0.0 if model.config.norm == "rms_1p" or name.endswith(".bias") else 1.0)
            else:
                gen = torch.Generator(device=p.device).manual_seed(seed)
                seed += 1
                p.normal_(0.0, 0.02, generator=gen)
