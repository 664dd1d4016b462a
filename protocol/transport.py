"""pyzmq sockets that speak typed msgspec messages.

Every socket is built from an address string (``ipc://...`` or ``tcp://host:port``) that
comes from the topology, and every receiving socket decodes one declared type, so a
malformed or unexpected frame is an error at the boundary, never a silent guess.
"""

from __future__ import annotations

import os
from typing import Any, Generic, TypeVar

import msgspec
import zmq
import zmq.asyncio

T = TypeVar("T")

_HWM = 0  # unbounded queues: back-pressure is the scheduler's job, not the socket's


def _prepare_ipc_path(address: str) -> None:
    if address.startswith("ipc://"):
        path = address[len("ipc://"):]
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)


def _configure(sock: zmq.Socket) -> None:
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.SNDHWM, _HWM)
    sock.setsockopt(zmq.RCVHWM, _HWM)


def open_socket(ctx: zmq.Context, kind: int, addresses: str | list[str],
                bind: bool) -> zmq.Socket:
    """One socket bound to (or connected to) every address given."""
    sock = ctx.socket(kind)
    _configure(sock)
    if kind == zmq.SUB:
        sock.setsockopt(zmq.SUBSCRIBE, b"")
    for addr in [addresses] if isinstance(addresses, str) else addresses:
        if bind:
            _prepare_ipc_path(addr)
            sock.bind(addr)
        else:
            sock.connect(addr)
    return sock


class Sender:
    """A PUSH (or PUB) socket plus an encoder. One per destination address set."""

    def __init__(self, ctx: zmq.Context, addresses: str | list[str], bind: bool = False,
                 kind: int = zmq.PUSH) -> None:
        self.sock = open_socket(ctx, kind, addresses, bind)
        self._encoder = msgspec.msgpack.Encoder()

    def send(self, msg: Any) -> Any:
        """Send without blocking the caller's loop (the queue is unbounded)."""
        return self.sock.send(self._encoder.encode(msg), copy=False)

    def send_nowait(self, msg: Any) -> bool:
        """Send only if a peer is connected now (a PUSH with no peer would block)."""
        try:
            self.sock.send(self._encoder.encode(msg), flags=zmq.NOBLOCK, copy=False)
        except zmq.Again:
            return False
        return True

    def close(self) -> None:
        self.sock.close(0)


class Receiver(Generic[T]):
    """A PULL (or SUB) socket that decodes exactly ``msg_type``."""

    def __init__(self, ctx: zmq.Context, address: str | list[str], msg_type: Any,
                 bind: bool = True, kind: int = zmq.PULL) -> None:
        self.sock = open_socket(ctx, kind, address, bind)
        self._decoder = msgspec.msgpack.Decoder(msg_type)

    def decode(self, frame: bytes | memoryview) -> T:
        return self._decoder.decode(frame)

    def recv(self, timeout_ms: int | None = None) -> T | None:
        """Blocking receive (sync sockets). Returns None on timeout."""
        if timeout_ms is not None and not self.sock.poll(timeout_ms):
            return None
        return self._decoder.decode(self.sock.recv(copy=False).buffer)

    def recv_nowait(self) -> T | None:
        try:
            frame = self.sock.recv(flags=zmq.NOBLOCK, copy=False)
        except zmq.Again:
            return None
        return self._decoder.decode(frame.buffer)

    async def recv_async(self) -> T:
        """For sockets created on a ``zmq.asyncio.Context``."""
        frame = await self.sock.recv(copy=False)
        return self._decoder.decode(frame.buffer)

    def close(self) -> None:
        self.sock.close(0)


class SenderPool:
    """Lazily opened PUSH sockets keyed by address: replies go to whichever frontend
    named itself in ``reply_to``, without the sender knowing the topology."""

    def __init__(self, ctx: zmq.Context) -> None:
        self._ctx = ctx
        self._senders: dict[str, Sender] = {}

    def get(self, address: str) -> Sender:
        sender = self._senders.get(address)
        if sender is None:
            sender = self._senders[address] = Sender(self._ctx, address)
        return sender

    def send(self, address: str, msg: Any) -> None:
        self.get(address).send(msg)

    def close(self) -> None:
        for sender in self._senders.values():
            sender.close()
        self._senders.clear()


def async_context() -> zmq.asyncio.Context:
    return zmq.asyncio.Context()


def sync_context() -> zmq.Context:
    return zmq.Context()
