"""The /health/generate probe: one real token through every role, on every engine
replica in rotation, coalesced.

Probes go to the head of the tokenizer's and the scheduler's queues (and are never shed
for queue capacity), so a flood of them could starve real traffic. A frontend therefore
keeps at most one probe round in flight: callers that arrive while it runs await the
same answer instead of submitting their own. With several replicas a round sends one
probe to each replica in rotation, concurrently, so a replica that takes traffic but
cannot generate is named, whichever replica the router would have picked.
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
    replica: int = 0


class ProbeRound(msgspec.Struct, frozen=True):
    """One probe per replica in rotation; ``skipped``: replica -> why it was not probed
    (lost, silent, loading: the router sends it nothing either)."""

    results: list[ProbeResult]
    skipped: dict[int, str] = {}

    def failures(self) -> list[ProbeResult]:
        return [r for r in self.results if r.outcome != "ok"]


class GenerationProbe:
    """At most one probe round in flight for all concurrent probe callers."""

    def __init__(self, engine: EngineClient) -> None:
        self._engine = engine
        self._running: asyncio.Task[ProbeRound] | None = None

    async def check(self, timeout: float) -> ProbeRound:
        """Join the round in flight, or start one that may take ``timeout`` seconds
        (the starting caller's limit serves everyone who joins it)."""
        task = self._running
        if task is None or task.done():
            task = self._running = asyncio.ensure_future(self._round(timeout))
        return await asyncio.shield(task)  # a caller that leaves does not cancel it

    async def _round(self, timeout: float) -> ProbeRound:
        engine = self._engine
        if engine.replicas == 1:
            return ProbeRound([await self._probe(0, timeout)])
        rotation = engine.in_rotation()
        skipped = {r["replica"]: r["state"] for r in engine.replica_report()
                   if r["replica"] not in rotation}
        results = await asyncio.gather(*(self._probe(r, timeout) for r in rotation))
        return ProbeRound(list(results), skipped)

    async def _probe(self, replica: int, timeout: float) -> ProbeResult:
        engine = self._engine
        rid = f"probe-{uuid.uuid4().hex}"
        started = time.monotonic()
        queue = await engine.submit(ipc.GenerateReq(
            rid=rid, reply_to=engine.reply_to, sampling=ipc.SamplingParams(temperature=0.0),
            detok=ipc.DetokParams(), prompt="health", max_tokens=1, ignore_eos=True,
            arrival_time=time.time(), probe=True, replica=replica))
        try:
            while True:
                msg = await asyncio.wait_for(queue.get(),
                                             timeout - (time.monotonic() - started))
                if isinstance(msg, ipc.RequestError):
                    engine.release(rid)
                    return ProbeResult("fail", message=msg.message, replica=replica)
                if isinstance(msg, ipc.TextDelta) and msg.finish_reason is not None:
                    break
        except (asyncio.TimeoutError, TimeoutError):
            await engine.abort(rid, "probe_timeout")
            return ProbeResult("timeout", message=f"no token within {timeout:g}s",
                               replica=replica)
        engine.release(rid)
        engine.finish_reasons.pop(rid, None)
        return ProbeResult("ok", msg.completion_tokens, round(time.monotonic() - started, 4),
                           replica=replica)


PROBE_KEY = web.AppKey("generation_probe", GenerationProbe)
