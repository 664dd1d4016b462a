"""The prompt a decoder reranker reads a (query, document) pair in, written here so the
client sends plain texts to /v1/rerank and /v1/score as it does to a cross-encoder.

Qwen3-Reranker (``cluster.token_classifier.pair_format`` ``qwen3_reranker``) was trained
on one prompt, published with the model (its model card's ``format_instruction`` with the
system prefix and the empty ``<think>`` suffix; vLLM's ``qwen3_reranker.jinja`` score
template writes the same text), with its default instruction. The prompt is a whole chat
turn, so it is tokenized without the tokenizer's own special tokens (the model card
encodes its prefix and suffix with ``add_special_tokens=False``).

A query that already starts with ``<|im_start|>`` was formatted by the client (vLLM's
earlier examples have the client write the prefix into ``text_1`` and the suffix into
``text_2``, and a custom instruction is sent that way): the two texts are then joined as
given, never formatted twice.
"""

from __future__ import annotations

QWEN3_RERANKER_PREFIX = (
    "<|im_start|>system\nJudge whether the Document meets the requirements based on the Query "
    "and the Instruct provided. Note that the answer can only be \"yes\" or \"no\".<|im_end|>\n"
    "<|im_start|>user\n")
QWEN3_RERANKER_SUFFIX = "<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
QWEN3_RERANKER_INSTRUCTION = ("Given a web search query, retrieve relevant passages that "
                              "answer the query")


def qwen3_reranker_prompt(query: str, document: str) -> str:
    """The whole prompt of one pair (the model judges it by its next token, yes or no)."""
    if query.startswith("<|im_start|>"):
        return query + document
    return (f"{QWEN3_RERANKER_PREFIX}<Instruct>: {QWEN3_RERANKER_INSTRUCTION}\n<Query>: {query}\n"
            f"<Document>: {document}{QWEN3_RERANKER_SUFFIX}")


PAIR_PROMPTS = {"qwen3_reranker": qwen3_reranker_prompt}
