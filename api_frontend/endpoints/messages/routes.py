"""The ``/v1/messages`` routes: create (whole or streamed) and count_tokens.

Create runs on the chat pipeline (``translate.to_chat`` → ``chat_to_generate`` → one
``Flight``), reports under the Messages field names (the ``messages`` tiers), waits for the
tokenizer worker's RequestInfo before the first byte (so a request error is an HTTP 4xx,
not a failed stream), then answers with the ``MessageBuilder``'s body or events.
count_tokens renders the same prompt on a tokenizer worker and counts it. Errors take
Anthropic's shape (``errors.error_body``); ``?beta=true`` and the ``anthropic-version`` /
``anthropic-beta`` headers are accepted and change nothing.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid

import msgspec
from aiohttp import web

from api_frontend.app_keys import API_KEY, MEDIA_KEY, MODELS_KEY
from api_frontend.endpoints.chat.translate import chat_to_generate
from api_frontend.endpoints.messages.builder import MessageBuilder
from api_frontend.endpoints.messages.errors import error_body
from api_frontend.endpoints.messages.fields import TABLE, UNKNOWN_REASON
from api_frontend.endpoints.messages.translate import ChatPlan, messages_name, to_chat
from api_frontend.endpoints.spec import Endpoint, Route
from api_frontend.errors import ApiError
from api_frontend.field_policy import nested_unknown
from api_frontend.extra_routes import ask
from api_frontend.generate import Flight, client_request_id, complete_report
from api_frontend.json_body import decode_request, json_response
from api_frontend.served_models import adapter_of
from api_frontend.translate import Translated
from cluster.topology import ApiSpec
from protocol import ipc
from protocol.anthropic_api import (CountTokensRequest, CountTokensResponse, Message,
                                    MessagesRequest, Usage)
from protocol.openai_api import FieldNote

log = logging.getLogger("api_frontend")
_JSON = msgspec.json.Encoder()
ROUTE = "/v1/messages"
COUNT_ROUTE = ROUTE + "/count_tokens"


def _translate(req: CountTokensRequest, keys, rid: str, reply_to: str, arrival: float,
               api: ApiSpec, vision: bool = False) -> tuple[ChatPlan, Translated]:
    """The chat request and its GenerateReq, with the report under this request's names:
    ignored fields (top-level and nested) and extensions as the Messages tiers say,
    chat's defaults, parsers and constraint; errors renamed."""
    report = TABLE.report(keys, req, api)  # strict: a 400 before any work
    plan = to_chat(req, api, vision)  # its errors name this request's fields already
    # fields inside the request's objects that its typed decode dropped
    plan.notes[:0] = [FieldNote(path, UNKNOWN_REASON) for path in nested_unknown(keys, req)]
    try:
        tr = chat_to_generate(plan.chat, rid, reply_to, arrival, plan.chat_keys, api,
                              vision=vision)
    except ApiError as err:
        raise messages_name(err, plan.images) from None
    gen = tr.gen
    if gen.guided is not None and gen.guided.field.startswith("response_format"):
        gen.guided = msgspec.structs.replace(gen.guided, field="output_config.format.schema")
    chat_report = tr.report
    if chat_report.constraint is not None:
        chat_report.constraint = messages_name(ApiError(400, "", chat_report.constraint)).param
    tr.report = msgspec.structs.replace(chat_report, ignored=report.ignored + plan.notes,
                                        extensions=report.extensions)
    if tr.report.strict and plan.notes:
        note = plan.notes[0]
        raise ApiError(400, f"`{note.field}` would be ignored ({note.reason}); strict mode "
                       "turns ignored fields into errors", note.field, "ignored_field")
    return plan, tr


async def create(request: web.Request) -> web.StreamResponse:
    models, api = request.app[MODELS_KEY], request.app[API_KEY]
    req, keys = decode_request(await request.read(), MessagesRequest)
    model, card = models.of_kind(req.model, "generate", ROUTE)
    engine = model.engine
    rid = f"msg_{uuid.uuid4().hex}"
    plan, tr = _translate(req, keys, rid, engine.reply_to, time.time(), api, model.vision)
    tr.gen.lora = adapter_of(card)
    flight = Flight(engine, tr, api, request.app[MEDIA_KEY])
    response_key = client_request_id(request) or rid
    try:
        try:
            info = (await flight.start())[tr.gen.rid]
        except ApiError as err:  # (the tokenizer worker's: a bad image names its block)
            raise messages_name(err, plan.images) from None
        ours = {id(n) for n in tr.report.ignored}  # named as this request named them
        report = complete_report(tr.report, info)
        for note in report.ignored + report.clamped:  # the rest carry chat's names
            if id(note) not in ours:
                note.field = messages_name(ApiError(400, "", note.field)).param
        report.deterministic = flight.deterministic()
        headers = {"X-Request-Id": response_key,
                   "x-candor-adjustments": _JSON.encode(report).decode()}
        builder = MessageBuilder(Message(rid, card.id, [], Usage(0, 0), candor=report),
                                 tr.tools, tr.reasoning, streaming=req.stream)
        if not req.stream:
            async for d in flight.deltas():
                builder.feed(d)
                flight.finished(d)
            builder.finish()
            engine.record_finish(response_key, builder.finish_reason)
            return json_response(builder.message, headers=headers)
        return await _stream(request, engine, flight, builder, headers, response_key)
    except (asyncio.CancelledError, ConnectionResetError):
        log.info("client went away: %s (X-Request-Id %s)", rid, client_request_id(request))
        raise
    finally:
        await flight.close()


async def _stream(request: web.Request, engine, flight: Flight, builder: MessageBuilder,
                  headers: dict[str, str], response_key: str) -> web.StreamResponse:
    response = web.StreamResponse(headers={**headers, "Content-Type": "text/event-stream",
                                           "Cache-Control": "no-cache"})
    await response.prepare(request)
    try:
        async for d in flight.deltas():
            builder.feed(d)
            flight.finished(d)
            frames = builder.take()
            if frames:
                await response.write(frames)
        builder.finish()
    except ApiError as err:  # after the first byte: an error event
        builder.fail(messages_name(err))
    await response.write(builder.take())
    await response.write_eof()
    engine.record_finish(response_key, builder.finish_reason)
    return response


async def count_tokens(request: web.Request) -> web.Response:
    """The prompt tokens a create with these fields would have (its ``input_tokens`` +
    ``cache_read_input_tokens``), rendered and counted by a tokenizer worker."""
    models, api = request.app[MODELS_KEY], request.app[API_KEY]
    req, keys = decode_request(await request.read(), CountTokensRequest)
    model, _ = models.of_kind(req.model, "generate", COUNT_ROUTE)
    engine = model.engine
    rid = f"count-{uuid.uuid4().hex}"
    plan, tr = _translate(req, keys, rid, engine.reply_to, 0.0, api, model.vision)
    try:
        await request.app[MEDIA_KEY].inline(tr.gen.messages)
        result = await ask(engine, ipc.RenderReq(rid, engine.reply_to, gen=tr.gen))
    except ApiError as err:
        raise messages_name(err, plan.images) from None
    return json_response(CountTokensResponse(len(result.token_ids)))


ENDPOINT = Endpoint(
    fields=TABLE, path=ROUTE, runner="generate", serves="messages",
    routes=(Route("POST", ROUTE, create, MessagesRequest),
            Route("POST", COUNT_ROUTE, count_tokens, CountTokensRequest)),
    listed=(ROUTE, COUNT_ROUTE), error_body=error_body)
