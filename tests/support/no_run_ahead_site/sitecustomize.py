"""Imported by every Python process started with this directory on PYTHONPATH (see
``tests/e2e/test_e2e_interactions.py: no_run_ahead_env``). In the scheduler process only, it
turns run-ahead planning off: at most one step in flight, so step N+1 is planned after
step N's tokens are known and no plan carries a placeholder. Candor has no switch for
this (run-ahead is always on), and a test hook must not become a shipped flag."""

from __future__ import annotations

import json
import sys

try:
    _role = json.loads(sys.argv[1]).get("role") if len(sys.argv) > 1 else None
except (ValueError, AttributeError):
    _role = None

if _role == "scheduler":
    import scheduler.engine_loop as _loop

    _loop.MAX_STEPS_IN_FLIGHT = 1
    print("scheduler: run-ahead off (tests/support/no_run_ahead_site)", file=sys.stderr, flush=True)
