"""A causal LM served as a classifier from its LM head's rows (vLLM's
``classifier_from_token``), read from config.json with the standard library only: the
launcher, the frontend, the tokenizer worker and the gpu_worker must agree on it.

Qwen3-Reranker is published as a ``Qwen3ForCausalLM`` that judges a (query, document)
prompt by the next token: P(yes) = softmax([l_no, l_yes])[1] = sigmoid(l_yes - l_no).
vLLM serves it with ``--hf-overrides '{"architectures": ["Qwen3ForSequenceClassification"],
"classifier_from_token": ["no", "yes"], "is_original_qwen3_reranker": true}'``; Candor
takes the same keys (``launcher.hf_overrides`` writes them into the config every role
reads) and converts at load time as vLLM does:

- ``from_2_way_softmax`` (``is_original_qwen3_reranker: true``, or ``method`` so named;
  exactly two tokens, the negative one first): one ``score`` row, lm_head[yes] -
  lm_head[no], so the served score sigmoid(logit) equals that softmax;
- ``no_post_processing`` (``method``): one ``score`` row per token, lm_head[token], so
  the labels are the tokens and /classify's softmax is the softmax over those tokens.

Any other combination would score something the checkpoint was not trained to mean,
so it is refused (``TokenClassifierError``) rather than guessed.
"""

from __future__ import annotations

from typing import Any, Literal

import msgspec

Method = Literal["from_2_way_softmax", "no_post_processing"]
METHODS = ("from_2_way_softmax", "no_post_processing")
# the prompt format a pair is written in before it is tokenized (None: as the tokenizer pairs)
PairFormat = Literal["qwen3_reranker"]


class TokenClassifierError(ValueError):
    """config.json's token-classifier keys do not describe a conversion Candor makes."""


class TokenClassifier(msgspec.Struct, frozen=True):
    """``tokens``: the LM-head rows read (as the tokenizer spells them); ``method``: how
    they become the ``score`` head (module docstring)."""

    tokens: list[str]
    method: Method

    @property
    def num_labels(self) -> int:
        return 1 if self.method == "from_2_way_softmax" else len(self.tokens)

    @property
    def labels(self) -> list[str]:
        return [self.tokens[1]] if self.method == "from_2_way_softmax" else list(self.tokens)


def is_classifier(config: dict[str, Any]) -> bool:
    return any(str(a).endswith("ForSequenceClassification")
               for a in config.get("architectures") or [])


def read_token_classifier(config: dict[str, Any]) -> TokenClassifier | None:
    """The conversion config.json asks for (None: a checkpoint with its own ``score``)."""
    tokens = config.get("classifier_from_token")
    original = bool(config.get("is_original_qwen3_reranker"))
    method = config.get("method")
    if tokens is None and not original and method is None:
        return None
    if tokens is None:
        raise TokenClassifierError("is_original_qwen3_reranker / method need "
                                   "classifier_from_token (the LM-head tokens to read)")
    if not isinstance(tokens, list) or not tokens or not all(isinstance(t, str) and t for t in tokens):
        raise TokenClassifierError(f"classifier_from_token must be a list of token strings, "
                                   f"got {tokens!r}")
    if not is_classifier(config):
        raise TokenClassifierError(
            "classifier_from_token needs a *ForSequenceClassification architecture (e.g. "
            "\"architectures\": [\"Qwen3ForSequenceClassification\"]); architectures is "
            f"{config.get('architectures')!r}")
    if original:
        if method not in (None, "from_2_way_softmax"):
            raise TokenClassifierError(f"is_original_qwen3_reranker scores by "
                                       f"from_2_way_softmax, but method is {method!r}")
        method = "from_2_way_softmax"
    if method is None:
        raise TokenClassifierError(
            "classifier_from_token needs is_original_qwen3_reranker: true (score = "
            "sigmoid(l_yes - l_no)) or a method (" + " / ".join(METHODS) + ")")
    if method not in METHODS:
        raise TokenClassifierError(f"method {method!r} is not served (served: "
                                   f"{', '.join(METHODS)})")
    if method == "from_2_way_softmax" and len(tokens) != 2:
        raise TokenClassifierError(f"from_2_way_softmax reads two tokens (the negative one "
                                   f"first, e.g. [\"no\", \"yes\"]); classifier_from_token has "
                                   f"{len(tokens)}")
    return TokenClassifier(list(tokens), method)


def pair_format(config: dict[str, Any]) -> PairFormat | None:
    """How a (query, document) pair is written before tokenizing: Qwen3-Reranker's
    published prompt for an original Qwen3-Reranker (``tokenizer_worker.score_prompt``)."""
    return "qwen3_reranker" if config.get("is_original_qwen3_reranker") else None
