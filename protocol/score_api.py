"""Request and response bodies of the scoring routes a pooling model serves, in vLLM's
shapes: ``/v1/score`` (text_1 x text_2), ``/v1/rerank`` and ``/v2/rerank`` (Jina's and
Cohere's: a query and documents), ``/classify`` (labels and probabilities)."""

from __future__ import annotations

import msgspec

from protocol.openai_api import CandorReport, PositiveInt, Priority, UNSET, UnsetType


class ScoreRequest(msgspec.Struct, kw_only=True):
    model: str
    text_1: str | list[str]
    text_2: str | list[str]
    user: str | None = None
    priority: Priority = 0
    strict: bool = False


class ScoreData(msgspec.Struct):
    index: int
    score: float
    object: str = "score"


class ScoreUsage(msgspec.Struct):
    prompt_tokens: int
    total_tokens: int


class ScoreResponse(msgspec.Struct, kw_only=True):
    id: str
    object: str = "list"
    created: int
    model: str
    data: list[ScoreData]
    usage: ScoreUsage
    candor: CandorReport | UnsetType = UNSET


class RerankRequest(msgspec.Struct, kw_only=True):
    model: str
    query: str
    documents: list[str]
    top_n: PositiveInt | None = None
    return_documents: bool = True
    user: str | None = None
    priority: Priority = 0
    strict: bool = False


class RerankDocument(msgspec.Struct):
    text: str


class RerankResult(msgspec.Struct, omit_defaults=True):
    index: int
    relevance_score: float
    document: RerankDocument | None = None


class RerankUsage(msgspec.Struct):
    total_tokens: int


class RerankResponse(msgspec.Struct, kw_only=True):
    id: str
    model: str
    usage: RerankUsage
    results: list[RerankResult]
    candor: CandorReport | UnsetType = UNSET


class ClassifyRequest(msgspec.Struct, kw_only=True):
    model: str
    input: str | list[str]
    user: str | None = None
    priority: Priority = 0
    strict: bool = False


class ClassifyData(msgspec.Struct):
    index: int
    label: str
    probs: list[float]
    num_classes: int


class ClassifyResponse(msgspec.Struct, kw_only=True):
    id: str
    object: str = "list"
    created: int
    model: str
    data: list[ClassifyData]
    usage: ScoreUsage
    candor: CandorReport | UnsetType = UNSET
