"""Fill a ``llama.LlamaForCausalLM`` from HF safetensors, or with seeded random weights.

The model is expected to be freshly materialised (e.g. built on the meta device then
``to_empty``), so every parameter must be written exactly once: missing or unknown
checkpoint tensors are errors rather than silently left uninitialised.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import nn

# HF name fragment -> (our fused parameter fragment, shard index within it)
_FUSED = {
    "self_attn.q_proj.": ("self_attn.qkv_proj.", 0),
    "self_attn.k_proj.": ("self_attn.qkv_proj.", 1),
    "self_attn.v_proj.": ("self_attn.qkv_proj.", 2),
    "mlp.gate_proj.": ("mlp.gate_up_proj.", 0),
    "mlp.up_proj.": ("mlp.gate_up_proj.", 1),
}
# Checkpoint tensors that carry no weights we use.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)

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


def _shard_sizes(model: nn.Module, fused_name: str) -> list[int]:
    cfg = model.config
    if "qkv_proj" in fused_name:
        return [cfg.q_size, cfg.kv_size, cfg.kv_size]
    return [cfg.intermediate_size, cfg.intermediate_size]


def load_weights(model: nn.Module, path: str | Path | None, load_format: str = "auto", *, seed: int = 0) -> None:
    """Load weights into ``model`` in place (see module docstring)."""
    if load_format == "dummy":
        _fill_dummy(model, seed)
        return
    if load_format not in LOAD_FORMATS:
        raise ValueError(f"unknown load_format {load_format!r} (expected one of {LOAD_FORMATS})")
    from safetensors import safe_open

    params = dict(model.named_parameters())
    # Rows written so far per parameter, so we can prove full coverage at the end.
    written: dict[str, int] = {name: 0 for name in params}
    tied = model.config.tie_word_embeddings
    unknown: list[str] = []
    with torch.no_grad():
        for file in safetensors_files(path):
            with safe_open(str(file), framework="pt", device="cpu") as f:
                for hf_name in f.keys():
                    if hf_name.endswith(_IGNORED_SUFFIXES) or (tied and hf_name == "lm_head.weight"):
                        continue
                    target, rows = _map_name(model, hf_name)
                    if target not in params:
                        unknown.append(hf_name)
                        continue
                    tensor = f.get_tensor(hf_name)
                    dst = params[target] if rows is None else params[target][rows[0] : rows[1]]
                    if dst.shape != tensor.shape:
                        raise ValueError(f"{hf_name}: checkpoint shape {tuple(tensor.shape)} != {tuple(dst.shape)}")
                    dst.copy_(tensor)
                    written[target] += tensor.shape[0]
    if unknown:
        raise ValueError(f"checkpoint tensors with no matching parameter: {unknown[:10]}")
    missing = [n for n, p in params.items() if written[n] != p.shape[0]]
    if missing:
        raise ValueError(f"parameters not (fully) loaded from checkpoint: {missing[:10]}")


def _map_name(model: nn.Module, hf_name: str) -> tuple[str, tuple[int, int] | None]:
    """HF tensor name -> (our parameter name, row range inside a fused parameter or None)."""
    for frag, (fused, shard) in _FUSED.items():
        if frag in hf_name:
            name = hf_name.replace(frag, fused)
            sizes = _shard_sizes(model, fused)
            start = sum(sizes[:shard])
            return name, (start, start + sizes[shard])
    return hf_name, None


def _fill_dummy(model: nn.Module, seed: int) -> None:
    """Seeded random weights of the right shapes, without reading any file.

    Small normal weights keep activations finite in any dtype; norms are 1 as in a real
    checkpoint. Drawn on the parameter's device so large models stay fast on GPU.
    """
    with torch.no_grad():
        for name, p in sorted(model.named_parameters()):
            if "norm" in name:
                p.fill_(1.0)
            else:
                gen = torch.Generator(device=p.device).manual_seed(seed)
                seed += 1
                p.normal_(0.0, 0.02, generator=gen)
