"""Messages to and from the shared KV store (the ``kv_store`` role).

A store key is ``namespace + rank + chain hash``: the namespace digests everything that
makes two replicas' KV incompatible (checkpoint, dtype, block size, layers, heads, head
size, TP size; ``gpu_worker.kv_connectors.kv_store.namespace_of``), the rank picks the TP shard,
and the chain hash (``scheduler.kv_connectors.kv_store.store_chain``) covers the block's tokens, every
token before it and the request's ``cache_salt``. Python's ``hash`` (the local prefix
cache's) differs between processes for a salt, so the store has its own (blake2b).

Every message is one multipart ZeroMQ message: the msgpack header first, then one frame
per block (a rank's whole block, every layer's K then V, see ``block_bytes``) where the
header says so, each checked by its CRC32 on arrival.
"""

from __future__ import annotations

from typing import Union

import msgspec


class _StoreMessage(msgspec.Struct, tag_field="msg"):
    pass


class StorePut(_StoreMessage, tag="kv_store_put"):
    """A rank -> the store: full blocks it computed (one frame each after the header)."""

    namespace: bytes
    rank: int
    hashes: list[bytes]
    checksums: list[int]


class StoreLookup(_StoreMessage, tag="kv_store_lookup"):
    """A scheduler -> the store: which leading ``hashes`` are held for every one of the
    ``len(ranks)`` shards? The store answers ``StoreHeld`` to ``reply_to`` and sends each
    rank its shards of the held run (``StoreBlocks`` to ``ranks[k]``)."""

    rid: str
    namespace: bytes
    hashes: list[bytes]
    reply_to: str
    ranks: list[str]


class StoreHeld(_StoreMessage, tag="kv_store_held"):
    """The store -> a scheduler: the first ``blocks`` of the lookup's hashes are held
    (and on their way to the ranks)."""

    rid: str
    blocks: int


class StoreBlocks(_StoreMessage, tag="kv_store_blocks"):
    """The store -> one rank: a lookup's held blocks (one frame each after the header)."""

    rid: str
    checksums: list[int]


StoreInbound = Union[StorePut, StoreLookup]


def store_key(namespace: bytes, rank: int, chain: bytes) -> bytes:
    return namespace + rank.to_bytes(2, "little") + chain
