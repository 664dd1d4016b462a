"""The models this deployment serves, by the name a request's ``model`` field uses.

One topology may serve several models behind the same frontends (``Topology.models``),
each of one runner: generate (completions, chat, responses, render) or pooling
(embeddings). A request is routed by its ``model`` to that model's engines
(``EngineClient.view``); a name no model has is a 404 listing every served name, and a
route of the other kind is a 400 naming the model's runner and the routes it serves.
LoRA adapters (``--enable-lora``) are names too: each reaches the generation model it
was trained on (the first generation model), with a card whose ``parent`` says so.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

import msgspec

from api_frontend.errors import ApiError
from cluster.pooling import PoolingConfig
from protocol.ipc import LoraAdapterInfo
from protocol.openai_api import ModelCard

ROUTES = {"generate": "/v1/chat/completions, /v1/completions and /v1/responses",
          "pooling": "/v1/embeddings"}
KIND = {"generate": "a text generation model (runner generate)",
        "pooling": "an embedding model (runner pooling)"}


@dataclass
class ServedModel:
    card: ModelCard
    aliases: list[str]
    runner: str  # generate | pooling
    engine: object  # an EngineClient view that reaches this model's processes
    pooling: PoolingConfig | None = None  # a pooling model's method, size, Matryoshka
    vision: bool = False  # requests may carry images (chat image_url parts and their kin)

    @property
    def names(self) -> list[str]:
        return [self.card.id, *self.aliases]


class ServedModels:
    def __init__(self, models: list[ServedModel],
                 adapters: Callable[[], Mapping[str, LoraAdapterInfo]] = dict) -> None:
        self.models = models
        self.adapters = adapters  # the LoRA adapters served now (loads change them)

    @property
    def lora_base(self) -> ServedModel | None:
        """The model LoRA adapters apply to: the first generation model."""
        return next((m for m in self.models if m.runner == "generate"), None)

    @property
    def primary(self) -> ServedModel:
        return self.models[0]

    def names(self) -> list[str]:
        return [name for m in self.models for name in m.names]

    def cards(self) -> list[ModelCard]:
        """Every served name's card (an alias shares its model's; an adapter's names its
        ``parent``)."""
        base = self.lora_base
        adapters = [adapter_card(base.card, a) for a in self.adapters().values()] if base else []
        return [msgspec.structs.replace(m.card, id=name) for m in self.models
                for name in m.names] + adapters

    def find(self, name: str) -> tuple[ServedModel, ModelCard]:
        """The model ``name`` reaches, and its card under that name (responses carry the
        name the client used); 404 naming every served name otherwise."""
        for m in self.models:
            if name in m.names:
                return m, msgspec.structs.replace(m.card, id=name)
        adapters = self.adapters()
        base = self.lora_base
        if base is not None and name in adapters:
            return base, adapter_card(base.card, adapters[name])
        served = ", ".join(repr(n) for n in (*self.names(), *adapters))
        raise ApiError(404, f"The model {name!r} does not exist on this deployment. "
                       f"Served models: [{served}]", "model", "model_not_found")

    def of_kind(self, name: str, runner: str, route: str) -> tuple[ServedModel, ModelCard]:
        """``find``, and a 400 when the model is not a ``runner`` model."""
        model, card = self.find(name)
        if model.runner != runner:
            raise ApiError(400, f"The model {name!r} is {KIND[model.runner]}: it serves "
                           f"{ROUTES[model.runner]}, not {route}.{self._others(runner)}",
                           "model", "wrong_model_runner")
        return model, card

    def _others(self, runner: str) -> str:
        names = [m.card.id for m in self.models if m.runner == runner]
        return f" Models served here for {ROUTES[runner]}: {names}." if names else ""

    def serves(self, runner: str) -> bool:
        return any(m.runner == runner for m in self.models)

    def describe(self) -> str:
        """What this deployment serves, for a 404 on a route none of its models has."""
        return "; ".join(f"{KIND[m.runner]} {m.card.id!r} on {ROUTES[m.runner]}"
                         for m in self.models)


def adapter_card(base: ModelCard, adapter: LoraAdapterInfo) -> ModelCard:
    return msgspec.structs.replace(base, id=adapter.name, root=adapter.path,
                                   parent=adapter.parent or base.id)


def adapter_of(card: ModelCard) -> str | None:
    """The LoRA adapter a card (from ``ServedModels.find``) names; None: a model."""
    return card.id if card.parent is not None else None
