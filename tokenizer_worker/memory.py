"""Give freed heap back to the OS after a big request.

glibc keeps freed memory in its arenas, so one 30 MB prompt would leave the worker's RSS
high for the rest of its life; ``malloc_trim(0)`` releases the free pages. A no-op where
the C library has no such call (musl, macOS)."""

from __future__ import annotations

from cluster.heap import glibc_trim

__all__ = ["TRIM_AFTER_BYTES", "release_memory"]

TRIM_AFTER_BYTES = 1 << 20  # trimming costs about a millisecond; worth it past this much text

_MALLOC_TRIM = glibc_trim()


def release_memory() -> bool:
    """True when the C library returned memory to the OS."""
    return bool(_MALLOC_TRIM(0)) if _MALLOC_TRIM is not None else False
