"""The prefill/decode transfer connector: prompt KV moving between replicas' gpu_workers.

A prefill rank, right after a step that computed part of a handed-off prompt, gathers
the blocks that step completed out of its paged cache (one copy: blocks are not
contiguous) and pushes them, one frame per layer and K/V, to the decode ranks that read
them, with a header that names the layout and a CRC32 per frame: a prompt prefilled in
chunks streams while its later chunks compute, and the step that samples the first
token sends the rest. Prefill and decode may differ in TP size: each rank sends the
runs of KV heads ``tp_shard.kv_routes`` assigns it (equal sizes: all of rank k's heads
to rank k). Frames travel zero-copy both ways: the gathered tensors' memory is handed
to ZeroMQ, and the decode rank reads the received frames in place
(``torch.frombuffer``) when it writes them into its own cache blocks.

A decode rank checks each piece as a whole before anything touches its cache (layout,
frame count and sizes, checksums) and tells its scheduler ``KvReceived`` (ok once every
part it expects covers every block of the prompt, or why not); it holds the frames
until a plan imports them (``KvImport``: the blocks its scheduler chose) or until they
expire. A refused or lost transfer is never written: the
scheduler recomputes the prompt instead. Each prefill rank greets its decode peers once
connected (its layout, no KV): a decode rank that cannot use it stops the topology at
start (``LAYOUT_MISMATCH_EXIT``). Sends never block the step loop: a decode peer
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
from gpu_worker.kv_connectors.base import KvConnector
from gpu_worker.tp_shard import KvRoute, kv_routes
from protocol import ipc
from protocol.transport import Sender, open_socket

log = logging.getLogger(__name__)

SEND_HWM = 64  # transfers queued toward one decode rank before new ones are dropped
# prefill and decode cannot share KV as configured: the launcher stops the topology
LAYOUT_MISMATCH_EXIT = os.EX_CONFIG


class KvLayout(msgspec.Struct, frozen=True, array_like=True):
    """What both sides must agree on for a block to mean the same thing (TP sizes may
    differ: the heads are re-sliced)."""

    model: str  # sha256 prefix of the checkpoint's config.json
    dtype: str
    block_size: int
    num_layers: int
    num_kv_heads: int  # the model's
    head_dim: int


class KvPart(msgspec.Struct, frozen=True, array_like=True):
    """Which heads one transfer carries: a run of the model's KV heads from prefill rank
    ``src`` of ``src_tp`` (a route of ``tp_shard.kv_routes``)."""

    src_tp: int
    src: int
    head: int
    heads: int


class KvHeader(msgspec.Struct, array_like=True):
    """One piece of one part: blocks ``first_block..first_block+num_blocks`` of the KV
    of the first ``num_tokens`` positions; ``final``: the prompt's last piece (earlier
    ones went ahead while later chunks of the prompt computed)."""

    rid: str
    layout: KvLayout
    part: KvPart
    num_tokens: int
    first_block: int
    num_blocks: int
    final: bool
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
                    runner.block_size, runner.config.num_layers, runner.config.num_kv_heads,
                    runner.config.head_dim)


def routes_of(cfg: WorkerConfig, runner) -> list[KvRoute]:
    split = cfg.disaggregation
    assert split is not None and split.prefill_tensor_parallel and split.decode_tensor_parallel
    return kv_routes(runner.config.num_kv_heads, split.prefill_tensor_parallel,
                     split.decode_tensor_parallel)


def as_bytes(t: torch.Tensor) -> memoryview:
    """A CPU tensor's memory as bytes, without a copy (any dtype, bfloat16 included)."""
    return memoryview(t.contiguous().view(torch.uint8).numpy()).cast("B")


def _mismatch(theirs: KvLayout, mine: KvLayout) -> str | None:
    for field in KvLayout.__struct_fields__:
        a, b = getattr(theirs, field), getattr(mine, field)
        if a != b:
            return f"{field} {a!r} (prefill) != {b!r} (decode)"
    return None


@dataclass
class _Piece:
    header: KvHeader
    frames: list[zmq.Frame]


@dataclass
class _Held:
    parts: dict[int, dict[int, _Piece]]  # prefill rank -> first block -> piece
    at: float  # monotonic arrival of the first piece

    def blocks(self, src: int) -> int | None:
        """The prompt's blocks when ``src``'s pieces cover all of them, else None."""
        end, final = 0, False
        for first in sorted(self.parts.get(src, {})):
            piece = self.parts[src][first]
            if first != end:
                return None
            end, final = first + piece.header.num_blocks, piece.header.final
        return end if final else None


class KvSender:
    """The prefill side: one PUSH per (decode replica, decode rank this rank sends to),
    connected at start: a send only queues toward a connected peer, and connecting takes
    a moment."""

    def __init__(self, ctx: zmq.Context, cfg: WorkerConfig, layout: KvLayout,
                 routes: list[KvRoute], kv_start: int, metrics: KvTransferMetrics) -> None:
        self.rank = cfg.tp_rank
        self.tp = cfg.tensor_parallel
        self.layout = layout
        self.kv_start = kv_start  # the model's first KV head held by this rank
        self.routes = [r for r in routes if r.src == self.rank]
        self.socks = {(replica, r.dst): open_socket(ctx, zmq.PUSH, ranks[r.dst], bind=False,
                                                    send_hwm=SEND_HWM)
                      for replica, ranks in enumerate(cfg.addresses.replica_kv_in) if ranks
                      for r in self.routes}
        self.metrics = metrics
        self.ungreeted = dict(self.socks)  # peers not yet told this rank's layout

    def greet(self) -> None:
        """Tell each decode peer, once, as soon as it is connected, what this rank will
        send (a header with no rid and no frames): a peer that cannot use it stops the
        topology at start rather than refusing every request. Never blocks."""
        for (replica, dst), sock in list(self.ungreeted.items()):
            route = next(r for r in self.routes if r.dst == dst)
            hello = KvHeader("", self.layout, KvPart(self.tp, self.rank, route.head,
                                                     route.heads), 0, 0, 0, True, [],
                             time.time())
            try:
                sock.send(msgspec.msgpack.encode(hello), zmq.NOBLOCK)
                del self.ungreeted[replica, dst]
            except zmq.Again:
                pass  # not connected yet: the next loop turn tries again

    def export(self, runner, exports: list[ipc.KvExport], failed: dict) -> None:
        for exp in exports:
            if exp.rid in failed or exp.rid not in runner.block_tables:
                # it has no first token: nothing to hand off (its decode replica times
                # out and recomputes: said here, so a timeout can be traced to its cause)
                log.warning("KV of %s not sent: %s", exp.rid, "its step failed"
                            if exp.rid in failed else "this rank holds no blocks for it")
                continue
            started = time.time()
            n = -(-exp.num_tokens // runner.block_size)
            table = runner.block_tables[exp.rid][exp.first_block:n]
            idx = torch.tensor(table, dtype=torch.long, device=runner.device)
            gen = runner.generators.get(exp.rid)
            state = gen.get_state().numpy().tobytes() if gen is not None else None
            for route in self.routes:
                lo = route.head - self.kv_start
                # one copy: the blocks (and, re-sliced, the heads) gathered contiguous
                frames = [as_bytes(half[:, :, lo:lo + route.heads].index_select(0, idx).cpu())
                          for layer in runner.kv_caches for half in layer]
                header = KvHeader(exp.rid, self.layout,
                                  KvPart(self.tp, self.rank, route.head, route.heads),
                                  exp.num_tokens, exp.first_block, len(table), exp.final,
                                  [zlib.crc32(f) for f in frames], started, state)
                if self.send(self.socks[exp.replica, route.dst],
                             [msgspec.msgpack.encode(header), *frames]):
                    self.metrics.bytes.labels("sent").inc(sum(f.nbytes for f in frames))
                else:
                    self.metrics.failures.labels("send_queue_full").inc()
                    log.warning("KV of %s not sent: decode replica %d rank %d is not taking "
                                "transfers", exp.rid, exp.replica, route.dst)

    @staticmethod
    def send(sock: zmq.Socket, frames: list) -> bool:
        """One multipart message (ZeroMQ delivers all of it or none); never blocks."""
        try:
            sock.send_multipart(frames, flags=zmq.NOBLOCK, copy=False)
            return True
        except zmq.Again:
            return False


class KvReceiver:
    """The decode side: checks whole transfers, holds them until imported or expired; a
    request's KV counts as received once every part this rank expects is in."""

    def __init__(self, ctx: zmq.Context, cfg: WorkerConfig, layout: KvLayout,
                 routes: list[KvRoute], kv_start: int, metrics: KvTransferMetrics,
                 hold_s: float) -> None:
        self.sock = open_socket(ctx, zmq.PULL, cfg.addresses.replica_kv_in[cfg.replica][
            cfg.tp_rank], bind=True)
        self.layout = layout
        self.hold_s = hold_s
        self.rank = cfg.tp_rank
        # every rank tells the scheduler about its own shard
        self.to_scheduler = Sender(ctx, cfg.addresses.worker_out)
        self.held: dict[str, _Held] = {}
        self.metrics = metrics
        split = cfg.disaggregation
        assert split is not None
        self.prefill_tp = split.prefill_tensor_parallel
        self.kv_start = kv_start  # the model's first KV head read by this rank
        # prefill rank -> the part it sends this rank
        self.expected = {r.src: KvPart(self.prefill_tp, r.src, r.head, r.heads)
                         for r in routes if r.dst == self.rank}
        elem = torch.empty((), dtype=getattr(torch, layout.dtype)).element_size()
        self.head_bytes = layout.block_size * layout.head_dim * elem  # per block and head

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
        if not header.rid:
            self._greeted(header)
            return
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
        held = self.held.setdefault(header.rid, _Held({}, time.monotonic()))
        held.parts.setdefault(header.part.src, {})[header.first_block] = _Piece(header,
                                                                               frames[1:])
        if header.final and self._complete(held) is not None:
            total = sum(len(f.buffer) for pieces in held.parts.values()
                        for p in pieces.values() for f in p.frames)
            self.to_scheduler.send(ipc.KvReceived(header.rid, self.rank, True, nbytes=total))

    def _complete(self, held: _Held) -> int | None:
        """The prompt's blocks when every expected part covers them all, else None."""
        ends = {held.blocks(src) for src in self.expected}
        return ends.pop() if len(ends) == 1 and None not in ends else None

    def _greeted(self, hello: KvHeader) -> None:
        """A prefill rank's greeting at start: a layout this rank cannot take stops it
        (the launcher then stops the topology), in one line naming what differs."""
        why = self._layout_refusal(hello)
        if why is not None:
            log.critical("prefill and decode replicas do not match: %s; they must serve the "
                         "same model, KV dtype, block size, layer count and head dim",
                         why[1])
            logging.shutdown()
            os._exit(LAYOUT_MISMATCH_EXIT)

    def _layout_refusal(self, header: KvHeader) -> tuple[str, str] | None:
        mismatch = _mismatch(header.layout, self.layout)
        if mismatch is not None:
            return "layout_mismatch", mismatch
        if self.expected.get(header.part.src) != header.part:
            return "layout_mismatch", (f"part {header.part} (prefill) is not one this rank "
                                       f"expects: {list(self.expected.values())}")
        return None

    def _refusal(self, header: KvHeader, frames: list[zmq.Frame]) -> tuple[str, str] | None:
        why = self._layout_refusal(header)
        if why is not None:
            return why
        expected = 2 * self.layout.num_layers
        if len(frames) != expected or len(header.checksums) != expected:
            return "missing_frames", f"{len(frames)} frames, {expected} expected"
        size = header.num_blocks * header.part.heads * self.head_bytes
        if header.first_block + header.num_blocks != -(-header.num_tokens //
                                                       self.layout.block_size):
            return "bad_header", (f"blocks {header.first_block}+{header.num_blocks} for "
                                  f"{header.num_tokens} tokens")
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
            if held is None or self._complete(held) != len(imp.blocks):
                runner.failed[imp.rid] = ipc.RequestFailure(
                    "kv_transfer_lost", "the prompt KV handed over from the prefill replica "
                    "was no longer held by the decode replica; retry", 503, recompute=True)
                continue
            halves = [half for layer in runner.kv_caches for half in layer]
            pieces = [p for by_first in held.parts.values() for p in by_first.values()]
            for piece in pieces:
                h = piece.header
                lo, heads = h.part.head - self.kv_start, h.part.heads
                idx = torch.tensor(imp.blocks[h.first_block:h.first_block + h.num_blocks],
                                   dtype=torch.long, device=runner.device)
                shape = (h.num_blocks, runner.block_size, heads, runner.config.head_dim)
                with warnings.catch_warnings():  # read-only frames: read, never written
                    warnings.simplefilter("ignore", UserWarning)
                    for half, frame in zip(halves, piece.frames):
                        src = torch.frombuffer(frame.buffer, dtype=torch.uint8).view(half.dtype)
                        half[:, :, lo:lo + heads].index_copy_(0, idx,
                                                              src.view(shape).to(half.device))
            header = next(p.header for p in pieces if p.header.final)
            gen = runner.generators.get(imp.rid)
            if gen is not None and header.generator_state is not None:
                gen.set_state(torch.frombuffer(bytearray(header.generator_state),
                                               dtype=torch.uint8))


class PdTransfer(KvConnector):
    """The prefill/decode split's connector: a prefill rank exports after its steps
    (``KvSender``), a decode rank takes transfers and imports them (``KvReceiver``)."""

    plan = ipc.PdTransferPlan

    def __init__(self, ctx: zmq.Context, cfg: WorkerConfig, runner) -> None:
        layout = layout_of(runner, cfg.model_path)
        split = cfg.disaggregation
        assert split is not None
        metrics = KvTransferMetrics()
        routes = routes_of(cfg, runner)
        kv_start = runner.shard.kv_start
        self.sender = KvSender(ctx, cfg, layout, routes, kv_start, metrics) \
            if cfg.replica_role == "prefill" else None
        self.receiver = KvReceiver(ctx, cfg, layout, routes, kv_start, metrics,
                                   hold_s=2 * split.transfer_timeout_s + 30) \
            if cfg.replica_role == "decode" else None
        log.info("disaggregation: this is a %s replica", cfg.replica_role)

    @classmethod
    def configured(cls, cfg: WorkerConfig) -> bool:
        return cfg.disaggregation is not None

    def socket(self) -> zmq.Socket | None:
        return self.receiver.sock if self.receiver is not None else None

    def drain(self) -> None:
        self.receiver.drain()

    def tick(self) -> None:
        if self.sender is not None and self.sender.ungreeted:
            self.sender.greet()

    def load(self, runner, work: ipc.PdTransferPlan) -> None:
        if work.imports:  # (a decode rank's: the scheduler imports nowhere else)
            self.receiver.drain()  # a transfer that just arrived is imported now
            self.receiver.import_into(runner, work.imports)

    def save(self, runner, work: ipc.PdTransferPlan, failed: dict) -> None:
        if work.exports and self.sender is not None:
            self.sender.export(runner, work.exports, failed)
