"""Finding a stored response whichever frontend a request lands on.

Frontends share one port (SO_REUSEPORT), so a continuation (``previous_response_id``) or
a GET / DELETE rarely reaches the frontend that stored the response. Each response id
names its owner: ``resp_<32 hex>f<frontend index><s|n>`` (``n``: created with
``store: false``, so never kept). A frontend serves its own ids from its store and asks
the owner for the others with one ``StoreQuery`` to the owner's results socket (which
every frontend can reach: the topology lists every frontend's address), answered by a
``StoreAnswer`` carrying the encoded entry. The store stays where the response was made
(nothing is copied on creation; only a continuation that lands elsewhere pays one hop),
and no process is added. The owner is a process of the same deployment; a frontend that
is gone takes its store with it (the launcher stops the topology when one dies), and a
separate deployment's ids are not found here (404 naming the frontend).
"""

from __future__ import annotations

import asyncio
import logging
import re
import uuid

import msgspec

from api_frontend.errors import ApiError
from api_frontend.endpoints.responses.store import Missing, ResponseStore, StoreMetrics
from protocol import ipc
from protocol.responses_api import StoredResponse
from protocol.transport import SenderPool

log = logging.getLogger("api_frontend")
PEER_TIMEOUT_S = 5.0
_ID = re.compile(r"^resp_[0-9a-f]{32}f(\d{1,6})([sn])$")
_DECODE = msgspec.json.Decoder(StoredResponse)


class ResponsePeers:
    def __init__(self, store: ResponseStore, index: int, addresses: list[str],
                 reply_to: str, ctx, metrics: StoreMetrics | None = None,
                 timeout_s: float = PEER_TIMEOUT_S) -> None:
        self.store = store
        self.index = index
        self.addresses = addresses
        self.reply_to = reply_to
        self.metrics = metrics
        self.timeout_s = timeout_s
        self._senders = SenderPool(ctx)
        self._waiting: dict[str, asyncio.Future] = {}

    def new_id(self, stored: bool) -> str:
        return f"resp_{uuid.uuid4().hex}f{self.index}{'s' if stored else 'n'}"

    def _owner(self, response_id: str, param: str) -> int:
        match = _ID.match(response_id)
        if match is None or int(match.group(1)) >= len(self.addresses):
            raise _not_found(response_id, param, "it is not an id this deployment issued")
        if match.group(2) == "n":
            raise _not_found(response_id, param, "it was created with `store: false`, so it "
                             "was never kept and cannot be continued or retrieved; send "
                             "the conversation's items in `input` instead")
        return int(match.group(1))

    async def get(self, response_id: str, param: str) -> StoredResponse:
        """The stored entry, from this frontend or its owner; a 404 saying why not."""
        return _DECODE.decode(await self._ask(response_id, "get", param))

    async def delete(self, response_id: str, param: str) -> None:
        await self._ask(response_id, "delete", param)

    async def _ask(self, response_id: str, op: str, param: str) -> bytes:
        owner = self._owner(response_id, param)
        if owner == self.index:
            found, entry, why = self._local(response_id, op)
            where = "local"
        else:
            found, entry, why = await self._remote(owner, response_id, op, param)
            where = "peer"
        if self.metrics is not None:
            self.metrics.lookups.labels(where, "found" if found else "missing").inc()
        if not found:
            raise _not_found(response_id, param, f"{why} (stored by frontend {owner})")
        return entry

    def _local(self, response_id: str, op: str) -> tuple[bool, bytes, str]:
        try:
            if op == "delete":
                self.store.delete(response_id)
                return True, b"", ""
            return True, self.store.get(response_id), ""
        except Missing as gone:
            return False, b"", gone.why

    async def _remote(self, owner: int, response_id: str, op: str,
                      param: str) -> tuple[bool, bytes, str]:
        qid = uuid.uuid4().hex
        future = asyncio.get_running_loop().create_future()
        self._waiting[qid] = future
        try:
            self._senders.send(self.addresses[owner], ipc.StoreQuery(
                qid, self.reply_to, response_id, op))  # type: ignore[arg-type]
            answer: ipc.StoreAnswer = await asyncio.wait_for(future, self.timeout_s)
        except (asyncio.TimeoutError, TimeoutError):
            raise ApiError(503, f"frontend {owner}, which stored {response_id!r}, did not "
                           f"answer within {self.timeout_s:g}s; retry", param,
                           "store_unreachable", headers={"Retry-After": "1"}) from None
        finally:
            self._waiting.pop(qid, None)
        return answer.found, answer.entry, answer.why

    def on_message(self, msg: ipc.StoreQuery | ipc.StoreAnswer) -> None:
        """From the results socket's reader: answer a peer's query, or wake our asker.
        Never raises (the reader must go on)."""
        try:
            if isinstance(msg, ipc.StoreAnswer):
                future = self._waiting.get(msg.qid)
                if future is not None and not future.done():
                    future.set_result(msg)
                return
            if msg.reply_to not in self.addresses:  # answers go to frontends only
                log.warning("dropped a stored-response query from %r", msg.reply_to[:200])
                return
            found, entry, why = self._local(msg.response_id, msg.op)
            self._senders.send(msg.reply_to, ipc.StoreAnswer(msg.qid, found, entry, why))
        except Exception:  # a bad address in a query must not stop the reader
            log.exception("could not answer a stored-response query")

    def close(self) -> None:
        self._senders.close()


def _not_found(response_id: str, param: str, why: str) -> ApiError:
    return ApiError(404, f"Response {response_id[:80]!r} not found: {why}", param,
                    "response_not_found")
