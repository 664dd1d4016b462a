"""The /health/generate probe: one real token through every role, coalesced.

Probes go to the head of the tokenizer's and the scheduler's queues, so a flood of them
could starve real traffic. A frontend therefore keeps at most one probe in flight:
callers that arrive while it runs await the same answer instead of submitting their own.
"""

from __future__ import annotations

import asyncio
import time
import uuid

import msgspec
from aiohttp import web

from api_frontend.engine_client import EngineClient
from protocol import ipc


class ProbeResult(msgspec.Struct, frozen=True):
    """``outcome``: ok | fail | timeout; ``message`` says why when not ok."""

    outcome: str
    tokens: int = 0
    latency_s: float = 0.0
    message: str = ""


class GenerationProbe:
    """At most one engine request in flight for all concurrent probe callers."""

    def __init__(self, engine: EngineClient) -> None:
        self._engine = engine
        self._running: asyncio.Task[ProbeResult] | None = None

    async def check(self, timeout: float) -> ProbeResult:
        """Join the probe in flight, or start one that may take ``timeout`` seconds
        (the starting caller's limit serves everyone who joins it)."""
        task = self._running
        if task is None or task.done():
            task = self._running = asyncio.ensure_future(self._probe(timeout))
        return await asyncio.shield(task)  # a caller that leaves does not cancel it

    async def _probe(self, timeout: float) -> ProbeResult:
        engine = self._engine
        rid = f"probe-{uuid.uuid4().hex}"
        started = time.monotonic()
        pooling = engine.served[0].runner == "pooling"  # an embedding model: one vector
        queue = await engine.submit(ipc.PoolReq(rid, engine.reply_to, "health", probe=True) if pooling
                                    else ipc.GenerateReq(
            rid=rid, reply_to=engine.reply_to, sampling=ipc.SamplingParams(temperature=0.0),
            detok=ipc.DetokParams(), prompt="health", max_tokens=1, ignore_eos=True,
            arrival_time=time.time(), probe=True))
        try:
            while True:
                msg = await asyncio.wait_for(queue.get(),
                                             timeout - (time.monotonic() - started))
                if isinstance(msg, ipc.RequestError):
                    engine.release(rid)
                    return ProbeResult("fail", message=msg.message)
                if isinstance(msg, ipc.Pooled) or (
                        isinstance(msg, ipc.TextDelta) and msg.finish_reason is not None):
                    break
        except (asyncio.TimeoutError, TimeoutError):
            await engine.abort(rid, "error")
            return ProbeResult("timeout", message=f"no token within {timeout:g}s")
        engine.release(rid)
        engine.finish_reasons.pop(rid, None)
        tokens = 1 if pooling else msg.completion_tokens
        return ProbeResult("ok", tokens, round(time.monotonic() - started, 4))


PROBE_KEY = web.AppKey("generation_probe", GenerationProbe)
