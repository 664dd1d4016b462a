"""Hooks from the test side into a real server's processes (the children import
``tests/support/fault_site/sitecustomize.py``, which patches a module as it is imported), or
in-process:

- ``failing_forward`` / ``fault_env``: a step fails when it feeds a chosen token id.
- ``scripted_execute`` / ``script_env``: a request whose ``seed`` names a script gets
  exactly that script's tokens, whatever the weights say, so a test can make the real
  processes carry a reply random weights would never write (a call inside ``<think>``, a
  JSON object that is no call). Unconstrained requests only: a grammar would refuse.
- ``dropping_plan`` / ``drop_plan_env``: one gpu_worker rank never sees one step plan, as
  when its subscription reconnects while the plan is published.
- ``slow_execute`` / ``slow_env``: every step takes longer, so a request stays running
  while a test looks at it.
- ``faulty_kv_send`` / ``kv_fault_env``: a prefill rank's KV transfers are garbled (one
  byte flipped), lose their last frame, are never sent, or stall before being sent.
- ``misdeclared_kv_sender`` / ``kv_layout_env``: a prefill rank declares one field of its
  KV layout otherwise (as a node started with another checkpoint or dtype would).
- ``losing_store_import`` / ``store_import_lost_env``: a worker no longer holds the blocks
  the KV store sent it when a plan imports them (as when they expired).
- ``dying_before_scheduling`` / ``tokenizer_dies_env``: a tokenizer worker is killed after
  answering a request's ``RequestInfo``, before its ``TokenizedReq`` goes out."""

from __future__ import annotations

import functools
import json
import os
import sys
import time
from pathlib import Path
from typing import Callable

FAULT_TOKEN_ENV = "CANDOR_TEST_FAULT_TOKEN"
SCRIPTS_ENV = "CANDOR_TEST_SCRIPTS"
STEP_DELAY_ENV = "CANDOR_TEST_STEP_DELAY_S"
DROP_PLAN_ENV = "CANDOR_TEST_DROP_PLAN"
KV_FAULT_ENV = "CANDOR_TEST_KV_FAULT"
KV_FAULTS = ("garble", "drop_frame", "withhold", "stall")
KV_LAYOUT_ENV = "CANDOR_TEST_KV_LAYOUT"
STORE_IMPORT_LOST_ENV = "CANDOR_TEST_STORE_IMPORT_LOST"
TOKENIZER_DIES_ENV = "CANDOR_TEST_TOKENIZER_DIES_ON"
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


def scripted_execute(execute: Callable, scripts: dict[int, list[int]]) -> Callable:
    """``ModelRunner.execute`` whose sampled token for a request seeded with a key of
    ``scripts`` is that script's next token (by position, so preemption and run-ahead
    replay it the same); past the script's end the model samples as usual."""

    @functools.wraps(execute)
    def wrapper(self, plan):
        result = execute(self, plan)
        sampled = [s for s in plan.seqs if s.sample]
        for i, seq in enumerate(sampled[:len(result.sampled)]):
            params = self.sampling.get(seq.rid)
            script = scripts.get(params.seed) if params is not None else None
            at = seq.start_pos + len(seq.token_ids) - (params.num_prompt_tokens if params else 0)
            if script is not None and 0 <= at < len(script):
                result.sampled[i] = self.last_sampled[seq.rid] = script[at]
        return result

    return wrapper


def slow_execute(execute: Callable, delay: float) -> Callable:
    """``ModelRunner.execute`` that sleeps ``delay`` seconds before each step."""

    @functools.wraps(execute)
    def wrapper(self, plan):
        time.sleep(delay)
        return execute(self, plan)

    return wrapper


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


def faulty_kv_send(send: Callable, fault: str) -> Callable:
    """``KvSender.send`` with ``fault`` (one of ``KV_FAULTS``; ``stall:SECONDS`` sleeps
    that long first, so a test can kill the process mid-transfer)."""
    kind, _, arg = fault.partition(":")
    if kind not in KV_FAULTS:
        raise ValueError(f"unknown KV fault {fault!r}")

    @functools.wraps(send)
    def wrapper(sock, frames):
        if kind == "garble":
            victim = bytearray(frames[1])
            victim[len(victim) // 2] ^= 0xFF
            frames = [frames[0], bytes(victim), *frames[2:]]
        elif kind == "drop_frame":
            frames = frames[:-1]
        elif kind == "withhold":
            return True  # "sent": the decode side never hears of it
        elif kind == "stall":
            import time
            time.sleep(float(arg or 60))
        return send(sock, frames)

    return wrapper


def misdeclared_kv_sender(init: Callable, field: str, value: str) -> Callable:
    """``KvSender.__init__`` whose layout has ``field`` set to ``value`` (as its type)."""
    import msgspec

    @functools.wraps(init)
    def wrapper(self, ctx, cfg, layout, *args, **kwargs):
        kind = type(getattr(layout, field))
        init(self, ctx, cfg, msgspec.structs.replace(layout, **{field: kind(value)}), *args,
             **kwargs)

    return wrapper


def losing_store_import(import_into: Callable) -> Callable:
    """``StoreClient.import_into`` that first forgets the blocks held for each import."""

    @functools.wraps(import_into)
    def wrapper(self, runner, imports):
        with self.lock:
            for imp in imports:
                self.held.pop(imp.rid, None)
        return import_into(self, runner, imports)

    return wrapper


def dying_before_scheduling(send: Callable, marker: int) -> Callable:
    """``Sender.send`` that, in a tokenizer worker, SIGKILLs its process instead of sending
    a ``TokenizedReq`` whose prompt holds token ``marker`` (its ``RequestInfo`` has gone
    out: given time to leave the socket first)."""
    argv = sys.argv[1] if len(sys.argv) > 1 else "{}"
    try:
        role = json.loads(argv).get("role")
    except (ValueError, AttributeError):
        role = None
    if role != "tokenizer_worker":
        return send

    @functools.wraps(send)
    def wrapper(self, msg):
        if type(msg).__name__ == "TokenizedReq" and marker in msg.prompt_token_ids:
            import signal
            time.sleep(0.5)
            os.kill(os.getpid(), signal.SIGKILL)
        return send(self, msg)

    return wrapper


def _site_path() -> str:
    """PYTHONPATH with the site directory first (the launcher keeps an inherited
    PYTHONPATH after its own directory)."""
    inherited = os.environ.get("PYTHONPATH")
    return os.pathsep.join(p for p in (str(SITE_DIR), inherited) if p)


def fault_env(token: int) -> dict[str, str]:
    """Environment for a ``CandorServer`` whose gpu_worker fails a step feeding ``token``."""
    return {FAULT_TOKEN_ENV: str(token), "PYTHONPATH": _site_path()}


def script_env(scripts: dict[int, list[int]]) -> dict[str, str]:
    """Environment for a ``CandorServer`` whose gpu_worker writes ``scripts[seed]`` for a
    request with that seed."""
    return {SCRIPTS_ENV: json.dumps({str(k): v for k, v in scripts.items()}),
            "PYTHONPATH": _site_path()}


def drop_plan_env(index: int, step_id: int) -> dict[str, str]:
    """Environment for a ``CandorServer`` whose gpu_worker ``index`` misses plan
    ``step_id``."""
    return {DROP_PLAN_ENV: f"{index}:{step_id}", "PYTHONPATH": _site_path()}


def slow_env(delay: float) -> dict[str, str]:
    """Environment for a ``CandorServer`` whose gpu_worker steps take ``delay`` s longer."""
    return {STEP_DELAY_ENV: str(delay), "PYTHONPATH": _site_path()}


def kv_fault_env(fault: str) -> dict[str, str]:
    """Environment for a ``CandorServer`` whose prefill ranks' KV transfers meet
    ``fault`` (see ``faulty_kv_send``)."""
    return {KV_FAULT_ENV: fault, "PYTHONPATH": _site_path()}


def kv_layout_env(field: str, value: str) -> dict[str, str]:
    """Environment for a ``CandorServer`` whose prefill ranks declare ``field`` of their
    KV layout as ``value`` (see ``misdeclared_kv_sender``)."""
    return {KV_LAYOUT_ENV: f"{field}={value}", "PYTHONPATH": _site_path()}


def store_import_lost_env() -> dict[str, str]:
    """Environment for a ``CandorServer`` whose workers lose every block the KV store sent
    them before a plan imports it (see ``losing_store_import``)."""
    return {STORE_IMPORT_LOST_ENV: "1", "PYTHONPATH": _site_path()}


def tokenizer_dies_env(marker: int) -> dict[str, str]:
    """Environment for a ``CandorServer`` whose tokenizer worker dies between a request's
    ``RequestInfo`` and its ``TokenizedReq`` when its prompt holds ``marker`` (see
    ``dying_before_scheduling``)."""
    return {TOKENIZER_DIES_ENV: str(marker), "PYTHONPATH": _site_path()}
