"""Start-up and shutdown plumbing shared by every role's process main.

Children die with the launcher (PR_SET_PDEATHSIG), turn SIGTERM into a clean stop flag,
ignore SIGINT (Ctrl-C in a terminal reaches the whole process group; the launcher alone
turns it into an orderly drain, so no child may stop on its own), and read their config
from argv, so a role never depends on hidden state.
"""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import sys
import threading
from typing import TypeVar

import msgspec

from cluster.process_config import ProcessConfig

C = TypeVar("C", bound=ProcessConfig)

_PR_SET_PDEATHSIG = 1


def die_with_parent() -> None:
    """Ask Linux to SIGKILL us when the launcher goes away, so no child outlives it, and
    leave SIGINT to the launcher.

    The launcher stops children with SIGTERM (graceful) itself; this signal only fires
    when the launcher died without doing so, and then the topology is gone anyway."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    except OSError:  # not Linux: the launcher's own cleanup still applies
        return
    if os.getppid() == 1:  # the parent already died before prctl took effect
        sys.exit(1)


class StopFlag:
    """Set by SIGTERM (the launcher's stop); loops poll it between units of work."""

    def __init__(self) -> None:
        self._event = threading.Event()
        signal.signal(signal.SIGTERM, self._set)

    def _set(self, signum, frame) -> None:  # noqa: ARG002 - signal handler signature
        self._event.set()

    def is_set(self) -> bool:
        return self._event.is_set()


def read_config(kind: type[C], argv: list[str] | None = None) -> C:
    """This process's config, of its role's type (``kind``), from its one argument."""
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        raise SystemExit(f"usage: python -m <role> '<{kind.__name__} JSON>'")
    return msgspec.json.decode(argv[0], type=kind)


def setup_logging(cfg: ProcessConfig) -> logging.Logger:
    name = cfg.name
    logging.basicConfig(
        level=os.environ.get("CANDOR_LOG_LEVEL", "INFO"),
        format=f"%(asctime)s {name} %(levelname)s %(message)s", stream=sys.stderr)
    return logging.getLogger(name)
