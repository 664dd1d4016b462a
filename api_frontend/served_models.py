"""The models this deployment serves, by the name a request's ``model`` field uses.

One topology may serve several models behind the same frontends (``Topology.models``),
each of one runner: generate (completions, chat, responses, render) or pooling
(embeddings). A request is routed by its ``model`` to that model's engines
(``EngineClient.view``); a name no model has is a 404 listing every served name, and a
route of the other kind is a 400 naming the model's runner and the routes it serves.
"""

from __future__ import annotations

from dataclasses import dataclass

import msgspec

from api_frontend.errors import ApiError
from cluster.pooling import PoolingConfig
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

    @property
    def names(self) -> list[str]:
        return [self.card.id, *self.aliases]


class ServedModels:
    def __init__(self, models: list[ServedModel]) -> None:
        self.models = models

    @property
    def primary(self) -> ServedModel:
        return self.models[0]

    def names(self) -> list[str]:
        return [name for m in self.models for name in m.names]

    def cards(self) -> list[ModelCard]:
        """Every served name's card (an alias shares its model's)."""
        return [msgspec.structs.replace(m.card, id=name) for m in self.models
                for name in m.names]

    def find(self, name: str) -> tuple[ServedModel, ModelCard]:
        """The model ``name`` reaches, and its card under that name (responses carry the
        name the client used); 404 naming every served name otherwise."""
        for m in self.models:
            if name in m.names:
                return m, msgspec.structs.replace(m.card, id=name)
        served = ", ".join(repr(n) for n in self.names())
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
