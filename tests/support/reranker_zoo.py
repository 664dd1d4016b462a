"""A tiny random decoder yes/no reranker as Qwen3-Reranker is published: a
``Qwen3ForCausalLM`` checkpoint (built with transformers' own classes, perturbed like
every tiny model) whose tokenizer has ``<|im_start|>`` / ``<|im_end|>`` and the tokens
"yes" and "no", judged by P(yes) = softmax([l_no, l_yes])[1] at the last position of
its prompt. The reference computes that with transformers on the same checkpoint."""

from __future__ import annotations

from pathlib import Path

import torch

from tests.support import model_zoo

# vLLM's command line for Qwen3-Reranker, unchanged
HF_OVERRIDES = {"architectures": ["Qwen3ForSequenceClassification"],
                "classifier_from_token": ["no", "yes"], "is_original_qwen3_reranker": True}


def build(out: Path, tokenizer_dir: Path, *, tied: bool = True) -> Path:
    """The tiny tokenizer with the reranker's tokens added, and a Qwen3ForCausalLM over
    it (``tied``: the LM head is the embedding table, as in Qwen3-Reranker-0.6B)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    tok.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    tok.add_tokens(["yes", "no"])
    model_zoo.build("qwen3", out, vocab_size=len(tok), tie_word_embeddings=tied)
    tok.save_pretrained(out)
    return out


def reference_scores(path: Path, prompts: list[str]) -> list[float]:
    """transformers' P(yes) = softmax([l_no, l_yes])[1] at each prompt's last token (the
    prompt tokenized without added special tokens, as the model card does)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(path)
    model = model_zoo.hf_model(path)
    yes, no = tok.convert_tokens_to_ids(["yes", "no"])
    out = []
    with torch.no_grad():
        for prompt in prompts:
            ids = tok(prompt, add_special_tokens=False)["input_ids"]
            last = model(torch.tensor([ids])).logits[0, -1]
            out.append(float(torch.softmax(torch.stack([last[no], last[yes]]), dim=0)[1]))
    return out
