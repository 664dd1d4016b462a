"""pyzmq sockets that speak typed msgspec messages.

Every socket is built from an address string (``ipc://...`` or ``tcp://host:port``) that
comes from the topology, and every receiving socket decodes one declared type. A frame
that does not decode is logged (rate-limited), counted and dropped at the boundary: one
malformed message never reaches a role's loop, and never stops it.

``tcp://`` sockets cross machines, so when the topology names CURVE keys every tcp bind
is a CURVE server that admits only the authorized client keys and every tcp connect is a
CURVE client that checks the server's key: a stranger can neither inject nor read. The
keys live on the context (``sync_context(security)``); ``ipc://`` stays plain (it never
leaves the host, and the run directory is private to the launcher's user).
"""

from __future__ import annotations

import logging
import os
import time
from typing import Any, Callable, Generic, TypeVar

import msgspec
import zmq
import zmq.asyncio
import zmq.auth
from zmq.auth.thread import ThreadAuthenticator

from protocol.security import CurveSpec, SecuritySpec

T = TypeVar("T")
log = logging.getLogger("candor.transport")
DROP_LOG_INTERVAL_S = 10.0

_HWM = 0  # unbounded queues: back-pressure is the scheduler's job, not the socket's


def _prepare_ipc_path(address: str) -> None:
    if address.startswith("ipc://"):
        path = address[len("ipc://"):]
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)


def _configure(sock: zmq.Socket) -> None:
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.SNDHWM, _HWM)
    sock.setsockopt(zmq.RCVHWM, _HWM)


class CurveKeys:
    """The key files a ``CurveSpec`` names, read on first use (a node that only connects
    never needs the server's secret key)."""

    def __init__(self, spec: CurveSpec) -> None:
        self.spec = spec
        self._server: tuple[bytes, bytes] | None = None
        self._client: tuple[bytes, bytes] | None = None
        self._server_public: bytes | None = None

    @staticmethod
    def _pair(path: str) -> tuple[bytes, bytes]:
        public, secret = zmq.auth.load_certificate(path)
        if secret is None:
            raise ValueError(f"{path} holds no secret key")
        return public, secret

    def server_pair(self) -> tuple[bytes, bytes]:
        if self._server is None:
            self._server = self._pair(self.spec.server_secret_path())
        return self._server

    def client_pair(self) -> tuple[bytes, bytes]:
        if self._client is None:
            self._client = self._pair(self.spec.client_secret_path())
        return self._client

    def server_public(self) -> bytes:
        if self._server_public is None:
            self._server_public = zmq.auth.load_certificate(
                self.spec.server_public_path())[0]
        return self._server_public


def _is_tcp(address: str) -> bool:
    return address.startswith("tcp://")


def _secure(ctx: zmq.Context, sock: zmq.Socket, address: str, bind: bool) -> None:
    """CURVE on a tcp socket when the context carries keys; ipc stays plain."""
    keys: CurveKeys | None = getattr(ctx, "curve", None)
    if keys is None or not _is_tcp(address):
        return
    if bind:
        _start_authenticator(ctx, keys)
        public, secret = keys.server_pair()
        sock.setsockopt(zmq.CURVE_SERVER, 1)
        sock.setsockopt(zmq.CURVE_PUBLICKEY, public)
        sock.setsockopt(zmq.CURVE_SECRETKEY, secret)
    else:
        public, secret = keys.client_pair()
        sock.setsockopt(zmq.CURVE_SERVERKEY, keys.server_public())
        sock.setsockopt(zmq.CURVE_PUBLICKEY, public)
        sock.setsockopt(zmq.CURVE_SECRETKEY, secret)


def _start_authenticator(ctx: zmq.Context, keys: CurveKeys) -> None:
    """The ZAP handler that admits only clients whose public key is authorized (without
    one, libzmq lets any CURVE client in). One per context, started by the first bind."""
    if getattr(ctx, "_authenticator", None) is not None:
        return
    shadow = zmq.Context.shadow(ctx.underlying)  # an asyncio context's sync twin
    auth = ThreadAuthenticator(shadow, log=logging.getLogger("candor.zap"))
    auth.start()
    auth.configure_curve(domain="*", location=keys.spec.authorized_keys_path())
    ctx._authenticator = auth


def open_socket(ctx: zmq.Context, kind: int, addresses: str | list[str],
                bind: bool, send_hwm: int | None = None, immediate: bool = True) -> zmq.Socket:
    """One socket bound to (or connected to) every address given. ``send_hwm``: at most
    this many messages queue, and (``immediate``) only toward a connected peer (a bounded
    send); ``immediate=False`` queues them from the connect on, for a socket opened just
    before its first send."""
    sock = ctx.socket(kind)
    _configure(sock)
    if send_hwm is not None:
        sock.setsockopt(zmq.SNDHWM, send_hwm)
        sock.setsockopt(zmq.IMMEDIATE, int(immediate))
    if kind == zmq.SUB:
        sock.setsockopt(zmq.SUBSCRIBE, b"")
    addrs = [addresses] if isinstance(addresses, str) else addresses
    if any(_is_tcp(a) for a in addrs) and any(not _is_tcp(a) for a in addrs) \
            and getattr(ctx, "curve", None) is not None:
        raise ValueError(f"one socket cannot mix tcp and ipc under CURVE: {addrs}")
    for addr in addrs:
        _secure(ctx, sock, addr, bind)
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
    """A PULL (or SUB) socket that decodes exactly ``msg_type``.

    Every recv skips frames that do not decode as ``msg_type`` (garbage, another
    message type, a field of the wrong type): each is counted in ``dropped`` (and by
    the context's ``on_drop``, the process's metric) and logged at most once per
    ``DROP_LOG_INTERVAL_S``, and the caller only ever sees valid messages."""

    def __init__(self, ctx: zmq.Context, address: str | list[str], msg_type: Any,
                 bind: bool = True, kind: int = zmq.PULL) -> None:
        self.sock = open_socket(ctx, kind, address, bind)
        self._on_drop: Callable[[], None] | None = getattr(ctx, "on_drop", None)
        self._decoder = msgspec.msgpack.Decoder(msg_type)
        self._where = address if isinstance(address, str) else ",".join(address)
        self.dropped = 0
        self._dropped_logged = 0
        self._last_log = float("-inf")

    def decode(self, frame: bytes | memoryview) -> T | None:
        """The message, or None (counted and logged) when the frame does not decode."""
        try:
            return self._decoder.decode(frame)
        except (msgspec.DecodeError, msgspec.ValidationError) as err:
            self._drop(err, len(frame))
            return None

    def _drop(self, err: Exception, size: int) -> None:
        self.dropped += 1
        if self._on_drop is not None:
            self._on_drop()
        now = time.monotonic()
        if now - self._last_log >= DROP_LOG_INTERVAL_S:
            log.warning("dropped %d undecodable message(s) on %s (last: %d bytes, %s)",
                        self.dropped - self._dropped_logged, self._where, size, err)
            self._last_log = now
            self._dropped_logged = self.dropped

    def recv(self, timeout_ms: int | None = None) -> T | None:
        """Blocking receive (sync sockets). Returns None on timeout."""
        deadline = None if timeout_ms is None else time.monotonic() + timeout_ms / 1000
        while True:
            if deadline is not None:
                left_ms = max(0, int((deadline - time.monotonic()) * 1000))
                if not self.sock.poll(left_ms):
                    return None
            msg = self.decode(self.sock.recv(copy=False).buffer)
            if msg is not None:
                return msg

    def recv_nowait(self) -> T | None:
        while True:
            try:
                frame = self.sock.recv(flags=zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return None
            msg = self.decode(frame.buffer)
            if msg is not None:
                return msg

    async def recv_async(self) -> T:
        """For sockets created on a ``zmq.asyncio.Context``."""
        while True:
            frame = await self.sock.recv(copy=False)
            msg = self.decode(frame.buffer)
            if msg is not None:
                return msg

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


class _KeyedContext:
    """Mixin: the CURVE keys (None: plain), the ZAP handler and what counts a dropped
    frame (None: only ``Receiver.dropped``) of one process's context."""

    curve: CurveKeys | None = None
    on_drop: Callable[[], None] | None = None
    _authenticator: ThreadAuthenticator | None = None

    def destroy(self, linger: int | None = None) -> None:
        if self._authenticator is not None:
            self._authenticator.stop()
            self._authenticator = None
        super().destroy(linger=linger)


class SyncContext(_KeyedContext, zmq.Context):
    pass


class AsyncContext(_KeyedContext, zmq.asyncio.Context):
    pass


def _keyed(ctx: _KeyedContext, security: SecuritySpec | None,
           on_drop: Callable[[], None] | None):
    if security is not None and security.curve is not None:
        ctx.curve = CurveKeys(security.curve)
    ctx.on_drop = on_drop
    return ctx


def async_context(security: SecuritySpec | None = None,
                  on_drop: Callable[[], None] | None = None) -> zmq.asyncio.Context:
    return _keyed(AsyncContext(), security, on_drop)


def sync_context(security: SecuritySpec | None = None,
                 on_drop: Callable[[], None] | None = None) -> zmq.Context:
    return _keyed(SyncContext(), security, on_drop)
