"""The store's two LRU tiers: memory, then (optionally) a directory on disk.

Memory holds at most ``memory_bytes`` of block data; what memory evicts goes to disk
(when a directory is configured), which holds at most ``disk_bytes`` and deletes its
least recently used files past that. A disk hit is read back into memory (and may push
others down). Only block data counts toward the bounds (keys and the index are small).
"""

from __future__ import annotations

import os
import shutil
from collections import OrderedDict


class Tiers:
    def __init__(self, memory_bytes: int, disk_dir: str | None = None,
                 disk_bytes: int = 0) -> None:
        self.memory_bytes = memory_bytes
        self.disk_bytes = disk_bytes if disk_dir else 0
        self.memory: OrderedDict[bytes, bytes] = OrderedDict()  # LRU first
        self.disk: OrderedDict[bytes, int] = OrderedDict()  # key -> size, LRU first
        self.resident = {"memory": 0, "disk": 0}
        self.evicted = 0  # blocks dropped from the last tier
        self.written = 0  # blocks put that were not held
        self.dir = disk_dir
        if disk_dir:  # a fresh tier: files of an earlier run have no index
            shutil.rmtree(disk_dir, ignore_errors=True)
            os.makedirs(disk_dir)

    def __contains__(self, key: bytes) -> bool:
        return key in self.memory or key in self.disk

    def put(self, key: bytes, data: bytes) -> None:
        if key in self.memory:
            self.memory.move_to_end(key)
            return
        if key in self.disk:
            self._drop_disk(key)
        else:
            self.written += 1
        if len(data) > self.memory_bytes:
            return
        self.memory[key] = data
        self.resident["memory"] += len(data)
        while self.resident["memory"] > self.memory_bytes:
            old, blob = self.memory.popitem(last=False)
            self.resident["memory"] -= len(blob)
            self._to_disk(old, blob)

    def get(self, key: bytes) -> bytes | None:
        """The block (now the most recently used), or None."""
        data = self.memory.get(key)
        if data is not None:
            self.memory.move_to_end(key)
            return data
        if key not in self.disk:
            return None
        try:
            with open(self._path(key), "rb") as fh:
                data = fh.read()
        except OSError:
            data = None
        self._drop_disk(key)
        if data is not None:
            self.put(key, data)
        return data

    def _path(self, key: bytes) -> str:
        assert self.dir is not None
        return os.path.join(self.dir, key.hex())

    def _to_disk(self, key: bytes, data: bytes) -> None:
        if len(data) > self.disk_bytes:
            self.evicted += 1
            return
        try:
            with open(self._path(key), "wb") as fh:
                fh.write(data)
        except OSError:
            self.evicted += 1
            return
        self.disk[key] = len(data)
        self.resident["disk"] += len(data)
        while self.resident["disk"] > self.disk_bytes:
            self._drop_disk(next(iter(self.disk)))
            self.evicted += 1

    def _drop_disk(self, key: bytes) -> None:
        self.resident["disk"] -= self.disk.pop(key)
        try:
            os.unlink(self._path(key))
        except OSError:
            pass
