"""A /v1/completions body -> one GenerateReq per prompt: the generation pipeline's part
(``api_frontend.translate``) plus prompts, echo and the legacy default length."""

from __future__ import annotations

from api_frontend.endpoints.completions.fields import TABLE
from api_frontend.errors import ApiError
from api_frontend.translate import Translated, checked, common, constraint, translated
from cluster.topology import ApiSpec
from protocol import ipc
from protocol.openai_api import CompletionRequest

# The legacy completions contract documents a default of 16 tokens; chat's default is
# "until the context is full", which is what None means downstream.
COMPLETIONS_DEFAULT_MAX_TOKENS = 16


def logprobs_k(req: CompletionRequest) -> tuple[int, int]:
    """(logprobs, prompt_logprobs). Echo + logprobs and ``prompt_logprobs`` share one
    prompt computation at the larger k; the response trims each to its own."""
    prompt_k = -1 if req.prompt_logprobs is None else req.prompt_logprobs
    k = -1 if req.logprobs is None else req.logprobs
    return k, max(prompt_k, k if req.echo and k >= 0 else -1)


def prompt_list(req: CompletionRequest) -> list[str | list[int]]:
    """``prompt`` as a list of prompts: a string, a list of token ids, a list of strings
    or a list of token-id lists (one kind, every prompt non-empty)."""
    prompt = req.prompt
    if isinstance(prompt, str) or not prompt or all(isinstance(p, int) for p in prompt):
        prompts = [prompt]
    else:
        if len({type(p) for p in prompt}) != 1:
            raise ApiError(400, "`prompt` must be a string, a list of token ids, a list of "
                           "strings or a list of token-id lists, not a mix", "prompt",
                           "invalid_value")
        prompts = list(prompt)
    for i, p in enumerate(prompts):
        if not p:
            where = "prompt" if len(prompts) == 1 else f"prompt[{i}]"
            raise ApiError(400, f"`{where}` must not be empty", where, "invalid_value")
    return prompts


def completion_to_generate(req: CompletionRequest, rid: str, reply_to: str, arrival: float,
                           raw_keys: list[str] = (), api: ApiSpec | None = None, *,
                           vision: bool = False) -> Translated:
    """(``vision`` is the chat translation's: a completions prompt is text, whatever the
    model takes; the tokenizer worker refuses an image placeholder spelled in it.)"""
    api = api or ApiSpec()
    report = checked(req, raw_keys, api, TABLE)
    prompts = prompt_list(req)
    max_tokens = COMPLETIONS_DEFAULT_MAX_TOKENS if req.max_tokens is None else req.max_tokens
    fields = common(req, rid, reply_to, arrival, report, logprobs_k)
    guided = constraint(req, None, report)
    gens = [ipc.GenerateReq(prompt=p, max_tokens=max_tokens, echo_prompt=req.echo,
                            guided=guided, **fields) for p in prompts]
    return translated(gens, req, report)
