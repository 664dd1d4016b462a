"""Prompt KV moving between replicas' gpu_workers (disaggregated prefill/decode).

A prefill rank, right after the step that sampled a request's first token, gathers the
prompt's blocks out of its paged cache (one copy: blocks are not contiguous) and pushes
them, one frame per layer and K/V, to the same rank of the decode replica, with a header
that names the layout and a CRC32 per frame. Frames travel zero-copy both ways: the
gathered tensors' memory is handed to ZeroMQ, and the decode rank reads the received
frames in place (``torch.frombuffer``) when it writes them into its own cache blocks.

A decode rank checks a transfer as a whole before anything touches its cache (layout,
frame count and sizes, checksums) and tells its scheduler ``KvReceived`` (ok or why
not); it holds the frames until a plan imports them (``KvImport``: the blocks its
scheduler chose) or until they expire. A refused or lost transfer is never written: the
scheduler recomputes the prompt instead. Sends never block the step loop: a decode peer
that is gone or not keeping up loses the transfer (the deadline on its side covers it).
"""

from __future__ import annotations

import hashlib
import logging
import os
import time
import warnings
import zlib
from dataclasses import dataclass

import msgspec
import torch
import zmq

from cluster.metrics import KvTransferMetrics
from cluster.process_config import WorkerConfig
from protocol import ipc
from protocol.transport import Sender, open_socket

log = logging.getLogger(__name__)

SEND_HWM = 64  # transfers queued toward one decode rank before new ones are dropped


class KvLayout(msgspec.Struct, frozen=True, array_like=True):
    """What both sides must agree on for a block to mean the same thing."""

    model: str  # sha256 prefix of the checkpoint's config.json
    dtype: str
    block_size: int
    num_layers: int
    kv_heads: int  # this rank's
    head_dim: int
    tp_rank: int
    tp_size: int


class KvHeader(msgspec.Struct, array_like=True):
    rid: str
    layout: KvLayout
    num_tokens: int
    num_blocks: int
    checksums: list[int]  # CRC32 of each frame after the header, in order
    sent_at: float  # wall time the prefill rank started the export
    # a seeded request's generator after its first token: the decode rank goes on from
    # there, so a seed gives the same tokens as on a colocated replica
    generator_state: bytes | None = None


def model_fingerprint(model_path: str) -> str:
    with open(os.path.join(model_path, "config.json"), "rb") as fh:
        return hashlib.sha256(fh.read()).hexdigest()[:16]


def layout_of(runner, model_path: str) -> KvLayout:
    return KvLayout(model_fingerprint(model_path), str(runner.dtype).removeprefix("torch."),
                    runner.block_size, runner.config.num_layers, runner.shard.kv_heads,
                    runner.config.head_dim, runner.ranks.rank, runner.ranks.size)


def _as_bytes(t: torch.Tensor) -> memoryview:
    """A CPU tensor's memory as bytes, without a copy (any dtype, bfloat16 included)."""
    return memoryview(t.contiguous().view(torch.uint8).numpy()).cast("B")


def _mismatch(theirs: KvLayout, mine: KvLayout) -> str | None:
    for field in KvLayout.__struct_fields__:
        a, b = getattr(theirs, field), getattr(mine, field)
        if a != b:
            return f"{field} {a!r} (prefill) != {b!r} (decode)"
    return None


@dataclass
class _Held:
    header: KvHeader
    frames: list[zmq.Frame]
    at: float  # monotonic arrival


class KvSender:
    """The prefill side: one PUSH per decode replica (this rank's peer), connected at start:
    a send only queues toward a connected peer, and connecting takes a moment."""

    def __init__(self, ctx: zmq.Context, cfg: WorkerConfig, layout: KvLayout,
                 metrics: KvTransferMetrics) -> None:
        self.peers = cfg.addresses.replica_kv_in
        self.rank = cfg.tp_rank
        self.layout = layout
        self.socks = {r: open_socket(ctx, zmq.PUSH, ranks[self.rank], bind=False,
                                     send_hwm=SEND_HWM)
                      for r, ranks in enumerate(self.peers) if ranks}
        self.metrics = metrics

    def export(self, runner, exports: list[ipc.KvExport], failed: dict) -> None:
        for exp in exports:
            if exp.rid in failed or exp.rid not in runner.block_tables:
                continue  # it has no first token: nothing to hand off
            started = time.time()
            n = -(-exp.num_tokens // runner.block_size)
            table = runner.block_tables[exp.rid][:n]
            idx = torch.tensor(table, dtype=torch.long, device=runner.device)
            tensors = [half.index_select(0, idx).cpu() for layer in runner.kv_caches
                       for half in layer]
            frames = [_as_bytes(t) for t in tensors]
            gen = runner.generators.get(exp.rid)
            header = KvHeader(exp.rid, self.layout, exp.num_tokens, n,
                              [zlib.crc32(f) for f in frames], started,
                              gen.get_state().numpy().tobytes() if gen is not None else None)
            if self.send(self.socks[exp.replica], [msgspec.msgpack.encode(header), *frames]):
                self.metrics.bytes.labels("sent").inc(sum(f.nbytes for f in frames))
            else:
                self.metrics.failures.labels("send_queue_full").inc()
                log.warning("KV of %s not sent: decode replica %d is not taking transfers",
                            exp.rid, exp.replica)

    @staticmethod
    def send(sock: zmq.Socket, frames: list) -> bool:
        """One multipart message (ZeroMQ delivers all of it or none); never blocks."""
        try:
            sock.send_multipart(frames, flags=zmq.NOBLOCK, copy=False)
            return True
        except zmq.Again:
            return False


class KvReceiver:
    """The decode side: checks whole transfers, holds them until imported or expired."""

    def __init__(self, ctx: zmq.Context, cfg: WorkerConfig, layout: KvLayout,
                 metrics: KvTransferMetrics, hold_s: float) -> None:
        self.sock = open_socket(ctx, zmq.PULL, cfg.addresses.replica_kv_in[cfg.replica][
            cfg.tp_rank], bind=True)
        self.layout = layout
        self.hold_s = hold_s
        self.rank = cfg.tp_rank
        # every rank tells the scheduler about its own shard
        self.to_scheduler = Sender(ctx, cfg.addresses.worker_out)
        self.held: dict[str, _Held] = {}
        self.metrics = metrics
        elem = torch.empty((), dtype=getattr(torch, layout.dtype)).element_size()
        self.block_bytes = layout.block_size * layout.kv_heads * layout.head_dim * elem

    def drain(self) -> None:
        """Take every transfer waiting on the socket; answer each."""
        while True:
            try:
                frames = self.sock.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                break
            self._take(frames)
        self._expire()

    def _take(self, frames: list[zmq.Frame]) -> None:
        try:
            header = msgspec.msgpack.decode(frames[0].buffer, type=KvHeader)
        except (msgspec.DecodeError, msgspec.ValidationError) as err:
            self.metrics.failures.labels("bad_header").inc()
            log.warning("dropped a KV transfer whose header does not decode: %s", err)
            return  # no rid to answer for: the scheduler's deadline covers it
        why = self._refusal(header, frames[1:])
        nbytes = sum(len(f.buffer) for f in frames[1:])
        if why is not None:
            reason, detail = why
            self.metrics.failures.labels(reason).inc()
            log.warning("refused the KV of %s: %s", header.rid, detail)
            self.to_scheduler.send(ipc.KvReceived(header.rid, self.rank, False, reason))
            return
        self.metrics.bytes.labels("received").inc(nbytes)
        self.metrics.seconds.observe(max(0.0, time.time() - header.sent_at))
        self.held[header.rid] = _Held(header, frames[1:], time.monotonic())
        self.to_scheduler.send(ipc.KvReceived(header.rid, self.rank, True, nbytes=nbytes))

    def _refusal(self, header: KvHeader, frames: list[zmq.Frame]) -> tuple[str, str] | None:
        mismatch = _mismatch(header.layout, self.layout)
        if mismatch is not None:
            return "layout_mismatch", mismatch
        expected = 2 * self.layout.num_layers
        if len(frames) != expected or len(header.checksums) != expected:
            return "missing_frames", f"{len(frames)} frames, {expected} expected"
        size = header.num_blocks * self.block_bytes
        if header.num_blocks != -(-header.num_tokens // self.layout.block_size):
            return "bad_header", f"{header.num_blocks} blocks for {header.num_tokens} tokens"
        for i, (frame, crc) in enumerate(zip(frames, header.checksums)):
            if len(frame.buffer) != size:
                return "bad_size", f"frame {i} has {len(frame.buffer)} bytes, {size} expected"
            if zlib.crc32(frame.buffer) != crc:
                return "checksum", f"frame {i} fails its CRC32"
        return None

    def _expire(self) -> None:
        now = time.monotonic()
        for rid in [r for r, h in self.held.items() if now - h.at > self.hold_s]:
            del self.held[rid]

    def import_into(self, runner, imports: list[ipc.KvImport]) -> None:
        """Write held transfers into the blocks the plan names (before its forward). A
        transfer that is no longer held fails its request alone (it cannot be fed)."""
        for imp in imports:
            held = self.held.pop(imp.rid, None)
            if held is None or len(imp.blocks) != held.header.num_blocks:
                runner.failed[imp.rid] = ipc.RequestFailure(
                    "kv_transfer_lost", "the prompt KV handed over from the prefill replica "
                    "was no longer held by the decode replica; retry", 503)
                continue
            idx = torch.tensor(imp.blocks, dtype=torch.long, device=runner.device)
            shape = (len(imp.blocks), runner.block_size, runner.shard.kv_heads,
                     runner.config.head_dim)
            halves = [half for layer in runner.kv_caches for half in layer]
            with warnings.catch_warnings():  # read-only frames: read, never written
                warnings.simplefilter("ignore", UserWarning)
                for half, frame in zip(halves, held.frames):
                    src = torch.frombuffer(frame.buffer, dtype=torch.uint8).view(half.dtype)
                    half.index_copy_(0, idx, src.view(shape).to(half.device))
            gen = runner.generators.get(imp.rid)
            if gen is not None and held.header.generator_state is not None:
                gen.set_state(torch.frombuffer(bytearray(held.header.generator_state),
                                               dtype=torch.uint8))


class KvTransfer:
    """What a gpu_worker of a prefill/decode split adds to its loop (None elsewhere)."""

    def __init__(self, ctx: zmq.Context, cfg: WorkerConfig, runner) -> None:
        layout = layout_of(runner, cfg.model_path)
        split = cfg.disaggregation
        assert split is not None
        metrics = KvTransferMetrics()
        self.sender = KvSender(ctx, cfg, layout, metrics) \
            if cfg.replica_role == "prefill" else None
        self.receiver = KvReceiver(ctx, cfg, layout, metrics,
                                   hold_s=2 * split.transfer_timeout_s + 30) \
            if cfg.replica_role == "decode" else None

    @classmethod
    def for_worker(cls, ctx: zmq.Context, cfg: WorkerConfig, runner) -> KvTransfer | None:
        return cls(ctx, cfg, runner) if cfg.disaggregation is not None else None

    def recv_plan(self, plans, timeout_ms: int):
        """The next plan (or None after ``timeout_ms``), taking KV transfers meanwhile."""
        if self.receiver is None:
            return plans.recv(timeout_ms=timeout_ms)
        poller = zmq.Poller()
        poller.register(plans.sock, zmq.POLLIN)
        poller.register(self.receiver.sock, zmq.POLLIN)
        events = dict(poller.poll(timeout_ms))
        if self.receiver.sock in events:
            self.receiver.drain()
        return plans.recv_nowait() if plans.sock in events else None

    def attach(self, runner) -> None:
        """The runner writes a plan's imports after registering its requests (a failed
        import then fails its request) and before the forward."""
        if self.receiver is not None:
            runner.kv_import = self._import

    def _import(self, runner, imports: list[ipc.KvImport]) -> None:
        self.receiver.drain()  # a transfer that just arrived is imported now
        self.receiver.import_into(runner, imports)

    def after_step(self, runner, plan: ipc.StepPlan, failed: dict) -> None:
        if plan.kv_exports and self.sender is not None:
            self.sender.export(runner, plan.kv_exports, failed)
