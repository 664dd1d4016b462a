"""The /v1/chat/completions routes: generation (whole or streamed) and its render."""

from __future__ import annotations

from aiohttp import web

from api_frontend import extra_routes
from api_frontend.endpoints.chat.assembler import ChatAssembler
from api_frontend.endpoints.chat.fields import TABLE
from api_frontend.endpoints.chat.translate import chat_to_generate
from api_frontend.endpoints.spec import Endpoint, Route
from api_frontend.generate import Generation, serve_generation
from api_frontend.translate import Translated
from protocol import ipc
from protocol.openai_api import CandorReport, ChatCompletionRequest, ModelCard

PATH = "/v1/chat/completions"


def _echo(req: ChatCompletionRequest) -> str | None:
    """vLLM's chat echo: the final message's content, when it is the assistant's."""
    if not req.echo or not req.messages or req.messages[-1].role != "assistant":
        return None
    content = req.messages[-1].content
    if isinstance(content, list):
        return "\n".join(p.text or "" for p in content if p.type == "text")
    return content or ""


def _assembler(rid: str, created: int, card: ModelCard, req: ChatCompletionRequest,
               tr: Translated, report: CandorReport,
               infos: list[ipc.RequestInfo]) -> ChatAssembler:
    return ChatAssembler(rid, created, card.id, req.return_token_ids, n=tr.n, report=report,
                         logprobs=bool(req.logprobs), logprobs_k=tr.gen.sampling.logprobs,
                         prompt_logprobs_k=req.prompt_logprobs, echo_text=_echo(req),
                         tools=tr.tools, reasoning_parser=tr.reasoning)


GENERATION = Generation(ChatCompletionRequest, "chatcmpl", chat_to_generate, _assembler)


async def chat_completions(request: web.Request) -> web.StreamResponse:
    return await serve_generation(request, GENERATION)


async def render(request: web.Request) -> web.Response:
    return await extra_routes.render(request, ChatCompletionRequest, chat_to_generate)


ENDPOINT = Endpoint(
    fields=TABLE, path=PATH, runner="generate", serves="chat.completions",
    routes=(Route("POST", PATH, chat_completions, ChatCompletionRequest),
            Route("POST", f"{PATH}/render", render, ChatCompletionRequest)),
    listed=(PATH, f"{PATH}/render"))
