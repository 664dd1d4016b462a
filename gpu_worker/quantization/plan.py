"""Which layers of a model get which quantized method, from what the checkpoint holds.

Run on the meta-device model, before its weights are materialised: each checkpoint
tensor is mapped onto the decoder's parameters (``checkpoint_target``, the
architecture's names), and a layer whose tensors carry the format's marker gets the
format's method; a fused layer (q|k|v, gate|up) only when every part is quantized the
same way. A quantized tensor no method serves (mixture-of-experts weights, a quantized
norm) is refused naming it.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable

from torch import nn

from gpu_worker.models.linear_method import LinearMethod, MethodOwner, QuantizableLinear
from gpu_worker.quantization.spec import (GGML_FLOAT, GGML_TYPES, Fp8Spec, GgmlSpec, Int4Spec, Int8Spec,
                                          QuantSpec)

# the tensor whose presence marks a layer of each HF format as quantized
MARKERS = {"gptq": "qweight", "awq": "qweight", "pack-quantized": "weight_packed"}


def _marker(spec: QuantSpec) -> str:
    if isinstance(spec, Int4Spec):
        return MARKERS[spec.format]
    if isinstance(spec, Fp8Spec):
        return spec.scale_name
    return "weight_scale"


def _marked(model: nn.Module, spec: QuantSpec, names: Iterable[str]) -> dict[str, dict]:
    """module path -> {part (None: the whole layer): what marks it (a GGML type or True)}."""
    marks: dict[str, dict] = defaultdict(dict)
    if isinstance(spec, GgmlSpec):
        entries = []
        for name, type_name in spec.tensor_types.items():
            if type_name in GGML_FLOAT:
                continue
            if type_name not in GGML_TYPES:
                raise ValueError(f"{name}: GGML type {type_name} is not supported (supported: "
                                 f"{', '.join([*GGML_FLOAT, *GGML_TYPES])})")
            entries.append((name, type_name))
        marker = "weight"
    else:
        entries, marker = [(name, True) for name in names], _marker(spec)
    for name, mark in entries:
        target = model.checkpoint_target(name)
        if target is None:
            continue
        param, ids = target
        module, _, attr = param.rpartition(".")
        if isinstance(spec, GgmlSpec) and attr != marker:
            raise ValueError(f"{name}: a {mark} tensor that is not a layer's weight")
        if attr == marker:
            marks[module][ids[0] if ids else None] = mark
    return marks


def _method(spec: QuantSpec, parts: dict) -> LinearMethod:
    if isinstance(spec, GgmlSpec):
        from gpu_worker.quantization.ggml import GgmlLinear
        return GgmlLinear(parts)
    if isinstance(spec, Int4Spec):
        from gpu_worker.quantization.int4 import Int4Linear
        return Int4Linear(spec)
    if isinstance(spec, Int8Spec):
        from gpu_worker.quantization.int8 import Int8Linear
        return Int8Linear()
    from gpu_worker.quantization.fp8 import Fp8Linear
    return Fp8Linear(spec)


def quantize_layers(model: nn.Module, spec: QuantSpec | None, names: Iterable[str] = ()) -> str:
    """Give each quantized layer of ``model`` (on meta) its method; ``names``: the
    checkpoint's tensor names (an HF format's; a GGUF spec names its own). Returns what
    was done, for the log."""
    if spec is None:
        return ""
    marks = _marked(model, spec, names)
    counts: dict[str, int] = defaultdict(int)
    for path, parts in sorted(marks.items()):
        try:
            layer = model.get_submodule(path)
        except AttributeError:
            raise ValueError(f"{path}: quantized tensors for a module the model does not have") from None
        if not isinstance(layer, MethodOwner):
            raise ValueError(f"{path}: quantized {type(layer).__name__} weights are not supported "
                             "(only linear layers, and GGUF's embedding and LM head)")
        if not isinstance(layer, QuantizableLinear) and not isinstance(spec, GgmlSpec):
            raise ValueError(f"{path}: a quantized embedding or LM head is only read from GGUF")
        expected = set(layer.part_rows()) if hasattr(layer, "part_rows") else {None}
        if None not in parts and set(parts) != expected:
            missing = sorted(map(str, expected - set(parts)))
            raise ValueError(f"{path}: parts {', '.join(missing)} of this fused layer are not quantized "
                             "like the others")
        try:
            layer.set_method(_method(spec, parts))
        except ValueError as err:
            raise ValueError(f"{path}: {err}") from None
        counts[layer.method.name] += 1
    kinds = ", ".join(f"{n} {name}" for name, n in counts.items())
    return f"quantized layers: {kinds or 'none'} (the rest dense)"
