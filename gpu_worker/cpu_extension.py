"""Builds the worker's small C++ CPU kernels with ``torch.utils.cpp_extension``.

The system C++ compiler builds each source once (seconds to a minute) and torch caches
it under ``TORCH_EXTENSIONS_DIR``. The ISA and a hash of the source are part of the
module's name, so a cache shared between machines never hands an AVX2 binary to a CPU
without it, and checkouts with different sources (or venvs) never load each other's
binary nor rebuild over it.
Where the build fails, ``build`` returns None and the caller keeps its torch path.

torch serialises builders with a ``lock`` file that a process killed mid-build leaves
behind, after which every later load waits on it forever (a worker stopped during its
start-up build is enough). ``build`` therefore holds an OS lock (``flock``, released when
its holder dies) around the load, and under it any torch ``lock`` file is a stale one.

The ninja that builds is whichever is first on PATH (the system's, or the venv's ``ninja``
package when the venv's bin is on PATH, as in the children the launcher starts); versions
hash build commands differently, so each took the other's objects for stale and rebuilt.
Its version is part of the module's name too.
"""

from __future__ import annotations

import fcntl
import hashlib
import logging
import os
import shutil
import subprocess
import sys
from pathlib import Path

import torch

log = logging.getLogger(__name__)


def isa_flags() -> tuple[str, list[str]]:
    """AVX2+FMA code where torch's own dispatch found AVX2 (or better) on this CPU."""
    if torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512"):
        return "avx2", ["-mavx2", "-mfma"]
    return "generic", []


def wide_flags() -> tuple[str, ...]:
    """F16C on every AVX2 CPU (fp16 scales in one instruction each), and AVX-512 where
    torch found it: the GGML kernels then sum 16 lanes at a time, twice the work per
    instruction of AVX2 (batch 1 is bound by it), and the attention kernel takes a pair
    of query rows in one 16-lane vector. The flags are part of the build's name, so a
    cache shared with another CPU never hands it this binary."""
    if isa_flags()[0] != "avx2":
        return ()
    if torch.backends.cpu.get_cpu_capability() == "AVX512":
        return ("-mf16c", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq")
    return ("-mf16c",)


def int_dot_flags() -> tuple[str, ...]:
    """AVX-512 VNNI, and AMX's int8 tiles, where this CPU has them (Linux's cpuinfo says):
    the GGML kernels then multiply a block's integer codes by x's integer digits, exact
    sums whichever instruction adds them. Part of the build's name, as wide_flags."""
    if "-mavx512f" not in wide_flags():
        return ()
    try:
        with open("/proc/cpuinfo", encoding="ascii", errors="replace") as info:
            flags = next((line.split(":", 1)[1].split() for line in info if line.startswith("flags")), [])
    except OSError:
        return ()
    if "avx512_vnni" not in flags:
        return ()
    amx = ("-mamx-tile", "-mamx-int8") if {"amx_tile", "amx_int8"} <= set(flags) else ()
    return ("-mavx512vnni", *amx)


def _ninja_version() -> str:
    ninja = shutil.which("ninja")
    if ninja is None:
        return ""
    try:
        return subprocess.run([ninja, "--version"], capture_output=True, text=True,
                              timeout=30).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return ""


def build_dir(source: Path, cflags: tuple[str, ...] = ()) -> tuple[str, str]:
    """(module name, build directory) of ``source``: its ISA and a hash of its text, its
    extra flags, the Python, the torch it is built against (version and install: another
    venv's torch puts other include paths in the build command, which ninja rebuilds for)
    and the ninja that builds it. The directory is under ``TORCH_EXTENSIONS_DIR`` when set
    (as torch's own builds), else torch's per-user cache."""
    from torch.utils.cpp_extension import get_default_build_root

    isa, _ = isa_flags()
    key = (f"{source.read_text()}\0{' '.join(cflags)}\0{sys.version_info[:2]}\0{torch.__version__}"
           f"\0{os.path.dirname(torch.__file__)}\0{_ninja_version()}")
    name = f"candor_{source.stem}_{isa}_{hashlib.sha256(key.encode()).hexdigest()[:12]}"
    root = os.environ.get("TORCH_EXTENSIONS_DIR") or get_default_build_root()
    return name, os.path.join(root, name)


def build(source: Path, functions: list[str], openmp: bool = False, cflags: tuple[str, ...] = ()):
    """The compiled module exposing ``functions``, or None (logged) if it cannot be built.
    ``cflags``: extra compiler flags (part of the build's name, as the source is)."""
    try:
        from torch.utils.cpp_extension import load_inline

        _, flags = isa_flags()
        text = source.read_text()
        name, build_dir_ = build_dir(source, cflags)
        os.makedirs(build_dir_, exist_ok=True)
        with open(os.path.join(build_dir_, "candor.flock"), "w") as held:
            fcntl.flock(held, fcntl.LOCK_EX)
            try:
                os.remove(os.path.join(build_dir_, "lock"))  # only a dead builder's
            except FileNotFoundError:
                pass
            return load_inline(name, cpp_sources=[text], functions=functions,
                               extra_cflags=["-O3", *(["-fopenmp"] if openmp else []), *flags, *cflags],
                               build_directory=build_dir_)
    except Exception as exc:  # no compiler, no headers, ...: the torch path still works
        log.warning("CPU kernel %s unavailable, using the torch path: %s", source.name, exc)
        return None
