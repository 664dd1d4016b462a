"""How a pooling deployment (``--runner pooling``) turns hidden states into one embedding,
read from the checkpoint with the standard library only (the frontend, the tokenizer
worker and the launcher read it too; none of them imports torch).

With sentence-transformers files (``modules.json``: the Transformer, then ``Pooling``
and an optional ``Normalize``) the pooling is theirs: ``1_Pooling/config.json`` names the
mode (the current ``pooling_mode`` key or the older ``pooling_mode_*`` switches), and a
``Normalize`` module means L2 normalisation. Without them: the last token's hidden state,
L2-normalised (vLLM's default for decoder embedding models). A module or mode that would
change the vector and that Candor does not compute (``Dense``, ``max`` pooling ...) is
refused at start, naming it, rather than served differently.

A ``*ForSequenceClassification`` checkpoint (a cross-encoder) is a ``classify`` model:
its output is the head's ``num_labels`` logits (``dimension`` is ``num_labels``), never
normalised, of the first token's state for an encoder, the last token's for a decoder; it serves /v1/score,
/v1/rerank and /classify, not /v1/embeddings.

Matryoshka (the ``dimensions`` request field) follows vLLM's convention: ``config.json``
(or ``config_sentence_transformers.json``) declares ``matryoshka_dimensions`` (the sizes
allowed) or ``is_matryoshka: true`` (any size up to the full one).
"""

from __future__ import annotations

import json
import os
from typing import Any, Literal

import msgspec

from cluster.checkpoint import read_model_config
from cluster.token_classifier import PairFormat, pair_format, read_token_classifier

Method = Literal["last", "mean", "cls"]
Task = Literal["embed", "classify"]
ENCODER_TYPES = ("bert", "roberta", "xlm-roberta")
RUNNERS = ("generate", "pooling")
# sentence-transformers' pooling modes -> ours; the others are refused
_ST_MODES: dict[str, Method] = {"lasttoken": "last", "mean": "mean", "cls": "cls"}
_LEGACY_MODES = {"pooling_mode_cls_token": "cls", "pooling_mode_max_tokens": "max",
                 "pooling_mode_mean_tokens": "mean",
                 "pooling_mode_mean_sqrt_len_tokens": "mean_sqrt_len_tokens",
                 "pooling_mode_weightedmean_tokens": "weightedmean",
                 "pooling_mode_lasttoken": "lasttoken"}


class UnsupportedPooling(ValueError):
    """A checkpoint whose embedding Candor would not compute exactly."""


class PoolingConfig(msgspec.Struct, frozen=True):
    """``dimension``: the pooled vector's size (the hidden size). ``matryoshka``: whether
    ``dimensions`` may shorten it; ``matryoshka_dimensions`` the sizes allowed (empty:
    any 1..dimension). ``source`` says where the method came from (logged, published)."""

    method: Method
    normalize: bool
    dimension: int
    source: str
    matryoshka: bool = False
    matryoshka_dimensions: list[int] = []
    task: Task = "embed"
    labels: list[str] = []  # classify: the label of each logit (config.json id2label)
    # classify: how a (query, document) pair is written before it is tokenized (None: the
    # tokenizer pairs the two texts); cluster.token_classifier
    pair_format: PairFormat | None = None

    def check_dimensions(self, dimensions: int) -> str | None:
        """Why ``dimensions`` cannot be served (None: it can)."""
        if not self.matryoshka:
            return ("this model does not declare Matryoshka support (config.json "
                    "`matryoshka_dimensions` or `is_matryoshka`), so its embeddings cannot "
                    "be shortened")
        allowed = self.matryoshka_dimensions
        if allowed and dimensions not in allowed:
            return f"this model serves dimensions {sorted(allowed)}"
        if not 1 <= dimensions <= self.dimension:
            return f"the embedding has {self.dimension} dimensions; ask for 1..{self.dimension}"
        return None


def _json(path: str) -> Any:
    with open(path, encoding="utf-8") as fh:
        return json.load(fh)


def _mode(config: dict[str, Any], where: str) -> Method:
    mode = config.get("pooling_mode")
    if mode is None:
        on = [name for key, name in _LEGACY_MODES.items() if config.get(key)]
        mode = on[0] if len(on) == 1 else on
    if isinstance(mode, list):
        mode = mode[0] if len(mode) == 1 else mode
    if not isinstance(mode, str) or mode not in _ST_MODES:
        raise UnsupportedPooling(f"{where}: pooling mode {mode!r} is not supported "
                                 f"(supported: {', '.join(sorted(_ST_MODES))})")
    return _ST_MODES[mode]


def _from_sentence_transformers(model_path: str, modules: list[dict[str, Any]]
                                ) -> tuple[Method, bool, str]:
    method: Method | None = None
    normalize = False
    for module in sorted(modules, key=lambda m: m.get("idx", 0)):
        kind = str(module.get("type", "")).rsplit(".", 1)[-1]
        path = module.get("path", "")
        if kind == "Transformer":
            if path not in ("", "."):
                raise UnsupportedPooling(f"modules.json: the Transformer lives in {path!r}; "
                                         "serve that directory (its config.json and weights)")
        elif kind == "Pooling":
            method = _mode(_json(os.path.join(model_path, path, "config.json")),
                           f"{path}/config.json")
        elif kind == "Normalize":
            normalize = True
        else:
            raise UnsupportedPooling(f"modules.json: module {kind!r} ({path}) is not "
                                     "supported (Transformer, Pooling and Normalize are)")
    if method is None:
        raise UnsupportedPooling("modules.json has no Pooling module")
    return method, normalize, "sentence-transformers (modules.json)"


def _check_tokenizer_settings(model_path: str) -> None:
    path = os.path.join(model_path, "sentence_bert_config.json")
    if os.path.isfile(path) and _json(path).get("do_lower_case"):
        raise UnsupportedPooling("sentence_bert_config.json: do_lower_case is not supported")


def _matryoshka(model_path: str, config: dict[str, Any]) -> tuple[bool, list[int]]:
    sources = [config]
    st = os.path.join(model_path, "config_sentence_transformers.json")
    if os.path.isfile(st):
        sources.append(_json(st))
    for source in sources:
        dims = source.get("matryoshka_dimensions")
        if dims:
            return True, sorted(int(d) for d in dims)
        if source.get("is_matryoshka"):
            return True, []
    return False, []


def read_pooling_config(model_path: str) -> PoolingConfig:
    """The pooling a ``--runner pooling`` deployment of ``model_path`` computes."""
    config = read_model_config(model_path)
    archs = [str(a) for a in config.get("architectures") or []]
    if any(a.endswith("ForSequenceClassification") for a in archs):
        return _classifier(config, archs)
    modules_path = os.path.join(model_path, "modules.json")
    if os.path.isfile(modules_path):
        method, normalize, source = _from_sentence_transformers(model_path, _json(modules_path))
        _check_tokenizer_settings(model_path)
    else:
        method, normalize = "last", True
        source = "default: last token, L2-normalised (no sentence-transformers modules.json)"
    matryoshka, dims = _matryoshka(model_path, config)
    return PoolingConfig(method, normalize, int(config["hidden_size"]), source, matryoshka, dims)


def _classifier(config: dict[str, Any], archs: list[str]) -> PoolingConfig:
    """An encoder's head reads the first token; a decoder's (``score``) the last one's
    normed state (HF's ``*ForSequenceClassification`` on an unpadded sequence). A causal
    LM converted from its LM head's rows (``classifier_from_token``) has one label per
    row it makes (``cluster.token_classifier``)."""
    encoder = config.get("model_type") in ENCODER_TYPES
    where = "first" if encoder else "last"
    source = f"{archs[0]}: its classification head on the {where} token"
    try:
        tokens = None if encoder else read_token_classifier(config)
    except ValueError as err:
        raise UnsupportedPooling(f"config.json: {err}") from None
    if tokens is not None:
        n, labels = tokens.num_labels, tokens.labels
        source = (f"{archs[0]} converted from the LM head's rows of {tokens.tokens} "
                  f"({tokens.method}), on the last token")
    else:
        id2label = config.get("id2label") or {}
        n = int(config.get("num_labels") or len(id2label) or 2)
        labels = [str(id2label.get(str(i), id2label.get(i, f"LABEL_{i}"))) for i in range(n)]
    return PoolingConfig("cls" if encoder else "last", False, n, source, task="classify",
                         labels=labels, pair_format=pair_format(config))


def auto_runner(model_path: str) -> str:
    """``--runner auto``: pooling for a checkpoint without a language-model head (its
    architectures name a base model, ``Qwen3Model``, as sentence-transformers saves
    one, or a classifier, ``BertForSequenceClassification``), generate otherwise (vLLM's rule for ``*Model`` architectures)."""
    archs = read_model_config(model_path).get("architectures") or []
    if archs and all(str(a).endswith(("Model", "ForSequenceClassification")) for a in archs):
        return "pooling"
    return "generate"
