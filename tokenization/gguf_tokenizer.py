"""``python -m tokenization.gguf_tokenizer FILE.gguf OUT``: the tokenizer and chat templates
a GGUF file's metadata describes, written as HF tokenizer files into OUT.

The conversion is transformers' own (``AutoTokenizer.from_pretrained(dir,
gguf_file=...)``: vocabulary, merges, pre-tokenizer, special and control tokens,
``add_bos_token``, ``tokenizer.chat_template``), saved with ``save_pretrained``, so
``CheckpointTokenizer`` reads back exactly transformers' GGUF tokenizer. The named
templates llama.cpp also reads (``tokenizer.chat_template.NAME``, e.g. ``tool_use``),
which transformers leaves out, go to ``additional_chat_templates/NAME.jinja``.

Run once per file by the launcher (``launcher.gguf_checkpoint``), in a process of its
own: transformers (and the torch it imports) never enters a serving process this way.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

NAMED_TEMPLATE = "tokenizer.chat_template."


def convert(gguf_path: str, out: str | Path) -> None:
    from transformers import AutoTokenizer
    from transformers.integrations.gguf import read_gguf_metadata

    path = os.path.abspath(gguf_path)
    tokenizer = AutoTokenizer.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path))
    tokenizer.save_pretrained(str(out))
    metadata, _ = read_gguf_metadata(path)
    named = {key[len(NAMED_TEMPLATE):]: value for key, value in metadata.items()
             if key.startswith(NAMED_TEMPLATE) and isinstance(value, str)}
    if named:
        folder = Path(out) / "additional_chat_templates"
        folder.mkdir(exist_ok=True)
        for name, source in named.items():
            (folder / f"{name}.jinja").write_text(source, encoding="utf-8")


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit("usage: python -m tokenization.gguf_tokenizer FILE.gguf OUT")
    convert(sys.argv[1], sys.argv[2])
