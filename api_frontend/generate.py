"""One generation request end to end on the frontend: translate, submit every choice,
wait for the tokenizer's RequestInfo (template, clamps), then answer whole or as SSE.

The report of what was done (``candor`` body field / first stream frame and the
``x-candor-adjustments`` header) is complete before the first byte goes out: the
tokenizer worker sends RequestInfo before the request can produce a token, and any
delta that overtakes it on the socket is buffered until it arrives.
"""

from __future__ import annotations

import asyncio
import time
import uuid

import msgspec
from aiohttp import web

from api_frontend.engine_client import EngineClient
from api_frontend.errors import ApiError
from api_frontend.responses import (DONE_FRAME, ChatAssembler, Collected,
                                   CompletionAssembler, sse)
from api_frontend.translate import Translated, chat_to_generate, completion_to_generate
from protocol import ipc
from protocol.openai_api import (CandorReport, ChatCompletionRequest, FieldNote, ModelCard,
                                 TemplateRef)
from protocol.topology import ApiSpec

_JSON = msgspec.json.Encoder()


def complete_report(report: CandorReport, info: ipc.RequestInfo) -> CandorReport:
    """Fold the tokenizer worker's findings (template, clamps, ignored kwargs) in."""
    for adj in info.adjustments:
        note = FieldNote(adj.field, adj.reason, adj.from_, adj.to)
        (report.clamped if adj.tier == "clamped" else report.ignored).append(note)
    if info.template is not None:
        t = info.template
        report.chat_template = TemplateRef(t.source, t.origin, t.sha256)
    return report


def _chat_echo(req: ChatCompletionRequest) -> str | None:
    """vLLM's chat echo: the final message's content, when it is the assistant's."""
    if not req.echo or not req.messages or req.messages[-1].role != "assistant":
        return None
    content = req.messages[-1].content
    if isinstance(content, list):
        return "\n".join(p.text or "" for p in content if p.type == "text")
    return content or ""


async def run_generation(request: web.Request, engine: EngineClient, card: ModelCard,
                         api: ApiSpec, parsed, keys: list[str]) -> web.StreamResponse:
    is_chat = isinstance(parsed, ChatCompletionRequest)
    rid = f"{'chatcmpl' if is_chat else 'cmpl'}-{uuid.uuid4().hex}"
    arrival = time.time()
    tr: Translated = (chat_to_generate if is_chat else completion_to_generate)(
        parsed, rid, engine.reply_to, arrival, keys, api)
    reqs = tr.choice_reqs()
    index = {r.rid: i for i, r in enumerate(reqs)}
    queue: asyncio.Queue = asyncio.Queue()
    for r in reqs:
        await engine.submit(r, queue)
    unfinished = set(index)
    try:
        infos: dict[str, ipc.RequestInfo] = {}
        early: list[ipc.TextDelta] = []
        while len(infos) < len(reqs):
            msg = await queue.get()
            if isinstance(msg, ipc.RequestError):
                raise ApiError.from_engine(msg)
            if isinstance(msg, ipc.RequestInfo):
                infos[msg.rid] = msg
            else:
                early.append(msg)
        info = infos[reqs[0].rid]
        report = complete_report(tr.report, info)
        headers = {"x-request-id": rid,
                   "x-candor-adjustments": _JSON.encode(report).decode()}
        logprobs = (parsed.logprobs if is_chat else parsed.logprobs is not None)
        common = dict(n=parsed.n, report=report, logprobs=bool(logprobs),
                      logprobs_k=tr.gen.sampling.logprobs,
                      prompt_logprobs_k=parsed.prompt_logprobs)
        if is_chat:
            assembler = ChatAssembler(rid, int(arrival), card.id, parsed.return_token_ids,
                                      echo_text=_chat_echo(parsed), **common)
        else:
            assembler = CompletionAssembler(rid, int(arrival), card.id, parsed.return_token_ids,
                                            echo_text=info.prompt_text if parsed.echo else None,
                                            **common)

        async def deltas():
            for d in early:
                yield d
            while unfinished:
                msg = await queue.get()
                if isinstance(msg, ipc.RequestError):
                    raise ApiError.from_engine(msg)
                if isinstance(msg, ipc.TextDelta):
                    yield msg

        if not parsed.stream:
            got = [Collected() for _ in reqs]
            async for d in deltas():
                got[index[d.rid]].add(d)
                if d.finish_reason is not None:
                    unfinished.discard(d.rid)
            if tr.compute_once:
                got = got * tr.n
            return web.Response(body=_JSON.encode(assembler.final(got)),
                                content_type="application/json", headers=headers)
        return await _stream(request, parsed, tr, assembler, deltas(), index, unfinished,
                             headers)
    finally:
        for sub in index:
            if sub in unfinished:  # client went away, or an error: stop and free KV blocks
                await engine.abort(sub, "disconnect")
            else:
                engine.release(sub)


async def _stream(request: web.Request, parsed, tr: Translated, assembler, deltas,
                  index: dict[str, int], unfinished: set[str],
                  headers: dict[str, str]) -> web.StreamResponse:
    opts = parsed.stream_options
    include_usage = bool(opts and opts.include_usage)
    continuous = bool(opts and opts.continuous_usage_stats)
    response = web.StreamResponse(headers={**headers, "Content-Type": "text/event-stream",
                                           "Cache-Control": "no-cache"})
    await response.prepare(request)
    copies = tr.n if tr.compute_once else 1  # n identical choices computed once
    is_chat = isinstance(assembler, ChatAssembler)
    if is_chat:
        for i in range(tr.n):
            await response.write(sse(assembler.role_chunk(i)))
    started: set[int] = set()
    lasts: dict[int, ipc.TextDelta] = {}
    try:
        async for delta in deltas:
            i = index[delta.rid]
            for c in range(copies):
                choice = i + c
                if not is_chat and assembler.echo_text is not None and choice not in started:
                    started.add(choice)
                    await response.write(sse(assembler.echo_chunk(choice, delta)))
                if delta.text or delta.finish_reason is not None or (
                        assembler.with_ids and delta.token_ids) or (
                        assembler.logprobs and delta.logprobs):
                    await response.write(sse(assembler.chunk(choice, delta, continuous)))
                lasts[choice] = delta
            if delta.finish_reason is not None:
                unfinished.discard(delta.rid)
    except ApiError as err:  # after the first frame: an error frame, then [DONE]
        await response.write(b"data: " + err.encode() + b"\n\n")
        await response.write(DONE_FRAME)
        return response
    if include_usage:
        await response.write(sse(assembler.usage_chunk([lasts[i] for i in sorted(lasts)])))
    await response.write(DONE_FRAME)
    await response.write_eof()
    return response
