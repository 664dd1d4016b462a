"""The ``/v1/responses`` routes: create (whole or streamed), retrieve, delete, input items.

Create runs on the chat pipeline (``translate.to_chat`` → ``chat_to_generate`` → one
``Flight``), reports under the Responses field names (the field table's ``responses``
tiers), waits for the tokenizer worker's RequestInfo before the first byte (so a request
error is an HTTP 4xx, not a failed stream), then answers with the ``ResponseBuilder``'s
body or events. A stored response is kept before its terminal event is written, so a
client that continues at once finds it.
"""

from __future__ import annotations

import asyncio
import logging
import time

import msgspec
from aiohttp import web

from api_frontend.app_keys import API_KEY, MEDIA_KEY, MODELS_KEY
from api_frontend.endpoints.chat.translate import chat_to_generate
from api_frontend.endpoints.responses.builder import ResponseBuilder
from api_frontend.endpoints.responses.fields import TABLE
from api_frontend.endpoints.responses.peers import ResponsePeers
from api_frontend.endpoints.responses.translate import ChatPlan, responses_name, to_chat
from api_frontend.endpoints.spec import Endpoint, Route
from api_frontend.errors import ApiError
from api_frontend.generate import Flight, client_request_id, complete_report
from api_frontend.json_body import decode_request, json_response
from api_frontend.served_models import adapter_of
from api_frontend.translate import Translated
from cluster.topology import ApiSpec
from protocol.openai_api import CandorReport, FieldNote, ModelCard
from protocol.responses_api import (DeletedResponse, InputItemList, ReasoningConfig,
                                    ResponseObject, ResponsesRequest, StoredResponse,
                                    TextConfig)

log = logging.getLogger("api_frontend")
_JSON = msgspec.json.Encoder()
ROUTE = "/v1/responses"
RESPONSES_KEY = web.AppKey("responses", ResponsePeers)  # where responses are kept and found


def _translate(req: ResponsesRequest, keys, previous: StoredResponse | None, rid: str,
               reply_to: str, arrival: float, api: ApiSpec,
               vision: bool = False) -> tuple[ChatPlan, Translated]:
    """The chat request and its GenerateReq, with the report under this request's names:
    ignored fields and extensions as the Responses tiers say, chat's defaults, parsers and
    constraint; errors renamed."""
    report = TABLE.report(keys, req, api)  # strict: a 400 before any work
    try:
        plan = to_chat(req, keys, previous, api.limits, vision)
    except ApiError as err:
        raise responses_name(err) from None
    try:
        tr = chat_to_generate(plan.chat, rid, reply_to, arrival, plan.chat_keys, api,
                              vision=vision)
    except ApiError as err:
        raise responses_name(err, plan.images) from None
    gen = tr.gen
    gen.max_tokens_field = "max_output_tokens"
    if gen.guided is not None and gen.guided.field.startswith("response_format"):
        gen.guided = msgspec.structs.replace(gen.guided, field="text.format.schema")
    chat_report = tr.report
    if chat_report.constraint is not None:
        chat_report.constraint = responses_name(
            ApiError(400, "", chat_report.constraint)).param
    tr.report = msgspec.structs.replace(chat_report, ignored=report.ignored + plan.notes,
                                        extensions=report.extensions)
    if tr.report.strict and plan.notes:
        note = plan.notes[0]
        raise ApiError(400, f"`{note.field}` would be ignored ({note.reason}); strict mode "
                       "turns ignored fields into errors", note.field, "ignored_field")
    return plan, tr


def _base(req: ResponsesRequest, rid: str, card: ModelCard, tr: Translated,
          report: CandorReport) -> ResponseObject:
    sampling = tr.gen.sampling
    return ResponseObject(
        id=rid, created_at=int(time.time()), status="in_progress", model=card.id,
        instructions=req.instructions, max_output_tokens=req.max_output_tokens,
        metadata=dict(req.metadata or {}),
        parallel_tool_calls=req.parallel_tool_calls is not False,
        previous_response_id=req.previous_response_id,
        reasoning=req.reasoning or ReasoningConfig(), store=req.store,
        temperature=sampling.temperature, top_p=sampling.top_p,
        text=req.text or TextConfig(), tool_choice=req.tool_choice or (
            "auto" if req.tools else "none"),
        tools=list(req.tools or []), truncation=req.truncation or "disabled", user=req.user,
        candor=report)


async def create(request: web.Request) -> web.StreamResponse:
    models, api = request.app[MODELS_KEY], request.app[API_KEY]
    peers = request.app[RESPONSES_KEY]
    req, keys = decode_request(await request.read(), ResponsesRequest)
    model, card = models.of_kind(req.model, "generate", ROUTE)
    engine = model.engine
    previous = None
    if req.previous_response_id is not None:
        previous = await peers.get(req.previous_response_id, "previous_response_id")
    stored = req.store and peers.store.enabled
    rid = peers.new_id(stored)
    arrival = time.time()
    plan, tr = _translate(req, keys, previous, rid, engine.reply_to, arrival, api, model.vision)
    tr.gen.lora = adapter_of(card)
    if req.store and not stored:
        tr.report.ignored.append(FieldNote("store", "this deployment keeps no responses "
                                           "(responses_store.max_entries 0)"))
    flight = Flight(engine, tr, api, request.app[MEDIA_KEY])
    response_key = client_request_id(request) or rid
    try:
        try:
            info = (await flight.start())[tr.gen.rid]
        except ApiError as err:  # (the tokenizer worker's: a bad image names its part)
            raise responses_name(err, plan.images) from None
        report = complete_report(tr.report, info)
        report.deterministic = flight.deterministic()
        headers = {"X-Request-Id": response_key,
                   "x-candor-adjustments": _JSON.encode(report).decode()}
        builder = ResponseBuilder(_base(req, rid, card, tr, report), tr.tools, tr.reasoning,
                                  streaming=req.stream)
        builder.start()
        if not req.stream:
            async for d in flight.deltas():
                builder.feed(d)
                flight.finished(d)
            builder.finish()
            _keep(peers, stored, rid, builder.response, plan)
            engine.record_finish(response_key, builder.finish_reason)
            return json_response(builder.response, headers=headers)
        return await _stream(request, engine, flight, builder, peers, stored, plan, headers,
                             response_key)
    except (asyncio.CancelledError, ConnectionResetError):
        log.info("client went away: %s (X-Request-Id %s)", rid, client_request_id(request))
        raise
    finally:
        await flight.close()


def _keep(peers: ResponsePeers, stored: bool, rid: str, response: ResponseObject,
          plan: ChatPlan) -> None:
    if stored:
        peers.store.put(rid, _JSON.encode(StoredResponse(response, plan.items)))


async def _stream(request: web.Request, engine, flight: Flight, builder: ResponseBuilder,
                  peers: ResponsePeers, stored: bool, plan: ChatPlan,
                  headers: dict[str, str], response_key: str) -> web.StreamResponse:
    response = web.StreamResponse(headers={**headers, "Content-Type": "text/event-stream",
                                           "Cache-Control": "no-cache"})
    await response.prepare(request)
    await response.write(builder.take())
    try:
        async for d in flight.deltas():
            builder.feed(d)
            flight.finished(d)
            frames = builder.take()
            if frames:
                await response.write(frames)
        builder.finish()
    except ApiError as err:  # after the first event: error + response.failed
        builder.fail(err)
    _keep(peers, stored, builder.response.id, builder.response, plan)
    await response.write(builder.take())
    await response.write_eof()
    engine.record_finish(response_key, builder.finish_reason)
    return response


async def retrieve(request: web.Request) -> web.Response:
    entry = await request.app[RESPONSES_KEY].get(request.match_info["response_id"], "response_id")
    return json_response(entry.response)


async def input_items(request: web.Request) -> web.Response:
    """Every input item of the response's conversation (those of the responses it
    continues too), newest first as OpenAI lists them (``order=asc``: oldest first);
    ``limit`` (1..100, default 20) and ``after`` / ``before`` (item ids) page."""
    entry = await request.app[RESPONSES_KEY].get(request.match_info["response_id"], "response_id")
    items = list(entry.input_items)
    query = request.query
    order = query.get("order", "desc")
    if order not in ("asc", "desc"):
        raise ApiError(400, "`order` must be 'asc' or 'desc'", "order", "invalid_value")
    if order == "desc":
        items.reverse()
    try:
        limit = int(query.get("limit", "20"))
    except ValueError:
        limit = 0
    if not 1 <= limit <= 100:
        raise ApiError(400, "`limit` must be an integer from 1 to 100", "limit",
                       "invalid_value")
    ids = [item.id for item in items]
    for name in ("after", "before"):
        if name in query and query[name] not in ids:
            raise ApiError(400, f"`{name}` names no item of this response", name,
                           "invalid_value")
    start = ids.index(query["after"]) + 1 if "after" in query else 0
    end = ids.index(query["before"]) if "before" in query else len(items)
    items = items[start:end]
    page = items[:limit]
    return json_response(InputItemList(page, page[0].id if page else None,
                                       page[-1].id if page else None, len(items) > limit))


async def delete(request: web.Request) -> web.Response:
    response_id = request.match_info["response_id"]
    await request.app[RESPONSES_KEY].delete(response_id, "response_id")
    return json_response(DeletedResponse(response_id))


_ONE = ROUTE + "/{response_id}"
ENDPOINT = Endpoint(
    fields=TABLE, path=ROUTE, runner="generate", serves="responses",
    routes=(Route("POST", ROUTE, create, ResponsesRequest), Route("GET", _ONE, retrieve),
            Route("DELETE", _ONE, delete), Route("GET", _ONE + "/input_items", input_items)),
    listed=(ROUTE, ROUTE + "/{id}", ROUTE + "/{id}/input_items"))
