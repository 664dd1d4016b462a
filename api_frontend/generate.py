"""One generation request end to end on the frontend: translate, submit every choice,
wait for the tokenizer's RequestInfo (template, clamps), then answer whole or as SSE.
Chat and completions run it with their own translation and assembler (``Generation``);
/v1/responses runs ``Flight`` with its own builder.

The report of what was done (``candor`` body field / first stream frame and the
``x-candor-adjustments`` header) is complete before the first byte goes out: the
tokenizer worker sends RequestInfo before the request can produce a token, and any
delta that overtakes it on the socket is buffered until it arrives.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import msgspec
from aiohttp import web

from api_frontend.app_keys import API_KEY, LOG_REQUESTS_KEY, MEDIA_KEY, MODELS_KEY
from api_frontend.assembly import DONE_FRAME, Assembler, Collected, sse
from api_frontend.engine_client import EngineClient
from api_frontend.errors import RETRY_AFTER_S, ApiError
from api_frontend.json_body import decode_request
from api_frontend.limits import check_share
from api_frontend.media_fetch import MediaFetcher
from api_frontend.served_models import adapter_of
from api_frontend.tools import FirstCallCut
from api_frontend.translate import Translated
from cluster.topology import ApiSpec
from protocol import ipc
from protocol.openai_api import (CandorReport, FieldNote, ModelCard, SpeculativeReport,
                                 TemplateRef)

_JSON = msgspec.json.Encoder()
log = logging.getLogger("api_frontend")

REQUEST_ID_KEY = "client_request_id"  # request[...]: the client's X-Request-Id, if sent


def client_request_id(request: web.Request) -> str | None:
    """The client's X-Request-Id header, if it sent one (echoed, and named in logs)."""
    return request.get(REQUEST_ID_KEY)


def complete_report(report: CandorReport, info: ipc.RequestInfo) -> CandorReport:
    """Fold the tokenizer worker's findings (template, clamps, ignored kwargs) in."""
    for adj in info.adjustments:
        note = FieldNote(adj.field, adj.reason, adj.from_, adj.to)
        (report.clamped if adj.tier == "clamped" else report.ignored).append(note)
    if info.template is not None:
        t = info.template
        report.chat_template = TemplateRef(t.source, t.origin, t.sha256)
    return report


def speculative_counts(lasts: Iterable[ipc.TextDelta], exact: bool | None
                       ) -> SpeculativeReport | None:
    """The drafts verified and accepted over a response's sequences (each sequence's last
    delta once: n identical choices share one), or None where none drafted. ``exact``:
    whether the replicas verified with batch-invariant kernels (``Flight.deterministic``),
    without which a kept draft may differ from what decoding alone would give."""
    lasts = list(lasts)
    drafted = sum(d.spec_drafted for d in lasts)
    if not drafted:
        return None
    return SpeculativeReport(drafted, sum(d.spec_accepted for d in lasts), exact)


def _fold_reports(report: CandorReport, infos: list[ipc.RequestInfo]) -> CandorReport:
    """Every prompt's findings, each distinct note once (several prompts share most)."""
    for info in infos:
        before = (len(report.clamped), len(report.ignored))
        complete_report(report, info)
        for notes, start in ((report.clamped, before[0]), (report.ignored, before[1])):
            fresh = notes[start:]
            del notes[start:]
            notes.extend(n for n in fresh if n not in notes)
    return report


class Flight:
    """The sequences of one translated request in the engine. ``start`` admits and submits
    them and waits for each one's RequestInfo (deltas that overtake it are kept);
    ``deltas`` yields their deltas until every one finished (the delta that completes a
    first call ends its sequence under ``parallel_tool_calls: false``, see FirstCallCut);
    ``close`` aborts whatever has not finished (client gone, an error) and releases the
    rest."""

    def __init__(self, engine: EngineClient, tr: Translated, api: ApiSpec,
                 media: MediaFetcher | None = None) -> None:
        self.engine = engine
        self.tr = tr
        self.api = api
        self.media = media  # fetches the request's http(s) images before it is submitted
        self.reqs = tr.choice_reqs()
        self.queue: asyncio.Queue = asyncio.Queue()
        self.unfinished = set(tr.choices)
        self._early: list[ipc.TextDelta] = []
        self._first_call = (FirstCallCut(tr.tools, tr.reasoning)
                            if FirstCallCut.applies(tr.tools) else None)

    async def start(self) -> dict[str, ipc.RequestInfo]:
        engine = self.engine
        max_waiting = engine.stats.max_waiting if engine.stats is not None else 0
        check_share(len(self.reqs), self.api.limits, max_waiting,
                    "n" if len(self.tr.gens) == 1 else "prompt")
        full = engine.queue_full(len(self.reqs))
        if full is not None:
            raise ApiError(503, full, None, "queue_full", headers={"Retry-After": RETRY_AFTER_S})
        if self.media is not None:
            for gen in self.tr.gens:  # (each choice's copy shares its prompt's messages)
                await self.media.inline(gen.messages)
        for r in self.reqs:
            await engine.submit(r, self.queue)
        infos: dict[str, ipc.RequestInfo] = {}
        while len(infos) < len(self.reqs):
            msg = await self.queue.get()
            if isinstance(msg, ipc.RequestError):
                raise ApiError.from_engine(msg)
            if isinstance(msg, ipc.RequestInfo):
                infos[msg.rid] = msg
            else:
                self._early.append(msg)
        return infos

    def deterministic(self) -> bool | None:
        """Whether every sequence's replica runs batch-invariant kernels (None: unknown,
        or replicas that differ); for the ``candor`` report."""
        modes = {self.engine.deterministic(r.rid) for r in self.reqs}
        return modes.pop() if len(modes) == 1 else None

    async def _cut(self, d: ipc.TextDelta) -> ipc.TextDelta:
        if self._first_call is not None and (short := self._first_call.cut(d)) is not None:
            self.unfinished.discard(d.rid)
            await self.engine.abort(d.rid, "stop_string")
            return short
        return d

    async def deltas(self):
        """Every delta of an unfinished sequence; the caller marks finished ones
        (``finished``) as it reads their last delta."""
        for d in self._early:
            if d.rid in self.unfinished:
                yield await self._cut(d)
        while self.unfinished:
            msg = await self.queue.get()
            if isinstance(msg, ipc.RequestError):
                raise ApiError.from_engine(msg)
            if isinstance(msg, ipc.TextDelta) and msg.rid in self.unfinished:
                yield await self._cut(msg)

    def finished(self, d: ipc.TextDelta) -> None:
        if d.finish_reason is not None:
            self.unfinished.discard(d.rid)

    async def close(self) -> None:
        for sub in self.tr.choices:
            if sub in self.unfinished:  # client went away, or an error: stop, free KV blocks
                await self.engine.abort(sub, "disconnect")
            else:
                self.engine.release(sub)


@dataclass(frozen=True)
class Generation:
    """What a generation endpoint brings to ``run_generation``: its request struct, the
    prefix of its ids, its translation (``chat_to_generate``'s signature) and its
    assembler, built from (rid, created, model card, request, translation, report, the
    RequestInfo of each prompt's first choice)."""

    request: type
    rid_prefix: str
    translate: Callable[..., Translated]
    assembler: Callable[[str, int, ModelCard, Any, Translated, CandorReport,
                         list[ipc.RequestInfo]], Assembler]


async def serve_generation(request: web.Request, generation: Generation) -> web.StreamResponse:
    """The route handler's whole work: decode, find the model, run."""
    # admission (topology health, queue bound) is ops_middleware's, before this runs
    parsed, keys = decode_request(await request.read(), generation.request)
    model, card = request.app[MODELS_KEY].of_kind(parsed.model, "generate", request.path)
    return await run_generation(request, model.engine, card, request.app[API_KEY],
                                parsed, keys, generation, vision=model.vision)


async def run_generation(request: web.Request, engine: EngineClient, card: ModelCard,
                         api: ApiSpec, parsed, keys, generation: Generation, *,
                         vision: bool = False) -> web.StreamResponse:
    """``vision``: the model takes images (its translation lets image parts through)."""
    rid = f"{generation.rid_prefix}-{uuid.uuid4().hex}"
    arrival = time.time()
    tr: Translated = generation.translate(parsed, rid, engine.reply_to, arrival, keys, api,
                                          vision=vision)
    for gen in tr.gens:
        gen.lora = adapter_of(card)
    flight = Flight(engine, tr, api, request.app[MEDIA_KEY])
    if request.app[LOG_REQUESTS_KEY]:
        log.info("request %s (X-Request-Id %s): model %r, %d prompt(s), n=%d, max_tokens=%s, "
                 "stream=%s, sampling %s", rid, client_request_id(request), card.id,
                 len(tr.gens), tr.n, tr.gen.max_tokens, bool(parsed.stream),
                 msgspec.json.encode(tr.gen.sampling).decode())
    response_key = client_request_id(request) or rid
    try:
        infos = await flight.start()
        firsts = [r.rid for r in flight.reqs if tr.choices[r.rid][0] % tr.n == 0]  # per prompt
        report = _fold_reports(tr.report, [infos[f] for f in firsts])
        report.deterministic = flight.deterministic()
        headers = {"X-Request-Id": response_key,
                   "x-candor-adjustments": _JSON.encode(report).decode()}
        assembler = generation.assembler(rid, int(arrival), card, parsed, tr, report,
                                         [infos[f] for f in firsts])
        if not parsed.stream:
            got: list[Collected | None] = [None] * tr.num_choices
            for sub, idxs in tr.choices.items():
                shared = Collected()  # n identical choices computed once share one
                for i in idxs:
                    got[i] = shared
            async for d in flight.deltas():
                got[tr.choices[d.rid][0]].add(d)
                flight.finished(d)
            report.speculative = speculative_counts(
                {id(c): c.last for c in got if c is not None and c.last is not None}.values(),
                report.deterministic)
            body = _JSON.encode(assembler.final(got))
            engine.record_finish(response_key, got[0].last.finish_reason or "none")
            return web.Response(body=body, content_type="application/json", headers=headers)
        return await _stream(request, engine, parsed, tr, assembler, flight, headers,
                             response_key)
    except (asyncio.CancelledError, ConnectionResetError):
        log.info("client went away: %s (X-Request-Id %s); aborting %d of %d sequences", rid,
                 client_request_id(request), len(flight.unfinished), len(tr.choices))
        raise
    finally:
        await flight.close()


async def _stream(request: web.Request, engine: EngineClient, parsed, tr: Translated,
                  assembler: Assembler, flight: Flight, headers: dict[str, str],
                  response_key: str) -> web.StreamResponse:
    opts = parsed.stream_options
    include_usage = bool(opts and opts.include_usage)
    continuous = bool(opts and opts.continuous_usage_stats)
    response = web.StreamResponse(headers={**headers, "Content-Type": "text/event-stream",
                                           "Cache-Control": "no-cache"})
    await response.prepare(request)
    for chunk in assembler.opening_chunks(tr.num_choices):
        await response.write(sse(chunk))
    started: set[int] = set()
    lasts: dict[int, ipc.TextDelta] = {}
    ends: dict[str, ipc.TextDelta] = {}  # each sequence's last delta (its spec counts)
    try:
        async for delta in flight.deltas():
            if delta.finish_reason is not None:
                ends[delta.rid] = delta
            # the chunk that finishes the stream's last choice carries the speculative
            # counts, unless a usage chunk follows it (then that one does)
            closing = (not include_usage and delta.finish_reason is not None
                       and flight.unfinished <= {delta.rid})
            for choice in tr.choices[delta.rid]:
                if choice not in started:
                    started.add(choice)
                    first = assembler.first_chunk(choice, delta)
                    if first is not None:
                        await response.write(sse(first))
                if delta.text or delta.finish_reason is not None or (
                        assembler.with_ids and delta.token_ids) or (
                        assembler.logprobs and delta.logprobs):
                    chunk = assembler.chunk(choice, delta, continuous)
                    if chunk is not None:
                        if closing and choice == tr.choices[delta.rid][-1]:
                            _close_report(chunk, ends, flight)
                        await response.write(sse(chunk))
                lasts[choice] = delta
            flight.finished(delta)
    except ApiError as err:  # after the first frame: an error frame, then [DONE]
        await response.write(b"data: " + err.encode() + b"\n\n")
        await response.write(DONE_FRAME)
        engine.record_finish(response_key, "error")
        return response
    if include_usage:
        chunk = assembler.usage_chunk([lasts[i] for i in sorted(lasts)])
        _close_report(chunk, ends, flight)
        await response.write(sse(chunk))
    await response.write(DONE_FRAME)
    await response.write_eof()
    engine.record_finish(response_key, lasts[0].finish_reason or "none")
    return response


def _close_report(chunk, ends: dict[str, ipc.TextDelta], flight: Flight) -> None:
    """A stream's last chunk: its ``candor`` holds the response's speculative counts
    (the whole report went out on the first frame, before any count was known)."""
    counts = speculative_counts(ends.values(), flight.deterministic())
    if counts is not None:
        chunk.candor = CandorReport(speculative=counts)
