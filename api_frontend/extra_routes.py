"""Endpoints around generation: capabilities, render, tokenize, detokenize.

Render and (de)tokenize run on a tokenizer worker like any request (the frontend never
tokenizes): a RenderReq goes out and a RenderResult (or RequestError) comes back.
"""

from __future__ import annotations

import uuid

import msgspec
from aiohttp import web

from api_frontend import field_policy
from api_frontend.engine_client import EngineClient
from api_frontend.errors import ApiError
from api_frontend.generate import complete_report
from api_frontend.json_body import decode, json_response
from api_frontend.served_models import ROUTES, ServedModels
from api_frontend.translate import chat_to_generate, completion_to_generate
from cluster.topology import ApiSpec, LoraSpec
from protocol import ipc
from protocol.openai_api import (ChatCompletionRequest, DetokenizeRequest,
                                 DetokenizeResponse, ModelCard, RenderResponse, TemplateRef,
                                 TokenizeRequest, TokenizeResponse, TokenizerInfoResponse)


async def _ask(engine: EngineClient, req: ipc.RenderReq) -> ipc.RenderResult:
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


async def render(request: web.Request, engine: EngineClient, card: ModelCard, api: ApiSpec,
                 parsed, keys: list[str]) -> web.Response:
    """The prompt text, ids and template provenance a generation request would get."""
    rid = f"render-{uuid.uuid4().hex}"
    translate = (chat_to_generate if isinstance(parsed, ChatCompletionRequest)
                 else completion_to_generate)
    tr = translate(parsed, rid, engine.reply_to, 0.0, keys, api)
    result = await _ask(engine, ipc.RenderReq(rid, engine.reply_to, gen=tr.gen))
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
    else:
        chat_only = [name for name in ("add_generation_prompt", "continue_final_message",
                                       "chat_template", "chat_template_kwargs", "tools")
                     if getattr(body, name) is not None]
        if chat_only:
            raise ApiError(400, f"`{chat_only[0]}` applies to the chat form (`messages`), not "
                           "to `prompt`", chat_only[0], "invalid_value")
        gen = ipc.GenerateReq(rid, engine.reply_to, ipc.SamplingParams(), ipc.DetokParams(),
                              prompt=body.prompt)
    result = await _ask(engine, ipc.RenderReq(
        rid, engine.reply_to, gen=gen, with_token_strs=bool(body.return_token_strs),
        tokenize_only=True, add_special_tokens=body.add_special_tokens))
    return json_response(TokenizeResponse(len(result.token_ids), card.max_model_len,
                                          result.token_ids, result.token_strs))


async def detokenize(request: web.Request, models: ServedModels) -> web.Response:
    body = decode(await request.read(), DetokenizeRequest)
    engine = _model(models, body.model).engine
    rid = f"detok-{uuid.uuid4().hex}"
    result = await _ask(engine, ipc.RenderReq(rid, engine.reply_to, token_ids=body.tokens))
    return json_response(DetokenizeResponse(result.prompt_text))


async def tokenizer_info(engine: EngineClient) -> web.Response:
    """vLLM's GET /tokenizer_info: tokenizer_config.json's settings overlaid with what this
    server actually applies (context, chat template, special tokens)."""
    rid = f"tokinfo-{uuid.uuid4().hex}"
    result = await _ask(engine, ipc.RenderReq(rid, engine.reply_to, tokenizer_info=True))
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


DETERMINISM_SCOPE = (
    "a greedy or seeded request gets bitwise the same tokens and logprobs (top_logprobs and "
    "prompt logprobs included) alone or inside any batch, on a prefix-cache hit or miss, under "
    "any --max-num-batched-tokens, preempted or not, on any replica and after a restart, within "
    "one deployment (same hardware, software, flags and tensor-parallel size)")


def determinism(stats: ipc.SchedulerStats | None) -> dict:
    """Which numerics the engine runs (``enabled`` None until it has reported)."""
    known = stats is not None and stats.worker_ready
    return {"enabled": stats.deterministic if known else None,
            "note": stats.deterministic_note if known else "the engine has not reported yet",
            "scope": DETERMINISM_SCOPE}


def capabilities(models: ServedModels, api: ApiSpec, stats: ipc.SchedulerStats | None = None,
                 lora: LoraSpec | None = None) -> web.Response:
    """The tier of every request field under this deployment's flags, and each served
    model's runner (what it serves) and, for an embedding model, its pooling; the
    numerics the engine runs; the LoRA settings (adapters are named in ``model``;
    /v1/models lists them)."""
    lora = lora or LoraSpec()
    card = models.primary.card
    generate, pooling = models.serves("generate"), models.serves("pooling")
    fields, endpoints = {}, ["/v1/models"]
    if generate:
        fields.update({"/v1/chat/completions": field_policy.tiers("chat", api),
                       "/v1/completions": field_policy.tiers("completions", api),
                       "/v1/responses": field_policy.tiers("responses", api)})
        endpoints += ["/v1/completions", "/v1/chat/completions", "/v1/responses",
                      "/v1/responses/{id}", "/v1/responses/{id}/input_items",
                      "/v1/completions/render", "/v1/chat/completions/render"]
    if pooling:
        fields["/v1/embeddings"] = field_policy.tiers("embeddings", api)
        endpoints.append("/v1/embeddings")
    if generate and lora.enabled and lora.allow_runtime_updates:
        endpoints += ["/v1/load_lora_adapter", "/v1/unload_lora_adapter"]
    endpoints += ["/tokenize", "/detokenize", "/tokenizer_info", "/v1/capabilities", "/health"]
    return json_response({
        "object": "capabilities",
        "model": card.id,
        "max_model_len": card.max_model_len,
        "serves": (["chat.completions", "completions", "responses"] if generate else [])
        + (["embeddings"] if pooling else []),
        "models": [{"id": m.card.id, "aliases": m.aliases, "runner": m.runner,
                    "routes": ROUTES[m.runner], "max_model_len": m.card.max_model_len,
                    "pooling": msgspec.to_builtins(m.pooling) if m.pooling else None}
                   for m in models.models],
        "policy": msgspec.to_builtins(api),
        "limits": msgspec.to_builtins(api.limits),
        "lora": {"enabled": lora.enabled, "max_loras": lora.max_loras,
                 "max_lora_rank": lora.max_lora_rank, "max_cpu_loras": lora.host_capacity,
                 "runtime_updates": lora.enabled and lora.allow_runtime_updates},
        "tiers": field_policy.TIER_MEANINGS,
        "deterministic": determinism(stats),
        "fields": fields,
        "endpoints": endpoints,
    })
