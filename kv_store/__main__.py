"""kv_store process: one PULL socket for puts (from gpu_worker ranks) and lookups (from
schedulers); answers go out on PUSH sockets opened per address, never blocking: a peer
that is gone or not keeping up loses the answer, and its own deadline covers that."""

from __future__ import annotations

import logging
import zlib

import msgspec
import zmq

from cluster.lifecycle import StopFlag, die_with_parent, read_config, setup_logging
from cluster.metrics import KvStoreMetrics, dropped_messages
from cluster.process_config import KvStoreConfig
from kv_store.tiers import Tiers
from protocol import kv_store as msg
from protocol.transport import open_socket, sync_context

SEND_HWM = 64  # answers queued toward one peer before new ones are dropped
GIB = 2 ** 30


class StoreServer:
    def __init__(self, ctx: zmq.Context, cfg: KvStoreConfig, log: logging.Logger) -> None:
        spec = cfg.kv_store
        self.tiers = Tiers(int(spec.size_gib * GIB), spec.dir, int(spec.disk_size_gib * GIB))
        self.inbound = open_socket(ctx, zmq.PULL, cfg.addresses.kv_store, bind=True)
        self.ctx = ctx
        self.peers: dict[str, zmq.Socket] = {}
        self.decoder = msgspec.msgpack.Decoder(msg.StoreInbound)
        self.encoder = msgspec.msgpack.Encoder()
        self.metrics = KvStoreMetrics()
        self.exported_written = 0
        self.log = log

    def _peer(self, address: str) -> zmq.Socket:
        sock = self.peers.get(address)
        if sock is None:
            # opened on its first answer: queue from the connect on (bounded all the same)
            sock = self.peers[address] = open_socket(self.ctx, zmq.PUSH, address, bind=False,
                                                     send_hwm=SEND_HWM, immediate=False)
        return sock

    def _send(self, address: str, frames: list) -> None:
        try:
            self._peer(address).send_multipart(frames, flags=zmq.NOBLOCK, copy=False)
        except zmq.Again:
            self.log.warning("dropped an answer to %s: it is not taking them", address)

    def serve(self, should_stop) -> None:
        while not should_stop():
            if not self.inbound.poll(200):
                continue
            while True:
                try:
                    frames = self.inbound.recv_multipart(zmq.NOBLOCK, copy=False)
                except zmq.Again:
                    break
                self._handle(frames)
            self._export()

    def _handle(self, frames: list[zmq.Frame]) -> None:
        try:
            head = self.decoder.decode(frames[0].buffer)
        except (msgspec.DecodeError, msgspec.ValidationError) as err:
            self.log.warning("dropped a message that does not decode: %s", err)
            return
        if isinstance(head, msg.StorePut):
            self._put(head, frames[1:])
        else:
            self._lookup(head)

    def _put(self, put: msg.StorePut, frames: list[zmq.Frame]) -> None:
        if len(frames) != len(put.hashes) or len(put.checksums) != len(put.hashes):
            self.log.warning("dropped a put of %d frames for %d blocks", len(frames),
                             len(put.hashes))
            return
        for chain, crc, frame in zip(put.hashes, put.checksums, frames):
            if zlib.crc32(frame.buffer) != crc:
                self.log.warning("dropped a put block that fails its CRC32")
                continue
            self.tiers.put(msg.store_key(put.namespace, put.rank, chain), frame.bytes)

    def _lookup(self, look: msg.StoreLookup) -> None:
        """The leading run held for every rank; each rank gets its shards of it."""
        per_rank: list[list[bytes]] = [[] for _ in look.ranks]
        for chain in look.hashes:
            blobs = [self.tiers.get(msg.store_key(look.namespace, k, chain))
                     for k in range(len(look.ranks))]
            if any(b is None for b in blobs):
                break
            for k, blob in enumerate(blobs):
                per_rank[k].append(blob)
        held = len(per_rank[0]) if per_rank else 0
        if held:
            for address, blobs in zip(look.ranks, per_rank):
                head = msg.StoreBlocks(look.rid, [zlib.crc32(b) for b in blobs])
                self._send(address, [self.encoder.encode(head), *blobs])
        self._send(look.reply_to, [self.encoder.encode(msg.StoreHeld(look.rid, held))])

    def _export(self) -> None:
        self.metrics.written.inc(self.tiers.written - self.exported_written)
        self.exported_written = self.tiers.written
        for tier, nbytes in self.tiers.resident.items():
            self.metrics.bytes.labels(tier).set(nbytes)
        self.metrics.blocks.labels("memory").set(len(self.tiers.memory))
        self.metrics.blocks.labels("disk").set(len(self.tiers.disk))


def main() -> None:
    die_with_parent()
    cfg = read_config(KvStoreConfig)
    log = setup_logging(cfg)
    stop = StopFlag()
    ctx = sync_context(cfg.security, dropped_messages(cfg.role))
    server = StoreServer(ctx, cfg, log)
    spec = cfg.kv_store
    log.info("ready: %.3g GiB in memory%s", spec.size_gib,
             f", {spec.disk_size_gib:.3g} GiB on disk in {spec.dir}" if spec.dir else "")
    server.serve(stop.is_set)
    ctx.destroy(linger=0)


if __name__ == "__main__":
    main()
