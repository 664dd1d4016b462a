"""The C library's ``malloc_trim``, which every role may call to hand freed heap pages
back to the OS (glibc keeps them otherwise: a role's RSS would stay at its peak)."""

from __future__ import annotations

import ctypes
import ctypes.util
from collections.abc import Callable


def glibc_trim() -> Callable[[int], int] | None:
    """glibc's ``malloc_trim``, or None where the C library has none (musl, macOS)."""
    name = ctypes.util.find_library("c")
    try:
        fn = ctypes.CDLL(name).malloc_trim
    except (OSError, AttributeError, TypeError):
        return None
    fn.argtypes = [ctypes.c_size_t]
    fn.restype = ctypes.c_int
    return fn
