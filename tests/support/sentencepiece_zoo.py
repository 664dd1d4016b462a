"""A SentencePiece-style tokenizer built with the ``tokenizers`` library, the kind Llama-2,
Mistral and Gemma ship as ``tokenizer.json``: a BPE model with byte fallback (``<0xNN>``
pieces for characters outside the vocabulary), the Metaspace pre-tokenizer (spaces become
"▁", one prepended to the first word) and the matching decoder chain. Trained on the tiny
model's corpus, deterministic, nothing downloaded."""

from __future__ import annotations

import json
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

from launcher.tiny_model import CORPUS

BOS, EOS, UNK = "<s>", "</s>", "<unk>"
SPECIAL = [UNK, BOS, EOS]
BYTE_PIECES = [f"<0x{b:02X}>" for b in range(256)]
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}"
    "{% if m['role'] == 'user' %}{{ '[INST] ' + m['content'] + ' [/INST]' }}"
    "{% else %}{{ ' ' + m['content'] + eos_token }}{% endif %}{% endfor %}")


def build_sentencepiece_tokenizer(out: Path, vocab_size: int) -> Path:
    """Write tokenizer.json + tokenizer_config.json into ``out`` (which must exist)."""
    tok = Tokenizer(models.BPE(unk_token=UNK, byte_fallback=True, fuse_unk=True))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    tok.decoder = decoders.Sequence([decoders.Metaspace(replacement="▁", prepend_scheme="first"),
                                     decoders.ByteFallback(), decoders.Fuse()])
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL + BYTE_PIECES,
                                  show_progress=False)
    tok.train([str(CORPUS)], trainer)
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS}:0 $A:0", pair=f"{BOS}:0 $A:0 {BOS}:1 $B:1",
        special_tokens=[(BOS, tok.token_to_id(BOS))])
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": BOS, "eos_token": EOS, "unk_token": UNK,
        "tokenizer_class": "LlamaTokenizerFast", "model_max_length": 512,
        "chat_template": CHAT_TEMPLATE}))
    return out
