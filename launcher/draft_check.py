"""Speculative decoding's draft model, checked before any process starts: each refusal is
one line naming the draft and what it clashes with.

A draft model must be a checkpoint the gpu_worker serves, with the target's vocabulary
(its logits index the same ids) and tokenizer (the same special tokens at the same ids:
the same vocabulary size with other ids would draft nonsense that verification rejects
at full cost), and a context at least the served one. It runs beside rank 0's shard
of the model (whole: rank 0 alone proposes), with a cache that mirrors the target's
blocks, so it is refused with what it cannot follow: a prefill/decode split or a shared
KV store (K/V that arrives from elsewhere has no draft counterpart), a pooling or
multimodal model. With LoRA it drafts as the base draft model would for every request
(adapters apply to the target alone: their requests keep fewer drafts, never other
tokens). An EAGLE-3 head (``eagle3``) is refused with the same combinations, and when
its layout or sizes do not fit the target (``_check_head``)."""

from __future__ import annotations

import os

from cluster.checkpoint import effective_max_model_len
from cluster.topology import EngineGroup, Topology


def _fail(draft: str, why: str) -> SystemExit:
    return SystemExit(f"candor: draft model {draft} (--speculative-config): {why}")


def check_draft_model(topology: Topology) -> None:
    """Refuse a draft model or EAGLE-3 head the engines could not run with, in one line."""
    for group in topology.groups():
        spec = group.engine.speculative_config
        if spec is not None and spec.method == "draft_model":
            _check_combination(topology, group, spec.model)
            _check_files(group, spec.model)
        elif spec is not None and spec.method == "eagle3":
            _check_combination(topology, group, spec.model)
            _check_head(group, spec.model)


def _check_head(group: EngineGroup, head: str) -> None:
    """An EAGLE-3 head (gpu_worker/eagle3_config.py): its layout, its tensors, and the
    target's sizes it reads (hidden size, vocabulary, layers)."""
    from gpu_worker.eagle3_config import (HeadError, head_mismatch, read_head_config,
                                          target_hidden_size, tensor_shapes)
    from gpu_worker.model_config import load_config

    def fail(why: str) -> SystemExit:
        return SystemExit(f"candor: EAGLE-3 head {head} (--speculative-config): {why}")

    target = group.model.resolved_path()
    if not os.path.isfile(os.path.join(target, "config.json")):
        return  # another node holds the checkpoints; its launcher checks them
    if not os.path.isfile(os.path.join(head, "config.json")):
        raise fail("no config.json there (an EAGLE-3 head's directory is needed)")
    own = load_config(target)
    if own.vision is not None:
        raise fail(f"not with a multimodal model ({target})")
    try:
        cfg = read_head_config(head, own.num_layers)
        problem = head_mismatch(cfg, own, tensor_shapes(head), target_hidden_size(head))
    except HeadError as err:
        raise fail(str(err)) from None
    if problem:
        raise fail(f"{problem} (target {target})")


def _check_combination(topology: Topology, group: EngineGroup, draft: str) -> None:
    if group.index == 0 and topology.disaggregation is not None:
        raise _fail(draft, "not with a prefill/decode split (--prefill-replicas / "
                           "--decode-replicas): the K/V handed over has no draft-model part")
    if topology.kv_store is not None:
        raise _fail(draft, "not with the shared KV store (kv_store): the K/V it brings in "
                           "has no draft-model part")
    if group.runner == "pooling":
        raise _fail(draft, f"{group.model.name()!r} is a pooling model (--runner pooling), "
                           "which samples no tokens")


def _check_files(group: EngineGroup, draft: str) -> None:
    from gpu_worker.model_config import UnsupportedConfig, load_config

    target = group.model.resolved_path()
    if not os.path.isfile(os.path.join(target, "config.json")):
        return  # another node holds the checkpoints; its launcher checks them
    if not os.path.isfile(os.path.join(draft, "config.json")):
        raise _fail(draft, "no config.json there (a checkpoint directory or a GGUF file is "
                           "needed)")
    try:
        cfg = load_config(draft)
    except (UnsupportedConfig, OSError, ValueError) as err:
        raise _fail(draft, f"cannot serve it: {' '.join(str(err).split())}") from None
    own = load_config(target)
    if cfg.encoder is not None or cfg.vision is not None:
        raise _fail(draft, "a text decoder is needed (this one is an encoder or multimodal)")
    if own.vision is not None:
        raise _fail(draft, f"not with a multimodal model ({target})")
    if cfg.vocab_size != own.vocab_size:
        raise _fail(draft, f"vocab_size {cfg.vocab_size}, the target {target} has "
                           f"{own.vocab_size}: a draft model needs the target's vocabulary")
    mismatch = tokenizer_mismatch(target, draft)
    if mismatch:
        raise _fail(draft, f"its tokenizer differs from the target's ({target}): {mismatch}")
    context = effective_max_model_len(target, group.model.max_model_len)
    if cfg.max_position_embeddings < context:
        raise _fail(draft, f"its context is {cfg.max_position_embeddings} tokens, the served "
                           f"one {context}: lower --max-model-len to at most "
                           f"{cfg.max_position_embeddings}")


def tokenizer_mismatch(target: str, draft: str) -> str:
    """What differs between two checkpoints' tokenizers that a draft must share: the
    number of ids, the special tokens by name and by id; "" when nothing does."""
    from tokenization.tokenizer_files import CheckpointTokenizer

    try:
        ours, theirs = CheckpointTokenizer(target), CheckpointTokenizer(draft)
    except (OSError, ValueError) as err:
        return f"cannot read the tokenizer ({' '.join(str(err).split())})"
    if ours.vocab_size != theirs.vocab_size:
        return f"{theirs.vocab_size} token ids, the target's {ours.vocab_size}"

    def named(tok: CheckpointTokenizer) -> dict[str, tuple[str, int | None]]:
        return {name: (text, tok.backend.token_to_id(text))
                for name, text in tok.special_tokens_map.items()}
    a, b = named(ours), named(theirs)
    for name in sorted(set(a) | set(b)):
        if a.get(name) != b.get(name):
            return f"{name} is {b.get(name)}, the target's {a.get(name)} (text, id)"
    if sorted(ours.all_special_ids) != sorted(theirs.all_special_ids):
        return (f"special token ids {sorted(theirs.all_special_ids)}, the target's "
                f"{sorted(ours.all_special_ids)}")
    return ""
