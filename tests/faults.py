"""Fault injection from the test side: a model runner whose step fails when it feeds a
chosen token id, in-process (``failing_forward``) or in a real server's gpu_worker
(``fault_env``), and a gpu_worker rank that misses one step plan (``drop_plan_env``); the
children import ``tests/fault_site/sitecustomize.py``."""

from __future__ import annotations

import functools
import json
import os
import sys
from pathlib import Path
from typing import Callable

FAULT_TOKEN_ENV = "CANDOR_TEST_FAULT_TOKEN"
DROP_PLAN_ENV = "CANDOR_TEST_DROP_PLAN"
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


def _site_env(**faults: str) -> dict[str, str]:
    inherited = os.environ.get("PYTHONPATH")
    return {**faults,
            "PYTHONPATH": os.pathsep.join(p for p in (str(SITE_DIR), inherited) if p)}


def fault_env(token: int) -> dict[str, str]:
    """Environment for a ``CandorServer`` whose gpu_worker fails a step feeding ``token``
    (the launcher keeps an inherited PYTHONPATH after its own directory)."""
    return _site_env(**{FAULT_TOKEN_ENV: str(token)})


def drop_plan_env(index: int, step_id: int) -> dict[str, str]:
    """Environment for a ``CandorServer`` whose gpu_worker ``index`` misses plan
    ``step_id``."""
    return _site_env(**{DROP_PLAN_ENV: f"{index}:{step_id}"})


def dropping_plan(recv: Callable, index: int, step_id: int) -> Callable:
    """``Receiver.recv`` that, in the gpu_worker process ``index`` only, swallows the step
    plan ``step_id`` (once) and returns what follows it."""
    argv = sys.argv[1] if len(sys.argv) > 1 else "{}"
    try:
        config = json.loads(argv)
    except ValueError:
        config = {}
    if config.get("role") != "gpu_worker" or config.get("index") != index:
        return recv

    @functools.wraps(recv)
    def wrapper(self, timeout_ms=None):
        msg = recv(self, timeout_ms)
        if getattr(msg, "step_id", None) == step_id and type(msg).__name__ == "StepPlan":
            return recv(self, timeout_ms)
        return msg

    return wrapper
