"""Tiny GGUF-style checkpoints: a zoo model's weights as raw GGML blocks (what a GGUF file
stores and its reader hands the layers), beside the same model dequantized to float32.

Types ``gguf.quants`` quantizes (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1) quantize the model's own
weights; the K-quants (which it only dequantizes) are random blocks with scales set so the
weights come out around the zoo's magnitude. Either way the float32 reference is
``gguf.quants.dequantize`` of exactly the blocks served.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import dequantize, quantize
from safetensors.torch import load_file, save_file

from gpu_worker.quantization.spec import GgmlSpec

K_QUANTS = ("Q4_K", "Q5_K", "Q6_K")


def blocks(type_name: str, weight: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """[rows, cols] float32 -> [rows, row bytes] uint8 blocks of ``type_name``."""
    qtype = GGMLQuantizationType[type_name]
    if type_name not in K_QUANTS:
        return quantize(weight.astype(np.float32), qtype)
    rows, cols = weight.shape
    block, nbytes = GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, (rows, cols // block, nbytes), dtype=np.uint8)
    std = float(weight.std())
    half = lambda v: np.full((rows, cols // block), v, np.float16).view(np.uint8).reshape(rows, -1, 2)  # noqa: E731
    if type_name == "Q6_K":  # w = d * scale * (q - 32), q uniform in 0..63, scale int8
        raw[..., 192:208] = rng.integers(1, 16, (rows, cols // block, 16), dtype=np.uint8)
        raw[..., 208:210] = half(std / (8 * 18))
    else:  # w = d * sc * q - dmin * m, sc and m 6-bit, q 4 or 5 bits
        levels = 31 if type_name == "Q5_K" else 15
        raw[..., 0:2] = half(std / (32 * levels / 2))
        raw[..., 2:4] = half(std * levels / 2 / (32 * levels / 2))
    return raw.reshape(rows, -1)


def quantize_checkpoint(src: Path, out: Path, reference: Path, type_of, seed: int = 0) -> GgmlSpec:
    """``src`` (an HF folder) -> ``out`` (its matrices as GGML blocks, under the same
    names) and ``reference`` (the blocks dequantized, float32). ``type_of(name, shape)``:
    the GGML type name for a tensor, or None to keep it float. Returns the spec the GGUF
    reader would build."""
    rng = np.random.default_rng(seed)
    tensors = load_file(str(src / "model.safetensors"))
    raw, deq, types = {}, {}, {}
    for name, t in tensors.items():
        type_name = type_of(name, tuple(t.shape)) if t.dim() == 2 else None
        if type_name is None:
            raw[name] = deq[name] = t.contiguous()
            continue
        b = blocks(type_name, t.numpy(), rng)
        raw[name] = torch.from_numpy(b)
        deq[name] = torch.from_numpy(dequantize(b, GGMLQuantizationType[type_name]).reshape(t.shape).copy())
        types[name] = type_name
    for folder, weights in ((out, raw), (reference, deq)):
        folder.mkdir(parents=True, exist_ok=True)
        for f in src.iterdir():
            if f.name != "model.safetensors" and f.is_file():
                shutil.copy(f, folder / f.name)
        save_file(weights, str(folder / "model.safetensors"))
    (out / "ggml_types.json").write_text(json.dumps(types))
    return GgmlSpec(types)
