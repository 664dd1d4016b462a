"""Running a pooling request's inputs through their engine: each ``PoolReq`` submitted,
their ``Pooled`` outputs collected in input order. The first input to fail fails the
request with its engine error, named after that input's field (``input[i]``,
``documents[i]``); the others are aborted, so their KV blocks are freed, as they are when
the client leaves. Shared by /v1/embeddings and the scoring routes."""

from __future__ import annotations

import asyncio

from api_frontend.errors import ApiError
from protocol import ipc


def named(err: ApiError, param: str) -> ApiError:
    """An input's error under that input's name."""
    if err.param == "input" and param != "input":
        err.param = param
        err.message = f"{param}: {err.message}"
    return err


async def collect(engine, subs: list[ipc.PoolReq], params: list[str]) -> tuple[list[bytes], int]:
    """(each input's output bytes, the prompt tokens of all of them)."""
    index = {sub.rid: i for i, sub in enumerate(subs)}
    outputs: list[bytes] = [b""] * len(subs)
    tokens = 0
    queue: asyncio.Queue = asyncio.Queue()
    pending: set[str] = set()
    try:
        for sub in subs:
            await engine.submit(sub, queue)
            pending.add(sub.rid)
        while pending:
            msg = await queue.get()
            i = index.get(msg.rid)
            if i is None or msg.rid not in pending:
                continue
            if isinstance(msg, ipc.RequestError):
                pending.discard(msg.rid)
                engine.release(msg.rid)
                raise named(ApiError.from_engine(msg), params[i])
            if isinstance(msg, ipc.Pooled):
                outputs[i], tokens = msg.data, tokens + msg.prompt_tokens
                pending.discard(msg.rid)
                engine.release(msg.rid)
    finally:
        for sub_rid in pending:  # an error, or the client left: free their KV blocks
            await engine.abort(sub_rid, "disconnect")
    return outputs, tokens
