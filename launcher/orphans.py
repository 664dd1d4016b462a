"""What a dead child leaves running: the launcher adopts it and stops it.

A gpu_worker stopped during its start-up kernel build (SIGKILLed past its grace, or
crashed) leaves ninja and the compiler running: PR_SET_PDEATHSIG is not inherited, and
ninja runs each command in a process group of its own, so neither the child's death nor
a signal to its group reaches them. They would outlive the launcher, load the box, and
race the next build into the same directory.

The launcher therefore makes itself their "subreaper" (PR_SET_CHILD_SUBREAPER): a
descendant whose parent dies becomes the launcher's child, not init's, and every process
the launcher did not spawn itself among its children is such an orphan. Only when the
launcher itself is SIGKILLed do they go to init (its children still die with it).
"""

from __future__ import annotations

import ctypes
import os
import signal
import time
from pathlib import Path

_PR_SET_CHILD_SUBREAPER = 36


def adopt_orphans() -> bool:
    """Become the parent of this process's descendants' orphans (Linux); False elsewhere."""
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
    except OSError:
        return False
    return libc.prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0


def children_of(pid: int) -> list[int]:
    """Direct children of ``pid``, from /proc."""
    out = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
            out.append(int(entry.name))
    return out


def kill_orphans(spawned: set[int], timeout_s: float = 5.0) -> list[int]:
    """SIGKILL and reap this process's children that are not in ``spawned`` (orphans it
    adopted), again as each one's own children are handed up, until none is left;
    returns their pids."""
    killed: list[int] = []
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        orphans = [pid for pid in children_of(os.getpid()) if pid not in spawned]
        if not orphans:
            break
        for pid in orphans:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        for pid in orphans:
            try:
                os.waitpid(pid, 0)
            except ChildProcessError:  # reaped already, or not ours after all
                pass
        killed += orphans
    return killed
