"""Which detokenizer owns a request: the scheduler routes by it, and a frontend uses it
to fail exactly the requests a restarted detokenizer lost."""

from __future__ import annotations

import zlib


def detokenizer_index(rid: str, count: int) -> int:
    return zlib.crc32(rid.encode()) % count
