"""A GGUF file checked against its own metadata, as HF-named tensors of raw blocks.

``GGUFCheckpoint.open`` refuses, in one line naming the tensor, whatever the decoder
could not load exactly: a ggml type outside ``SUPPORTED_TYPES``, a tensor no HF
parameter of the architecture matches, a shape the metadata contradicts, a tensor the
config needs that is missing. What it yields, one ``GGUFTensor`` per HF tensor, is the
contract with the weight loaders: GGUF name, HF name, ggml type, logical shape (HF's
[out_features, in_features]) and the raw blocks, one row per output feature in HF's row
order; ``dequant.dequantize_fp32`` turns them into floats, a quantized linear method may
keep them as they are.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec
import numpy as np
from gguf.constants import GGMLQuantizationType as T

from gpu_worker.gguf import names
from gpu_worker.gguf.config import hf_config
from gpu_worker.gguf.reader import GGUFError, GGUFFile, TensorInfo
from gpu_worker.model_config import ModelConfig, UnsupportedConfig, parse_config
from gpu_worker.quantization.spec import GGML_TYPES, GgmlSpec

SUPPORTED_TYPES = (T.F32, T.F16, T.BF16, T.Q8_0, T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q4_K, T.Q5_K, T.Q6_K)


@dataclass(frozen=True)
class GGUFTensor:
    """One tensor: ``rows`` are its blocks as stored, [out_features, row_bytes] uint8, in
    HF's row order (a view of the mapped file; llama q/k rows are gathered into HF's
    order, a copy). ``value_offset`` is added to every dequantized value (Gemma's norms
    are stored as ``1 + w``)."""

    gguf_name: str
    hf_name: str
    ggml_type: T
    shape: tuple[int, ...]
    value_offset: float
    info: TensorInfo = field(repr=False)
    file: GGUFFile = field(repr=False)
    order: np.ndarray | None = field(default=None, repr=False)

    @property
    def rows(self) -> np.ndarray:
        raw = self.file.raw(self.info)
        return raw if self.order is None else raw[self.order]

    @property
    def n_bytes(self) -> int:
        return self.info.n_bytes


@dataclass(frozen=True)
class GGUFCheckpoint:
    path: Path
    file: GGUFFile
    config: dict[str, Any]  # config.json, as llama.cpp reads the metadata (gguf.config), and
    # the quantized tensors' types (``quantization_config``, quant_method "gguf")
    model_config: ModelConfig
    tensors: dict[str, GGUFTensor]  # by HF name, in file order

    @classmethod
    def open(cls, path: str | Path) -> GGUFCheckpoint:
        f = GGUFFile(path)
        config = hf_config(f)
        try:
            model_config = parse_config(config)
        except UnsupportedConfig as err:
            raise GGUFError(f"{f.path}: {err}".replace("config.json: ", "metadata as config: ")) from None
        tensors = _checked(f, model_config)
        types = {hf: t.ggml_type.name for hf, t in tensors.items() if t.ggml_type.name in GGML_TYPES}
        if types:  # the blocks stay quantized in the worker (gpu_worker.quantization.ggml)
            config = {**config, "quantization_config": {"quant_method": "gguf", "tensor_types": types}}
            model_config = msgspec.structs.replace(model_config, quantization=GgmlSpec(types))
        return cls(f.path, f, config, model_config, tensors)


def _checked(f: GGUFFile, cfg: ModelConfig) -> dict[str, GGUFTensor]:
    arch = f.get("general.architecture")
    for info in f.tensors.values():  # the type first: it is what an unsupported file differs in
        if info.ggml_type not in SUPPORTED_TYPES:
            raise GGUFError(f"{f.path}: tensor {info.name} is {info.ggml_type.name}, which Candor does not "
                            f"load (supported: {', '.join(t.name for t in SUPPORTED_TYPES)})")
    expected = names.expected_shapes(cfg)
    out: dict[str, GGUFTensor] = {}
    for info in f.tensors.values():
        hf = names.hf_name(arch, cfg.num_layers, info.name)
        if hf is None or hf not in expected:
            raise GGUFError(f"{f.path}: tensor {info.name} is not a parameter of the {arch} model its "
                            "metadata describes")
        if info.shape != expected[hf]:
            raise GGUFError(f"{f.path}: tensor {info.name} has shape {list(info.shape)}, its metadata "
                            f"implies {list(expected[hf])} ({hf})")
        out[hf] = GGUFTensor(info.name, hf, info.ggml_type, info.shape, names.value_offset(arch, hf), info, f,
                             names.row_order(arch, hf, cfg))
    missing = [name for name in expected if name not in out]
    if missing:
        raise GGUFError(f"{f.path}: {len(missing)} tensor(s) the metadata implies are missing, first "
                        f"{missing[0]}")
    return out
