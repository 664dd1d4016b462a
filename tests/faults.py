"""Fault injection from the test side: a model runner whose step fails when it feeds a
chosen token id, in-process (``failing_forward``) or in a real server's gpu_worker
(``fault_env``: the children import ``tests/fault_site/sitecustomize.py``)."""

from __future__ import annotations

import functools
import os
from pathlib import Path
from typing import Callable

FAULT_TOKEN_ENV = "CANDOR_TEST_FAULT_TOKEN"
SITE_DIR = Path(__file__).parent / "fault_site"


def failing_forward(forward: Callable, token: int) -> Callable:
    """``ModelRunner._forward`` (bound or not) that raises when a step feeds ``token``;
    it runs where a failing model would, after the step's placeholders are filled."""

    @functools.wraps(forward)
    def wrapper(*args, **kwargs):
        seqs = args[-1]
        if any(token in seq.token_ids for seq in seqs):
            raise RuntimeError(f"injected fault: token {token} was fed")
        return forward(*args, **kwargs)

    return wrapper


def fault_env(token: int) -> dict[str, str]:
    """Environment for a ``CandorServer`` whose gpu_worker fails a step feeding ``token``
    (the launcher keeps an inherited PYTHONPATH after its own directory)."""
    inherited = os.environ.get("PYTHONPATH")
    return {FAULT_TOKEN_ENV: str(token),
            "PYTHONPATH": os.pathsep.join(p for p in (str(SITE_DIR), inherited) if p)}
