"""Which quantized format a checkpoint's weights are in: ``ModelConfig.quantization``.

Read from config.json's ``quantization_config`` (HF's key; ``quant_method`` names the
format as vLLM's ``--quantization`` does) or, for a GGUF file, built by its reader from
the file's tensor types (``GgmlSpec``). Anything Candor would compute differently from
the format's definition is refused here, in one line naming the field and value, before
any process starts (torch-free: the launcher runs this).

Which layers are quantized is what the checkpoint holds: a layer whose tensors carry the
format's marker (``qweight``, ``weight_packed``, a ``weight_scale``, a GGML type) gets the
quantized method; the rest stay dense (an ``ignore`` list or ``modules_to_not_convert``
shows up as dense tensors), see ``gpu_worker.quantization.plan``.
"""

from __future__ import annotations

from typing import Any, Literal

import msgspec

from gpu_worker.architectures.hf_config import UnsupportedConfig

# GGML types the kernels compute (ggml.h's enum ggml_type): name -> (id, elements per
# block, bytes per block)
GGML_TYPES: dict[str, tuple[int, int, int]] = {
    "Q4_0": (2, 32, 18), "Q4_1": (3, 32, 20), "Q5_0": (6, 32, 22), "Q5_1": (7, 32, 24),
    "Q8_0": (8, 32, 34), "Q4_K": (12, 256, 144), "Q5_K": (13, 256, 176), "Q6_K": (14, 256, 210)}
GGML_FLOAT = ("F32", "F16", "BF16")  # loaded as dense float weights


class GgmlSpec(msgspec.Struct, frozen=True, tag="gguf"):
    """GGUF weights kept in their blocks: checkpoint tensor name (HF's, as
    ``checkpoint_target`` takes it) -> its GGML type name. Float types load dense."""

    tensor_types: dict[str, str]


class Int4Spec(msgspec.Struct, frozen=True, tag="int4"):
    """Group-wise int4 weights, activations in the compute dtype: GPTQ (``qweight``
    [in/8, out], ``qzeros``, ``scales``, ``g_idx``), AWQ (GEMM: ``qweight`` [in, out/8] in
    AWQ's nibble order) or compressed-tensors ``pack-quantized`` (``weight_packed`` [out,
    in/8], ``weight_scale``, ``weight_zero_point`` when asymmetric). ``group_size`` -1:
    one group per row. ``zero_offset``: GPTQ v1 stores each zero point minus one."""

    format: Literal["gptq", "awq", "pack-quantized"]
    group_size: int
    symmetric: bool = True
    act_order: bool = False
    zero_offset: int = 0


class Int8Spec(msgspec.Struct, frozen=True, tag="w8a8"):
    """compressed-tensors ``int-quantized`` W8A8: int8 weights with a scale per output
    channel, activations quantized per token (dynamic, symmetric) at every matmul."""


class Fp8Spec(msgspec.Struct, frozen=True, tag="fp8"):
    """FP8 e4m3 weights with per-tensor, per-channel or block scales
    (``weight_block_size`` [rows, cols]; the scale tensor is ``scale_name``).
    ``token_activations``: each token's activations rounded through e4m3 at every matmul
    (compressed-tensors' dynamic per-token scheme, as transformers computes it); else
    weight-only, activations in the compute dtype (``quant_method: fp8``, as transformers
    runs it on CPU)."""

    block: tuple[int, int] | None = None
    scale_name: str = "weight_scale"
    token_activations: bool = False


QuantSpec = GgmlSpec | Int4Spec | Int8Spec | Fp8Spec

# vLLM's --quantization names (and its kernel-specific aliases) -> the quant_method they
# serve; ``gguf`` is a file, not a config.json key
QUANTIZATION_NAMES = {"gptq": "gptq", "gptq_marlin": "gptq", "awq": "awq", "awq_marlin": "awq",
                      "compressed-tensors": "compressed-tensors", "fp8": "fp8", "gguf": "gguf"}


def _refuse(field: str, value: Any, supported: Any = None) -> UnsupportedConfig:
    return UnsupportedConfig(f"quantization_config.{field}", value, supported)


def parse_quantization(cfg: dict[str, Any]) -> QuantSpec | None:
    """config.json's ``quantization_config`` -> the spec, None without one."""
    q = cfg.get("quantization_config")
    if q is None:
        return None
    method = str(q.get("quant_method", "")).lower()
    parsers = {"gptq": _gptq, "awq": _awq, "compressed-tensors": _compressed, "fp8": _fp8, "gguf": _gguf}
    if method not in parsers:
        raise _refuse("quant_method", method, parsers)
    return parsers[method](q)


def _gguf(q: dict) -> GgmlSpec:
    """Candor's own entry, written only into a GGUF file's prepared directory
    (``gpu_worker.gguf.tensors``): the file's quantized tensors and their types."""
    types = q.get("tensor_types")
    if not isinstance(types, dict):
        raise _refuse("tensor_types", types, ["a map of tensor name to GGML type"])
    return GgmlSpec({str(name): str(t) for name, t in types.items()})


def _group(q: dict, key: str = "group_size") -> int:
    group = int(q.get(key, -1) if q.get(key) is not None else -1)
    if group != -1 and (group <= 0 or group % 32):
        raise _refuse(key, group, ["-1", "a multiple of 32"])
    return group


def _gptq(q: dict) -> Int4Spec:
    if int(q.get("bits", 4)) != 4:
        raise _refuse("bits", q.get("bits"), [4])
    if q.get("lm_head"):
        raise _refuse("lm_head", True, ["false (a quantized LM head)"])
    if q.get("dynamic"):
        raise _refuse("dynamic", "per-module overrides")
    fmt = str(q.get("checkpoint_format", "gptq"))
    if fmt not in ("gptq", "gptq_v2"):
        raise _refuse("checkpoint_format", fmt, ["gptq", "gptq_v2"])
    return Int4Spec("gptq", _group(q), symmetric=bool(q.get("sym", True)), act_order=bool(q.get("desc_act", False)),
                    zero_offset=1 if fmt == "gptq" else 0)


def _awq(q: dict) -> Int4Spec:
    bits = int(q.get("bits", q.get("w_bit", 4)))
    if bits != 4:
        raise _refuse("bits", bits, [4])
    version = str(q.get("version", "gemm")).lower()
    if version != "gemm":
        raise _refuse("version", version, ["gemm"])
    group = _group(q, "group_size" if "group_size" in q else "q_group_size")
    return Int4Spec("awq", group, symmetric=not bool(q.get("zero_point", True)))


def _compressed(q: dict) -> QuantSpec:
    fmt = str(q.get("format", ""))
    groups = list((q.get("config_groups") or {}).values())
    if len(groups) != 1:
        raise _refuse("config_groups", f"{len(groups)} groups", ["one scheme for every quantized layer"])
    scheme = groups[0]
    if [t for t in scheme.get("targets", []) if t != "Linear"]:
        raise _refuse("config_groups.targets", scheme.get("targets"), ["Linear"])
    w = scheme.get("weights") or {}
    act = scheme.get("input_activations")
    if scheme.get("output_activations"):
        raise _refuse("output_activations", scheme["output_activations"])
    bits, kind, strategy = int(w.get("num_bits", 0)), w.get("type", "int"), w.get("strategy")
    if w.get("actorder"):
        raise _refuse("weights.actorder", w["actorder"])
    if fmt == "pack-quantized" and kind == "int" and bits == 4 and act is None:
        if strategy not in ("group", "channel"):
            raise _refuse("weights.strategy", strategy, ["group", "channel"])
        group = _group(w) if strategy == "group" else -1
        return Int4Spec("pack-quantized", group, symmetric=bool(w.get("symmetric", True)))
    if fmt == "int-quantized" and kind == "int" and bits == 8:
        if strategy != "channel" or not w.get("symmetric", True):
            raise _refuse("weights", f"{strategy} {'symmetric' if w.get('symmetric', True) else 'asymmetric'}",
                          ["channel symmetric"])
        if act is None or act.get("type", "int") != "int" or int(act.get("num_bits", 0)) != 8 \
                or not act.get("dynamic") or act.get("strategy") != "token" or not act.get("symmetric", True):
            raise _refuse("input_activations", act, ["int8 dynamic per-token symmetric"])
        return Int8Spec()
    if fmt == "float-quantized" and kind == "float" and bits == 8:
        if strategy not in ("tensor", "channel"):
            raise _refuse("weights.strategy", strategy, ["tensor", "channel"])
        if act is not None and (act.get("type") != "float" or int(act.get("num_bits", 0)) != 8
                                or not act.get("dynamic") or act.get("strategy") != "token"):
            raise _refuse("input_activations", act, ["none", "fp8 dynamic per-token"])
        return Fp8Spec(token_activations=act is not None)
    raise _refuse("format", f"{fmt} ({kind}{bits} weights, {'no' if act is None else 'quantized'} activations)",
                  ["pack-quantized int4 (W4A16)", "int-quantized int8 (W8A8)", "float-quantized fp8"])


def _fp8(q: dict) -> Fp8Spec:
    fmt = str(q.get("fmt", "e4m3"))
    if fmt != "e4m3":
        raise _refuse("fmt", fmt, ["e4m3"])
    if q.get("modules_to_not_convert") is not None and not isinstance(q["modules_to_not_convert"], list):
        raise _refuse("modules_to_not_convert", q["modules_to_not_convert"])
    block = q.get("weight_block_size")
    if block is None:
        return Fp8Spec()
    rows, cols = (int(v) for v in block)
    if cols % 32:
        raise _refuse("weight_block_size", block, ["[rows, a multiple of 32]"])
    return Fp8Spec(block=(rows, cols), scale_name="weight_scale_inv")


def block_of(spec: QuantSpec | None) -> tuple[int, int]:
    """(rows, input columns) a tensor-parallel split must not cut for this format's
    group-wise layers (GGUF: checked per tensor by the layers, at load)."""
    if isinstance(spec, Int4Spec):
        return (8 if spec.format != "pack-quantized" or not spec.symmetric else 1,
                spec.group_size if spec.group_size > 0 else 1)
    if isinstance(spec, Fp8Spec) and spec.block is not None:
        return spec.block
    return (1, 1)
