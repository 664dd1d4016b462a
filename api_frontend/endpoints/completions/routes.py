"""The /v1/completions routes: generation (whole or streamed) and its render."""

from __future__ import annotations

from aiohttp import web

from api_frontend import extra_routes
from api_frontend.endpoints.completions.assembler import CompletionAssembler
from api_frontend.endpoints.completions.fields import TABLE
from api_frontend.endpoints.completions.translate import completion_to_generate, prompt_list
from api_frontend.endpoints.spec import Endpoint, Route
from api_frontend.errors import ApiError
from api_frontend.generate import Generation, serve_generation
from api_frontend.translate import Translated
from protocol import ipc
from protocol.openai_api import CandorReport, CompletionRequest, ModelCard

PATH = "/v1/completions"


def _assembler(rid: str, created: int, card: ModelCard, req: CompletionRequest,
               tr: Translated, report: CandorReport,
               infos: list[ipc.RequestInfo]) -> CompletionAssembler:
    """``infos``: each prompt's (its text and token offsets, for echo)."""
    echo = offsets = None
    if req.echo:
        echo = [info.prompt_text or "" for info in infos]
        offsets = [info.prompt_offsets or [] for info in infos]
    return CompletionAssembler(rid, created, card.id, req.return_token_ids, n=tr.n,
                               report=report, logprobs=req.logprobs is not None,
                               logprobs_k=tr.gen.sampling.logprobs,
                               prompt_logprobs_k=req.prompt_logprobs, echo_texts=echo,
                               echo_offsets=offsets, prompts=len(tr.gens))


GENERATION = Generation(CompletionRequest, "cmpl", completion_to_generate, _assembler)


async def completions(request: web.Request) -> web.StreamResponse:
    return await serve_generation(request, GENERATION)


def _one_prompt(req: CompletionRequest) -> None:
    if len(prompt_list(req)) > 1:
        raise ApiError(400, "render takes one prompt; send each prompt on its own", "prompt",
                       "invalid_value")


async def render(request: web.Request) -> web.Response:
    return await extra_routes.render(request, CompletionRequest, completion_to_generate,
                                     _one_prompt)


ENDPOINT = Endpoint(
    fields=TABLE, path=PATH, runner="generate", serves="completions",
    routes=(Route("POST", PATH, completions, CompletionRequest),
            Route("POST", f"{PATH}/render", render, CompletionRequest)),
    listed=(PATH, f"{PATH}/render"))
