"""POST /v1/load_lora_adapter and /v1/unload_lora_adapter: vLLM's endpoints and bodies.

Both need the API key (like every route but the ops probes) and answer 404 unless the
operator allows runtime updates (``--allow-runtime-lora-updating`` or vLLM's
``VLLM_ALLOW_RUNTIME_LORA_UPDATING=True``). A path must be absolute and lie inside the
allowed directories (``--lora-allowed-dirs``; default: those holding the
``--lora-modules``), checked here by its text and again by every rank with symlinks
resolved, where the files are read.

How a load spreads: this frontend sends an ``AdapterLoad`` to every replica's scheduler;
each sends ``LoadAdapter`` to its ranks on the plan socket; every rank reads its slice
and the ranks agree (all or none hold it); rank 0 answers its scheduler, which starts
serving the name, sends a heartbeat at once (so every frontend lists it) and answers
here. The 200 goes out once every replica answered and this frontend sees the adapter.
A partial failure is undone: the replicas that loaded it unload it again (or, for
``load_inplace``, load the adapter it replaced back), and the answer names the replica
and the reason. An unload stops new requests at once; requests already queued or
running finish on the adapter, then the ranks drop it (the reply says how many).
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Sequence

from aiohttp import web

from api_frontend.engine_client import EngineClient
from api_frontend.errors import ApiError
from api_frontend.json_body import decode
from api_frontend.served_models import ServedModels
from cluster.topology import LoraSpec
from protocol import ipc
from protocol.openai_api import LoadLoraAdapterRequest, UnloadLoraAdapterRequest

REPLY_TIMEOUT_S = 120.0  # a replica reads the adapter's files before it answers
VISIBLE_TIMEOUT_S = 2.0  # a loaded adapter shows in this frontend's list within this


def _allowed(spec: LoraSpec) -> None:
    if not spec.enabled:
        raise ApiError(404, "LoRA adapters are not enabled on this deployment (start it with "
                       "--enable-lora)", None, "lora_disabled")
    if not spec.allow_runtime_updates:
        raise ApiError(404, "Loading LoRA adapters at runtime is off on this deployment (start "
                       "it with --allow-runtime-lora-updating or "
                       "VLLM_ALLOW_RUNTIME_LORA_UPDATING=True)", None, "lora_updates_disabled")


def _checked_path(path: str, spec: LoraSpec) -> str:
    if "\0" in path or not os.path.isabs(path):
        raise ApiError(400, f"`lora_path` must be an absolute directory path, got {path[:200]!r}",
                       "lora_path", "invalid_lora_path")
    path = os.path.normpath(path)
    roots = spec.allowed_roots()
    if not any(os.path.commonpath([path, root]) == root for root in roots):
        raise ApiError(400, f"`lora_path` {path[:200]!r} is outside the directories this "
                       f"deployment loads adapters from: [{', '.join(roots) or 'none'}] "
                       "(--lora-allowed-dirs)", "lora_path", "lora_path_not_allowed")
    return path


def _failure(replicas: Sequence[int], replies: dict[int, ipc.AdapterReply], undone: str) -> ApiError:
    """The error for replicas that failed or did not answer (named when there are several)."""
    several = len(replicas) > 1
    parts, first = [], None
    for r in replicas:
        reply = replies.get(r)
        if reply is not None and reply.status == 200:
            continue
        if reply is None:
            text = f"no answer within {REPLY_TIMEOUT_S:g}s"
            reply = ipc.AdapterReply("", r, 504, text, None, "replica_timeout")
        first = first or reply
        parts.append(f"replica {r}: {reply.message}" if several else reply.message)
    return ApiError(first.status, "; ".join(parts) + undone, first.param, first.code)


async def _until(check, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not check() and time.monotonic() < deadline:
        await asyncio.sleep(0.01)


async def load(request: web.Request, engine: EngineClient, models: ServedModels,
               spec: LoraSpec) -> web.Response:
    _allowed(spec)
    body = decode(await request.read(), LoadLoraAdapterRequest)
    name = body.lora_name
    if name in models.names():
        raise ApiError(400, f"`lora_name` {name!r} is a served model's name",
                       "lora_name", "invalid_value")
    path = _checked_path(body.lora_path, spec)
    problem = engine.engine_problem()
    if problem is not None:
        raise ApiError(503, problem, None, "unavailable", headers={"Retry-After": "5"})
    replaced = engine.adapters().get(name) if body.load_inplace else None
    replicas, replies = await engine.ask_replicas(
        lambda rid, r: ipc.AdapterLoad(rid, engine.reply_to, name, path, "", body.load_inplace),
        REPLY_TIMEOUT_S)
    loaded = [r for r in replicas if r in replies and replies[r].status == 200]
    if len(loaded) < len(replicas):
        undone = ""
        if loaded:  # a name served by some replicas only would fail requests by chance
            await engine.ask_replicas(
                lambda rid, r: (ipc.AdapterUnload(rid, engine.reply_to, name) if replaced is None
                                else ipc.AdapterLoad(rid, engine.reply_to, name, replaced.path,
                                                     replaced.parent, True)),
                REPLY_TIMEOUT_S, only=loaded)
            undone = f" (undone on replica(s) {loaded}, which had loaded it)"
        raise _failure(replicas, replies, undone)
    await _until(lambda: getattr(engine.adapters().get(name), "path", None) == path,
                 VISIBLE_TIMEOUT_S)
    return web.Response(text=f"Success: LoRA adapter '{name}' added successfully.")


async def unload(request: web.Request, engine: EngineClient, spec: LoraSpec) -> web.Response:
    _allowed(spec)
    body = decode(await request.read(), UnloadLoraAdapterRequest)
    name = body.lora_name
    replicas, replies = await engine.ask_replicas(
        lambda rid, r: ipc.AdapterUnload(rid, engine.reply_to, name), REPLY_TIMEOUT_S)
    if len(replies) < len(replicas) or all(reply.status != 200 for reply in replies.values()):
        raise _failure(replicas, replies, "")
    await _until(lambda: name not in engine.adapters(), VISIBLE_TIMEOUT_S)
    in_flight = sum(reply.in_flight for reply in replies.values())
    finishing = f" {in_flight} request(s) already queued or running finish on it." if in_flight else ""
    return web.Response(text=f"Success: LoRA adapter '{name}' removed successfully.{finishing}")
