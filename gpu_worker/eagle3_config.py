"""An EAGLE-3 head's ``config.json`` (vLLM's and SGLang's checkpoint layout), read and
checked against the target it drafts for.

Only json here (no torch): the launcher refuses a head in one line before any process
starts, and the worker reads the same fields.

The layout (vLLM's ``llama_eagle3.py``): ``architectures`` names an EAGLE-3 Llama head
(``LlamaForCausalLMEagle3``); one decoder layer (``midlayer.*``, or ``layers.0.*``)
whose attention reads ``concat(input_layernorm(embed), hidden_norm(h))``, 2H wide;
``fc.weight`` [H, 3H] folds three of the target's hidden states into h; ``norm``;
``lm_head.weight`` [draft_vocab_size, H]; ``d2t`` (draft id -> target id - draft id)
where the draft vocabulary is smaller; ``embed_tokens.weight`` optional (absent: the
target's embeddings). Which target hidden states: ``eagle_aux_hidden_state_layer_ids``
(top level, or in ``eagle_config``), vLLM's numbering: id i is the residual stream
entering decoder layer i (the output of layer i - 1; i = L: the last layer's output),
default (2, L // 2, L - 3), concatenated in layer order.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gpu_worker.model_config import ModelConfig, parse_config

ARCHITECTURES = ("LlamaForCausalLMEagle3", "Eagle3LlamaForCausalLM")
# the layer's tensors; q/k/v and gate/up are loaded into fused parameters
LAYER_TENSORS = ("input_layernorm.weight", "hidden_norm.weight", "post_attention_layernorm.weight",
                 "self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight",
                 "self_attn.o_proj.weight", "mlp.gate_proj.weight", "mlp.up_proj.weight",
                 "mlp.down_proj.weight")
LAYER_PREFIXES = ("midlayer.", "layers.0.")


class HeadError(ValueError):
    """Why a directory is not an EAGLE-3 head this target can draft with (one line)."""


@dataclass(frozen=True)
class Eagle3Config:
    model: ModelConfig  # the layer's sizes (a Llama config)
    draft_vocab_size: int
    aux_layers: tuple[int, ...]  # target layer ids (vLLM's numbering), layer order
    norm_before_residual: bool


def _default_layers(num_layers: int) -> tuple[int, ...]:
    return (2, num_layers // 2, num_layers - 3)


def read_head_config(path: str | Path, target_layers: int) -> Eagle3Config:
    """The head at ``path`` for a target of ``target_layers`` decoder layers (HeadError:
    not one, or not one served)."""
    try:
        raw: dict[str, Any] = json.loads((Path(path) / "config.json").read_text())
    except (OSError, ValueError) as err:
        raise HeadError(f"cannot read its config.json ({err})") from None
    archs = [str(a) for a in raw.get("architectures") or []]
    if not any(a in ARCHITECTURES for a in archs):
        raise HeadError(f"architectures {archs} names no EAGLE-3 head (expected one of "
                        f"{', '.join(ARCHITECTURES)})")
    if raw.get("model_type", "llama") != "llama":
        raise HeadError(f"model_type {raw['model_type']!r}: an EAGLE-3 Llama head is served")
    eagle = raw.get("eagle_config") or {}
    if eagle.get("use_aux_hidden_state", True) is False:
        raise HeadError("eagle_config.use_aux_hidden_state false (a head over the final hidden "
                        "state only) is not served")
    if int(raw.get("num_hidden_layers", 1)) != 1:
        raise HeadError(f"num_hidden_layers {raw.get('num_hidden_layers')}: one midlayer is served")
    try:
        model = parse_config({**raw, "model_type": "llama"})
    except ValueError as err:
        raise HeadError(f"cannot serve it: {' '.join(str(err).split())}") from None
    ids = raw.get("eagle_aux_hidden_state_layer_ids") or eagle.get("eagle_aux_hidden_state_layer_ids")
    layers = tuple(sorted(int(i) for i in ids)) if ids else _default_layers(target_layers)
    outside = [i for i in layers if not 0 <= i <= target_layers]
    if outside:
        raise HeadError(f"aux hidden state layer ids {list(layers)}: {outside} outside the "
                        f"target's 0..{target_layers}")
    draft_vocab = int(raw.get("draft_vocab_size") or model.vocab_size)
    return Eagle3Config(model, draft_vocab, layers, bool(raw.get("norm_before_residual", False)))


def head_mismatch(head: Eagle3Config, target: ModelConfig, shapes: dict[str, list[int]],
                  target_hidden: int | None = None) -> str:
    """What keeps ``head`` (its tensors' ``shapes``, ``tensor_shapes``) from drafting for
    ``target``; "" when nothing does."""
    cfg, hidden = head.model, target.hidden_size
    if cfg.hidden_size != hidden:
        return f"hidden_size {cfg.hidden_size}, the target's is {hidden}"
    if target_hidden is not None and target_hidden != hidden:
        return f"target_hidden_size {target_hidden}, the target's hidden_size is {hidden}"
    if cfg.vocab_size != target.vocab_size:
        return f"vocab_size {cfg.vocab_size}, the target's is {target.vocab_size}"
    if head.draft_vocab_size > cfg.vocab_size:
        return f"draft_vocab_size {head.draft_vocab_size} exceeds vocab_size {cfg.vocab_size}"
    missing = missing_tensors(head, list(shapes))
    if missing:
        return f"missing tensors: {', '.join(missing)}"
    have = {n.removeprefix("model."): list(v) for n, v in shapes.items()}
    want = {"fc.weight": [hidden, len(head.aux_layers) * hidden],
            "lm_head.weight": [head.draft_vocab_size, hidden],
            "embed_tokens.weight": [cfg.vocab_size, hidden], "d2t": [head.draft_vocab_size]}
    for name, shape in want.items():
        if name in have and have[name] != shape:
            return (f"{name} has shape {have[name]}, {shape} expected (aux layers "
                    f"{list(head.aux_layers)}, hidden {hidden}, draft vocabulary "
                    f"{head.draft_vocab_size})")
    return ""


def missing_tensors(head: Eagle3Config, names: list[str]) -> list[str]:
    """The checkpoint tensors the head needs that ``names`` lacks (by their layout names)."""
    have = {n.removeprefix("model.") for n in names}
    need = ["fc.weight", "norm.weight", "lm_head.weight"]
    if head.draft_vocab_size != head.model.vocab_size:
        need.append("d2t")
    missing = [n for n in need if n not in have]
    for t in LAYER_TENSORS:
        if not any(p + t in have for p in LAYER_PREFIXES):
            missing.append("midlayer." + t)
    return missing


def target_hidden_size(path: str | Path) -> int | None:
    """The head's ``target_hidden_size`` when its config states one."""
    raw = json.loads((Path(path) / "config.json").read_text())
    value = raw.get("target_hidden_size")
    return None if value is None else int(value)


def tensor_shapes(path: str | Path) -> dict[str, list[int]]:
    """Every tensor of the head's safetensors files and its shape, from their headers
    (no data read, no torch)."""
    files = sorted(Path(path).glob("*.safetensors"))
    if not files:
        raise HeadError("no *.safetensors files there")
    shapes: dict[str, list[int]] = {}
    for file in files:
        with open(file, "rb") as f:
            (size,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(size))
        shapes.update({name: list(meta["shape"]) for name, meta in header.items()
                       if name != "__metadata__"})
    return shapes
