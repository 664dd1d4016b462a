"""The shared KV store connector: a gpu_worker rank's side of the store (absent without one).

Writes are write-behind: after a step, the full blocks its plan names
(``KvStorePlan.puts``) are copied out of the paged cache (one gather, before the
next plan can reuse them) and queued; a background thread ships them to the store. The
queue is bounded: when it is full a put is dropped (counted), never waited for.

Reads: the store sends each rank its shards of the blocks a scheduler's lookup found
(``StoreBlocks``); the same thread checks their CRC32s, holds them and tells the scheduler
(``KvReceived``, as a disaggregated decode rank does). The scheduler then allocates blocks
and a plan imports the held data into them before its forward (``KvImport``), the way a
decode replica imports a prefill replica's KV; data nobody imports expires.
"""

from __future__ import annotations

import hashlib
import logging
import queue
import threading
import time
import warnings
import zlib

import msgspec
import torch
import zmq

from cluster.process_config import WorkerConfig
from gpu_worker.kv_connectors.base import KvConnector
from gpu_worker.kv_connectors.pd_transfer import as_bytes, layout_of
from protocol import ipc
from protocol import kv_store as msg
from protocol.transport import Sender, open_socket

log = logging.getLogger(__name__)

PUT_QUEUE = 256  # put batches waiting for the sender thread before new ones are dropped
SEND_HWM = 64
HOLD_S = 30.0  # found blocks not imported by then are dropped


def namespace_of(runner, model_path: str, tp_size: int) -> bytes:
    """What makes KV incompatible across replicas: the checkpoint, dtype and block layout,
    and the TP size (a rank's shard holds heads by it; the rank is the key's own part)."""
    layout = layout_of(runner, model_path)
    return hashlib.blake2b(msgspec.msgpack.encode((layout, tp_size)), digest_size=16).digest()


def _gather(runner, blocks: list[int]) -> torch.Tensor:
    """``blocks`` as one CPU tensor [block, layer K/V, block_size, heads, head_dim]."""
    idx = torch.tensor(blocks, dtype=torch.long, device=runner.device)
    halves = [half.index_select(0, idx) for layer in runner.kv_caches for half in layer]
    return torch.stack(halves, dim=1).cpu().contiguous()


class StoreClient(KvConnector):
    plan = ipc.KvStorePlan

    def __init__(self, ctx: zmq.Context, cfg: WorkerConfig, runner) -> None:
        self.namespace = namespace_of(runner, cfg.model_path, cfg.tensor_parallel)
        self.rank = cfg.tp_rank
        self.ctx = ctx
        self.cfg = cfg
        self.puts: queue.Queue = queue.Queue(PUT_QUEUE)
        self.dropped = 0  # put batches dropped for a full queue or a store not taking them
        self.held: dict[str, tuple[list[zmq.Frame], float]] = {}
        self.lock = threading.Lock()
        self.thread = threading.Thread(target=self._run, name="kv-store", daemon=True)
        self.stop = threading.Event()
        self.thread.start()

    @classmethod
    def configured(cls, cfg: WorkerConfig) -> bool:
        return cfg.kv_store is not None

    def announce(self, ready: ipc.WorkerReady) -> ipc.WorkerReady:
        return msgspec.structs.replace(ready, kv_namespace=self.namespace)

    def close(self) -> None:
        """Stop the thread (its sockets close there) before the context goes."""
        self.stop.set()
        self.thread.join(timeout=2)

    # ------------------------------------------------------------------ step thread
    def load(self, runner, work: ipc.KvStorePlan) -> None:
        if work.imports:
            self.import_into(runner, work.imports)

    def save(self, runner, work: ipc.KvStorePlan, failed: dict) -> None:
        """Copy the plan's finished blocks out (before a later plan reuses them)."""
        for put in work.puts:
            if put.rid in failed:
                continue  # its blocks may not be written
            try:
                self.puts.put_nowait((put.hashes, _gather(runner, put.blocks)))
            except queue.Full:
                self.dropped += 1

    def import_into(self, runner, imports: list[ipc.KvImport]) -> None:
        """Write held blocks into the blocks the plan names. Blocks no longer held fail
        their request alone (its plan counts them as computed)."""
        for imp in imports:
            with self.lock:
                held = self.held.pop(imp.rid, None)
            if held is None or len(held[0]) < len(imp.blocks):
                runner.failed[imp.rid] = ipc.RequestFailure(
                    "kv_store_lost", "the prompt blocks found in the KV store were no longer "
                    "held by this replica's worker; retry", 503, recompute=True)
                continue
            idx = torch.tensor(imp.blocks, dtype=torch.long, device=runner.device)
            halves = [half for layer in runner.kv_caches for half in layer]
            shape = (len(imp.blocks), len(halves), *halves[0].shape[1:])
            with warnings.catch_warnings():  # read-only frames: read, never written
                warnings.simplefilter("ignore", UserWarning)
                data = torch.stack([torch.frombuffer(f.buffer, dtype=torch.uint8)
                                    for f in held[0][:len(imp.blocks)]])
            data = data.view(halves[0].dtype).view(shape).to(runner.device)
            for j, half in enumerate(halves):
                half.index_copy_(0, idx, data[:, j])

    # ------------------------------------------------------------------ its thread
    def _run(self) -> None:
        """Ships puts, takes found blocks: every socket here is this thread's own."""
        addresses = self.cfg.addresses
        to_store = open_socket(self.ctx, zmq.PUSH, addresses.kv_store, bind=False,
                               send_hwm=SEND_HWM)
        found = open_socket(self.ctx, zmq.PULL, addresses.kv_store_rank_in[self.rank],
                            bind=True)
        to_scheduler = Sender(self.ctx, addresses.worker_out)
        encoder = msgspec.msgpack.Encoder()
        decoder = msgspec.msgpack.Decoder(msg.StoreBlocks)
        try:
            while not self.stop.is_set():
                if found.poll(20):
                    while True:
                        try:
                            frames = found.recv_multipart(zmq.NOBLOCK, copy=False)
                        except zmq.Again:
                            break
                        self._take(frames, decoder, to_scheduler)
                self._ship(to_store, encoder)
                self._expire()
        except zmq.ContextTerminated:
            pass
        finally:
            for sock in (to_store, found, to_scheduler.sock):
                sock.close(linger=0)

    def _ship(self, sock: zmq.Socket, encoder) -> None:
        while True:
            try:
                hashes, data = self.puts.get_nowait()
            except queue.Empty:
                return
            frames = [as_bytes(row) for row in data]
            head = msg.StorePut(self.namespace, self.rank, hashes,
                                [zlib.crc32(f) for f in frames])
            try:
                sock.send_multipart([encoder.encode(head), *frames], flags=zmq.NOBLOCK,
                                    copy=False)
            except zmq.Again:
                self.dropped += 1

    def _take(self, frames: list[zmq.Frame], decoder, to_scheduler: Sender) -> None:
        try:
            head = decoder.decode(frames[0].buffer)
        except (msgspec.DecodeError, msgspec.ValidationError) as err:
            log.warning("dropped KV store blocks whose header does not decode: %s", err)
            return
        blocks = frames[1:]
        bad = len(blocks) != len(head.checksums) or any(
            zlib.crc32(f.buffer) != crc for f, crc in zip(blocks, head.checksums))
        if not bad:
            with self.lock:
                self.held[head.rid] = (blocks, time.monotonic())
        to_scheduler.send(ipc.KvReceived(head.rid, self.rank, not bad,
                                         "checksum" if bad else "",
                                         sum(len(f.buffer) for f in blocks)))

    def _expire(self) -> None:
        now = time.monotonic()
        with self.lock:
            for rid in [r for r, (_, at) in self.held.items() if now - at > HOLD_S]:
                del self.held[rid]
