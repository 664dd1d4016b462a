"""Endpoints around generation: render (for the chat and completions endpoints),
tokenize, detokenize, tokenizer_info.

Render and (de)tokenize run on a tokenizer worker like any request (the frontend never
tokenizes): a RenderReq goes out and a RenderResult (or RequestError) comes back.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable
from typing import Any

import msgspec
from aiohttp import web

from api_frontend.app_keys import API_KEY, MEDIA_KEY, MODELS_KEY
from api_frontend.engine_client import EngineClient
from api_frontend.errors import ApiError
from api_frontend.generate import complete_report
from api_frontend.json_body import decode, decode_request, json_response
from api_frontend.served_models import ServedModels
from api_frontend.translate import Translated
from cluster.topology import ApiSpec
from protocol import ipc
from protocol.openai_api import (DetokenizeRequest, DetokenizeResponse, RenderResponse,
                                 TemplateRef, TokenizeRequest, TokenizeResponse,
                                 TokenizerInfoResponse)


async def ask(engine: EngineClient, req: ipc.RenderReq) -> ipc.RenderResult:
    """One RenderReq to a tokenizer worker, and its RenderResult (an error raised)."""
    queue = await engine.submit(req)
    try:
        msg = await queue.get()
    finally:
        engine.release(req.rid)
    if isinstance(msg, ipc.RequestError):
        raise ApiError.from_engine(msg)
    return msg


def _template(result: ipc.RenderResult) -> TemplateRef | None:
    t = result.template
    return None if t is None else TemplateRef(t.source, t.origin, t.sha256)


async def render(request: web.Request, kind: type, translate: Callable[..., Translated],
                 check: Callable[[Any], None] | None = None) -> web.Response:
    """The prompt text, ids and template provenance a generation request of ``kind``
    would get (``check``: what the endpoint refuses to render)."""
    parsed, keys = decode_request(await request.read(), kind)
    model, card = request.app[MODELS_KEY].of_kind(parsed.model, "generate", request.path)
    if check is not None:
        check(parsed)
    engine = model.engine
    rid = f"render-{uuid.uuid4().hex}"
    tr = translate(parsed, rid, engine.reply_to, 0.0, keys, request.app[API_KEY],
                   vision=model.vision)
    await request.app[MEDIA_KEY].inline(tr.gen.messages)
    result = await ask(engine, ipc.RenderReq(rid, engine.reply_to, gen=tr.gen))
    info = ipc.RequestInfo(rid, len(result.token_ids), result.template, result.adjustments)
    return json_response(RenderResponse(result.prompt_text, result.token_ids, card.id,
                                        _template(result), complete_report(tr.report, info)))


def _model(models: ServedModels, name: str | None):
    """The served model a request names (none named: the first)."""
    return models.find(name)[0] if name is not None else models.primary


async def tokenize(request: web.Request, models: ServedModels, api: ApiSpec) -> web.Response:
    body = decode(await request.read(), TokenizeRequest)
    model = _model(models, body.model)
    engine, card = model.engine, model.card
    if (body.prompt is None) == (body.messages is None):
        raise ApiError(400, "send exactly one of `prompt` or `messages`", "prompt",
                       "invalid_value")
    rid = f"tok-{uuid.uuid4().hex}"
    if body.messages is not None:
        add_generation_prompt = body.add_generation_prompt
        continue_final = bool(body.continue_final_message)
        if add_generation_prompt is None:
            add_generation_prompt = not continue_final
        if add_generation_prompt and continue_final:
            raise ApiError(400, "`add_generation_prompt` and `continue_final_message` cannot "
                           "both be true", "continue_final_message", "invalid_value")
        if body.chat_template is not None and not api.allow_request_chat_template:
            raise ApiError(400, "`chat_template` in a request is disabled on this deployment "
                           "(start the server with --allow-request-chat-template)",
                           "chat_template", "unsupported_field")
        gen = ipc.GenerateReq(rid, engine.reply_to, ipc.SamplingParams(), ipc.DetokParams(),
                              messages=[msgspec.to_builtins(m) for m in body.messages],
                              tools=body.tools, add_generation_prompt=add_generation_prompt,
                              continue_final_message=continue_final,
                              chat_template_kwargs=dict(body.chat_template_kwargs or {}),
                              chat_template=body.chat_template, strict=api.strict)
        if model.vision:  # (a text model refuses the image unfetched)
            await request.app[MEDIA_KEY].inline(gen.messages)
    else:
        chat_only = [name for name in ("add_generation_prompt", "continue_final_message",
                                       "chat_template", "chat_template_kwargs", "tools")
                     if getattr(body, name) is not None]
        if chat_only:
            raise ApiError(400, f"`{chat_only[0]}` applies to the chat form (`messages`), not "
                           "to `prompt`", chat_only[0], "invalid_value")
        gen = ipc.GenerateReq(rid, engine.reply_to, ipc.SamplingParams(), ipc.DetokParams(),
                              prompt=body.prompt)
    result = await ask(engine, ipc.RenderReq(
        rid, engine.reply_to, gen=gen, with_token_strs=bool(body.return_token_strs),
        tokenize_only=True, add_special_tokens=body.add_special_tokens))
    return json_response(TokenizeResponse(len(result.token_ids), card.max_model_len,
                                          result.token_ids, result.token_strs))


async def detokenize(request: web.Request, models: ServedModels) -> web.Response:
    body = decode(await request.read(), DetokenizeRequest)
    engine = _model(models, body.model).engine
    rid = f"detok-{uuid.uuid4().hex}"
    result = await ask(engine, ipc.RenderReq(rid, engine.reply_to, token_ids=body.tokens))
    return json_response(DetokenizeResponse(result.prompt_text))


async def tokenizer_info(engine: EngineClient) -> web.Response:
    """vLLM's GET /tokenizer_info: tokenizer_config.json's settings overlaid with what this
    server actually applies (context, chat template, special tokens)."""
    rid = f"tokinfo-{uuid.uuid4().hex}"
    result = await ask(engine, ipc.RenderReq(rid, engine.reply_to, tokenizer_info=True))
    info = result.tokenizer_info
    if info is None:
        raise ApiError(500, "the tokenizer worker sent no tokenizer description", None,
                       "tokenizer_error", type="internal_error")
    special = info.special_tokens
    effective = TokenizerInfoResponse(
        tokenizer_class=info.tokenizer_class, model_max_length=info.model_max_length,
        vocab_size=info.vocab_size, eos_token_ids=info.eos_token_ids,
        bos_token=special.get("bos_token"), eos_token=special.get("eos_token"),
        pad_token=special.get("pad_token"), unk_token=special.get("unk_token"),
        chat_template=info.chat_template)
    return json_response({**info.config, **special, **msgspec.to_builtins(effective)})
