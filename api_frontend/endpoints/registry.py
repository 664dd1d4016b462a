"""Every endpoint the frontend serves, in the order /v1/capabilities and /openapi.json
list them. A new endpoint is its folder under ``endpoints/`` and one line here."""

from __future__ import annotations

from api_frontend.endpoints.chat.routes import ENDPOINT as CHAT
from api_frontend.endpoints.classify.routes import ENDPOINT as CLASSIFY
from api_frontend.endpoints.completions.routes import ENDPOINT as COMPLETIONS
from api_frontend.endpoints.embeddings.routes import ENDPOINT as EMBEDDINGS
from api_frontend.endpoints.rerank.routes import ENDPOINT as RERANK
from api_frontend.endpoints.messages.routes import ENDPOINT as MESSAGES
from api_frontend.endpoints.responses.routes import ENDPOINT as RESPONSES
from api_frontend.endpoints.score.routes import ENDPOINT as SCORE
from api_frontend.endpoints.spec import Endpoint

ENDPOINTS: tuple[Endpoint, ...] = (CHAT, COMPLETIONS, RESPONSES, MESSAGES, EMBEDDINGS,
                                   SCORE, RERANK, CLASSIFY)
