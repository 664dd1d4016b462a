"""A PEFT LoRA adapter directory (``adapter_config.json`` + ``adapter_model.safetensors``)
read and checked against the base model without torch: the launcher refuses a bad
adapter in one line before any process starts, and a runtime load gets a 400 naming
what is wrong before a tensor is read.

What is served: plain LoRA (``y += scaling * B A x``, ``scaling = lora_alpha / r``, or
``lora_alpha / sqrt(r)`` with ``use_rslora``) on the attention and MLP projections q, k,
v, o, gate, up, down (or the fused ``qkv_proj`` / ``gate_up_proj`` where the base
checkpoint holds them fused, as Phi-3's). Anything that would change the output in a way
this does not compute is refused naming it: DoRA, ``modules_to_save``, LoRA biases,
embedding or expert targets, per-module rank or alpha patterns, and the like. The
safetensors header alone gives every tensor's name, dtype and shape, so shapes are
checked against the base's config before any data is read; pickled ``adapter_model.bin``
files are never read.
"""

from __future__ import annotations

import json
import math
import os
import re
import struct
from typing import Any

import msgspec

from gpu_worker.model_config import ModelConfig, architecture

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
MAX_HEADER_BYTES = 64 << 20
DTYPES = {"F32": "float32", "F16": "float16", "BF16": "bfloat16"}

# adapter_config.json fields that change the output unless they hold their neutral value
# -> what they are (for the refusal)
_NOT_SERVED = {
    "use_dora": "DoRA (weight-decomposed LoRA)",
    "modules_to_save": "modules_to_save (whole modules trained and saved beside the adapter)",
    "lora_bias": "lora_bias (a trained bias on lora_B)",
    "fan_in_fan_out": "fan_in_fan_out (Conv1D-layout weights)",
    "rank_pattern": "rank_pattern (per-module ranks)",
    "alpha_pattern": "alpha_pattern (per-module alphas)",
    "alora_invocation_tokens": "activated LoRA (alora_invocation_tokens)",
    "use_qalora": "QA-LoRA (use_qalora)",
    "layer_replication": "layer_replication",
    "target_parameters": "target_parameters (LoRA on parameters, not modules)",
    "trainable_token_indices": "trainable_token_indices (trained embedding rows)",
    "megatron_config": "megatron_config",
    "use_bdlora": "block-diagonal LoRA (use_bdlora)",
    "velora_config": "VeLoRA (velora_config)",
    "monteclora_config": "MonteCLoRA (monteclora_config)",
    "arrow_config": "Arrow routing (arrow_config)",
    "kasa_config": "KaSA (kasa_config)",
}
# checkpoint projection names an adapter may target
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj",
           "qkv_proj", "gate_up_proj")
_KEY = re.compile(r"^base_model\.model\.(?P<module>.+)\.lora_(?P<kind>[AB])\.weight$")
_OURS = re.compile(r"^model\.layers\.(?P<layer>\d+)\.(?P<block>self_attn|mlp)\."
                   r"(?P<module>qkv_proj|o_proj|gate_up_proj|down_proj)\.weight$")


class AdapterError(ValueError):
    """Why an adapter cannot be served: one line, naming the file, field or tensor."""


class AdapterPair(msgspec.Struct, frozen=True):
    """One adapted projection: ``module`` is the decoder's (fused) layer in ``layer``,
    ``part`` which of its outputs (``q``/``k``/``v``, 0/1 for gate/up; None: the whole
    layer), with the checkpoint keys of A [r, in] and B [out, r]."""

    layer: int
    module: str
    part: str | int | None
    a_key: str
    b_key: str


class AdapterLayout(msgspec.Struct, frozen=True):
    """What a rank needs to load an adapter: its safetensors file, rank and scaling, and
    every adapted projection."""

    path: str
    file: str
    rank: int
    scaling: float
    pairs: list[AdapterPair]
    dtype: str


def read_header(file: str) -> dict[str, Any]:
    """The safetensors header: tensor name -> {dtype, shape, data_offsets}, checked to
    lie inside the file."""
    try:
        size = os.path.getsize(file)
        with open(file, "rb") as fh:
            head = fh.read(8)
            if len(head) < 8:
                raise AdapterError(f"{file} is not a safetensors file (shorter than 8 bytes)")
            (n,) = struct.unpack("<Q", head)
            if n > min(MAX_HEADER_BYTES, size - 8):
                raise AdapterError(f"{file} is not a safetensors file (header of {n} bytes)")
            header = json.loads(fh.read(n))
    except OSError as err:
        raise AdapterError(f"cannot read {file}: {err.strerror or err}") from None
    except (ValueError, UnicodeDecodeError) as err:
        raise AdapterError(f"{file} is not a safetensors file: {err}") from None
    if not isinstance(header, dict):
        raise AdapterError(f"{file} is not a safetensors file (header is not an object)")
    header.pop("__metadata__", None)
    data = size - 8 - n
    for name, info in header.items():
        try:
            start, end = info["data_offsets"]
            shape, dtype = [int(d) for d in info["shape"]], info["dtype"]
        except (KeyError, TypeError, ValueError):
            raise AdapterError(f"{file}: tensor {name!r} has a malformed header entry") from None
        if not 0 <= start <= end <= data:
            raise AdapterError(f"{file}: tensor {name!r} lies outside the file")
        info["shape"] = shape
        if dtype in DTYPES and end - start != math.prod(shape) * (4 if dtype == "F32" else 2):
            raise AdapterError(f"{file}: tensor {name!r}'s size does not match its shape")
    return header


def _config(path: str) -> dict[str, Any]:
    file = os.path.join(path, CONFIG_FILE)
    if not os.path.isdir(path):
        raise AdapterError(f"{path} is not a directory")
    if not os.path.isfile(file):
        raise AdapterError(f"{path} has no {CONFIG_FILE} (a PEFT adapter directory has one)")
    try:
        with open(file, encoding="utf-8") as fh:
            config = json.load(fh)
    except (OSError, ValueError) as err:
        raise AdapterError(f"cannot read {file}: {err}") from None
    if not isinstance(config, dict):
        raise AdapterError(f"{file} is not a JSON object")
    return config


def _settings(config: dict[str, Any], max_rank: int) -> tuple[int, float]:
    """(rank, scaling), after refusing what is not plain LoRA."""
    peft_type = str(config.get("peft_type", "LORA")).upper()
    if peft_type != "LORA":
        raise AdapterError(f"{CONFIG_FILE}: peft_type {peft_type!r} is not served (LoRA only)")
    for field, what in _NOT_SERVED.items():
        if config.get(field):
            raise AdapterError(f"{CONFIG_FILE}: {what} is not served ({field}="
                               f"{json.dumps(config[field])[:80]})")
    if config.get("bias", "none") != "none":
        raise AdapterError(f"{CONFIG_FILE}: bias={config['bias']!r} (trained biases) is not "
                           "served; only bias='none'")
    rank, alpha = config.get("r"), config.get("lora_alpha", config.get("r"))
    if not isinstance(rank, int) or isinstance(rank, bool) or rank < 1:
        raise AdapterError(f"{CONFIG_FILE}: r={rank!r} is not a positive integer")
    if not isinstance(alpha, (int, float)) or isinstance(alpha, bool):
        raise AdapterError(f"{CONFIG_FILE}: lora_alpha={alpha!r} is not a number")
    if rank > max_rank:
        raise AdapterError(f"rank {rank} exceeds this deployment's max_lora_rank {max_rank} "
                           "(--max-lora-rank)")
    scaling = alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank
    return rank, float(scaling)


def _shapes(cfg: ModelConfig) -> dict[tuple[str, str | int | None], tuple[int, int]]:
    """(our module, part) -> (in, out) features of that projection in the base."""
    h, q, kv, i = cfg.hidden_size, cfg.q_size, cfg.kv_size, cfg.intermediate_size
    return {("qkv_proj", "q"): (h, q), ("qkv_proj", "k"): (h, kv), ("qkv_proj", "v"): (h, kv),
            ("qkv_proj", None): (h, q + 2 * kv), ("o_proj", None): (q, h),
            ("gate_up_proj", 0): (h, i), ("gate_up_proj", 1): (h, i),
            ("gate_up_proj", None): (h, 2 * i), ("down_proj", None): (i, h)}


def _target(module: str, cfg: ModelConfig) -> tuple[int, str, str | int | None]:
    """A checkpoint module the adapter names -> (layer, our module, part), or refused."""
    leaf = module.rsplit(".", 1)[-1]
    names = architecture(cfg.model_type).weights
    mapped = names.target(module + ".weight", cfg.tie_word_embeddings)
    match = _OURS.match(mapped[0]) if mapped is not None else None
    # a fused name where the base checkpoint holds the parts separately is not its module
    fused_elsewhere = any(fused == leaf for fused, _ in names.packed.values())
    if leaf not in TARGETS or match is None or fused_elsewhere:
        raise AdapterError(f"target module {module!r} is not served: LoRA on the q/k/v/o and "
                           "gate/up/down projections only (embeddings, the LM head, MoE "
                           "experts and routers are not)")
    layer = int(match["layer"])
    if layer >= cfg.num_layers:
        raise AdapterError(f"target module {module!r}: the base model has {cfg.num_layers} layers")
    ours = match["module"]
    if match["block"] == "mlp" and (cfg.mlp != "gated" or cfg.layers[layer].moe):
        kind = "a mixture of experts" if cfg.layers[layer].moe else "not a gated MLP"
        raise AdapterError(f"target module {module!r}: layer {layer}'s MLP is {kind}")
    part = mapped[1][0] if mapped[1] else None
    return layer, ours, part


def read_adapter(path: str, base: ModelConfig, max_rank: int) -> AdapterLayout:
    """Check the adapter at ``path`` against the base model; its layout, or AdapterError."""
    config = _config(path)
    rank, scaling = _settings(config, max_rank)
    file = os.path.join(path, WEIGHTS_FILE)
    if not os.path.isfile(file):
        bin_file = os.path.isfile(os.path.join(path, "adapter_model.bin"))
        raise AdapterError(f"{path} has no {WEIGHTS_FILE}" + (
            " (adapter_model.bin is a pickle, which Candor does not read; save the adapter "
            "with safe_serialization)" if bin_file else ""))
    header = read_header(file)
    shapes = _shapes(base)
    keys: dict[str, dict[str, str]] = {}
    dtypes = set()
    for key, info in sorted(header.items()):
        match = _KEY.match(key)
        if match is None:
            raise AdapterError(f"{WEIGHTS_FILE}: tensor {key!r} is not served (only "
                               "base_model.model.<module>.lora_A/lora_B.weight: no DoRA "
                               "magnitudes, embedding adapters or biases)")
        if info["dtype"] not in DTYPES:
            raise AdapterError(f"{WEIGHTS_FILE}: tensor {key!r} has dtype {info['dtype']} "
                               f"(served: {', '.join(DTYPES)})")
        dtypes.add(DTYPES[info["dtype"]])
        keys.setdefault(match["module"], {})[match["kind"]] = key
    if not keys:
        raise AdapterError(f"{WEIGHTS_FILE} holds no LoRA tensors")
    pairs = []
    for module, kinds in keys.items():
        missing = {"A", "B"} - set(kinds)
        if missing:
            raise AdapterError(f"{WEIGHTS_FILE}: {module} has no lora_{missing.pop()}.weight")
        layer, ours, part = _target(module, base)
        fan_in, fan_out = shapes[(ours, part)]
        a_shape, b_shape = header[kinds["A"]]["shape"], header[kinds["B"]]["shape"]
        if a_shape != [rank, fan_in] or b_shape != [fan_out, rank]:
            raise AdapterError(
                f"{module}: lora_A {a_shape} and lora_B {b_shape} do not fit the base model "
                f"(expected [{rank}, {fan_in}] and [{fan_out}, {rank}] for rank {rank}: "
                "an adapter trained for another model?)")
        pairs.append(AdapterPair(layer, ours, part, kinds["A"], kinds["B"]))
    pairs.sort(key=lambda p: (p.layer, p.module, str(p.part)))
    return AdapterLayout(os.path.abspath(path), file, rank, scaling, pairs,
                         dtypes.pop() if len(dtypes) == 1 else "float32")
