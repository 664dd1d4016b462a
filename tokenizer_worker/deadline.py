"""Bounds on how long the tokenizer worker may spend on one request.

Two layers, because a template is untrusted code and a tokenizer is native code:

* ``time_limit``: a real-time interval timer whose signal raises ``RenderTimeout`` in the
  main thread; Jinja's compiled templates are Python bytecode, so the signal lands between
  two of their instructions and unwinds the render.
* ``Watchdog``: faulthandler's C-level timer thread, which needs no GIL, dumps the stuck
  stack and exits the process when one request runs far past every limit (e.g. inside one
  long native call that never returns to bytecode). The worker is stateless, so the
  launcher restarts it and the frontend fails the requests it held.
"""

from __future__ import annotations

import contextlib
import faulthandler
import signal
import threading
from collections.abc import Iterator

from tokenization.chat_template import RenderTimeout

__all__ = ["Watchdog", "time_limit"]


def _on_alarm(signum: int, frame: object) -> None:  # noqa: ARG001 - signal handler signature
    raise RenderTimeout("ran out of time")


@contextlib.contextmanager
def time_limit(seconds: float) -> Iterator[None]:
    """Raise ``RenderTimeout`` inside the block once ``seconds`` of wall time have passed.

    Only the main thread receives signals; elsewhere (unit tests in threads) the block runs
    unbounded and the watchdog remains the backstop.
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGALRM, _on_alarm)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


class Watchdog:
    """Exit the process if one request holds the worker longer than ``limit_s``."""

    def __init__(self, limit_s: float) -> None:
        self.limit_s = limit_s

    @contextlib.contextmanager
    def guard(self) -> Iterator[None]:
        faulthandler.dump_traceback_later(self.limit_s, exit=True)
        try:
            yield
        finally:
            faulthandler.cancel_dump_traceback_later()
