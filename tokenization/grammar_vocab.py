"""The grammar engine's (llguidance's) view of a checkpoint's vocabulary, built the same
way where grammars are compiled (the tokenizer worker) and where they are enforced (the
gpu_worker), so both agree on every token."""

from __future__ import annotations

import json

import llguidance


def _byte_level_chars() -> dict[int, str]:
    """GPT-2's byte -> printable character table (how byte-level BPE vocabularies spell
    bytes)."""
    keep = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    table, extra = {}, 0
    for b in range(256):
        if b in keep:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + extra)
            extra += 1
    return table


def _plain_added_tokens(tokenizer_json: str) -> str:
    """Non-special added tokens (Qwen's ``<tool_call>``, ours) moved into the model's
    vocabulary, spelled the way it spells text. The engine treats every added token as a
    special one, whose bytes no text grammar matches, yet its mask's shortcut for a literal
    can still allow such a token when the grammar spells its text: the worker would then
    sample a token the matcher refuses. As vocabulary entries they are the text they are."""
    data = json.loads(tokenizer_json)
    model = data.get("model") or {}
    vocab = model.get("vocab")
    kinds = {(data.get(k) or {}).get("type") for k in ("pre_tokenizer", "decoder")}
    if not isinstance(vocab, dict):
        return tokenizer_json
    chars = _byte_level_chars() if "ByteLevel" in kinds else None
    keep = []
    for added in data.get("added_tokens") or []:
        text = added.get("content", "")
        if added.get("special", True) or not text:
            keep.append(added)
            continue
        if chars is not None:
            spelled = "".join(chars[b] for b in text.encode("utf-8"))
        elif "Metaspace" in kinds:
            spelled = text.replace(" ", "\u2581")
        else:
            spelled = text
        if spelled in vocab:
            keep.append(added)
            continue
        vocab[spelled] = added["id"]
    data["added_tokens"] = keep
    return json.dumps(data, ensure_ascii=False)


def build_tokenizer(tokenizer_json: str, vocab_size: int, eos_ids: list[int]
                    ) -> llguidance.LLTokenizer:
    """The engine's view of the vocabulary: the model's rows (masks are that wide) and
    every end-of-sequence id (allowed once the grammar is complete)."""
    return llguidance.LLTokenizer(_plain_added_tokens(tokenizer_json), n_vocab=vocab_size,
                                  eos_token=list(eos_ids))
