"""A request's own bad state fails only that request, in the worker: a row with nothing
left to sample, a grammar that does not compile, a step that raised before a run-ahead
step queued behind it. Plans are driven by hand, as the scheduler sends them (decodes
feed PLACEHOLDER_TOKEN: the token the previous step sampled)."""

from __future__ import annotations

from pathlib import Path

import llguidance
import pytest

from gpu_worker.model_runner import ModelRunner
from launcher.tiny_model import build_tiny_model
from protocol.ipc import PLACEHOLDER_TOKEN, SamplingParams, SeqChunk, StepPlan
from tests.support.faults import failing_forward

GREEDY = SamplingParams(temperature=0.0)
EOS = [4, 1]  # the tiny checkpoint's end-of-sequence ids
PROMPT = [0, 17, 250, 33, 90, 401, 12]
OTHER = [0, 55, 66, 77, 88]
FAULT = 999


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("tiny") / "model")


@pytest.fixture(scope="module")
def runner(tiny_dir) -> ModelRunner:
    runner = ModelRunner(str(tiny_dir), num_blocks=64)
    runner._forward = failing_forward(runner._forward, FAULT)  # an engine fault on demand
    return runner


def _decode(rid: str, pos: int) -> SeqChunk:
    """Feed the token sampled last step at ``pos`` (the request's one block kept)."""
    return SeqChunk(rid, [PLACEHOLDER_TOKEN], pos, [], True, 1)


def _alone(runner: ModelRunner, rid: str, prompt: list[int], n: int, block: int) -> list[int]:
    """Greedy tokens of ``prompt`` run by itself (then released)."""
    first = StepPlan(0, [SeqChunk(rid, prompt, 0, [block], True)], {rid: GREEDY})
    out = runner.execute(first).sampled
    for k in range(1, n):
        out += runner.execute(StepPlan(k, [_decode(rid, len(prompt) + k - 1)])).sampled
    runner.execute(StepPlan(n, [], released=[rid]))
    return out


def _regex(pattern: str, min_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, grammar=llguidance.LLMatcher.grammar_from_regex(pattern),
                          num_prompt_tokens=len(PROMPT), min_tokens=min_tokens,
                          min_tokens_stop_ids=EOS)


def test_constraint_that_must_end_before_min_tokens_fails_only_its_row(runner):
    """``(yes|no)`` is over within a few tokens, then only EOS is allowed, which
    min_tokens holds back: that row fails with constraint_conflict; its run-ahead chunks
    are not fed; the request beside it and one joining later get their own tokens."""
    want = _alone(runner, "ref", OTHER, 6, block=9)
    late_want = _alone(runner, "ref2", PROMPT, 1, block=9)
    first = runner.execute(StepPlan(0, [SeqChunk("conflict", PROMPT, 0, [1], True),
                                        SeqChunk("other", OTHER, 0, [2], True)],
                                    {"conflict": _regex("(yes|no)", 20), "other": GREEDY}))
    got, failed_at = [first.sampled[1]], None
    for k in range(1, 6):
        seqs = [_decode("conflict", len(PROMPT) + k - 1), _decode("other", len(OTHER) + k - 1)]
        new = {}
        if failed_at is not None and k == failed_at + 1:  # joins the run-ahead step
            seqs.append(SeqChunk("late", PROMPT, 0, [3], True))
            new = {"late": GREEDY}
        res = runner.execute(StepPlan(k, seqs, new))
        got.append(res.sampled[1])
        if res.sampled[0] == -1:
            failure = res.failed["conflict"]
            assert (failure.code, failure.status, failure.param) == (
                "constraint_conflict", 400, "min_tokens")
            failed_at = k if failed_at is None else failed_at
        if new:
            assert res.sampled[2] == late_want[0]
    assert failed_at is not None and failed_at <= 3
    assert got == want
    assert set(runner.failed) == {"conflict"}
    runner.execute(StepPlan(9, [], released=["conflict", "other", "late"]))
    assert runner.failed == {} and "conflict" not in runner.grammars._states


def test_grammar_that_does_not_compile_fails_only_its_request(runner):
    want = _alone(runner, "ref", OTHER, 1, block=9)
    broken = SamplingParams(temperature=0.0, grammar="%%% nonsense")
    res = runner.execute(StepPlan(0, [SeqChunk("broken", PROMPT, 0, [1], True),
                                      SeqChunk("fine", OTHER, 0, [2], True)],
                                  {"broken": broken, "fine": GREEDY}))
    assert res.sampled == [-1, want[0]] and set(res.failed) == {"broken"}
    assert res.failed["broken"].code == "grammar_error"
    runner.execute(StepPlan(1, [], released=["broken", "fine"]))


def test_run_ahead_step_after_a_failed_step_runs_for_everyone_else(runner):
    """Step 1 fails (an engine fault: every request in it fails). Step 2 was queued
    behind it with placeholders for step 1's requests, one of them constrained, and a
    new request: the new one gets its own token; nobody is fed a token nobody sampled
    (a constrained matcher would refuse it and fail step 2 as well)."""
    want = _alone(runner, "ref", OTHER, 1, block=9)
    constrained = _regex("[a-z]{50}", 0)
    runner.execute(StepPlan(0, [SeqChunk("c", PROMPT, 0, [1], True),
                                SeqChunk("g", OTHER, 0, [2], True)],
                            {"c": constrained, "g": GREEDY}))
    with pytest.raises(RuntimeError, match="injected fault"):
        runner.execute(StepPlan(1, [_decode("c", len(PROMPT)), _decode("g", len(OTHER)),
                                    SeqChunk("f", [5, FAULT, 6], 0, [3], True)], {"f": GREEDY}))
    res = runner.execute(StepPlan(2, [_decode("c", len(PROMPT) + 1), _decode("g", len(OTHER) + 1),
                                      _decode("f", 3), SeqChunk("new", OTHER, 0, [4], True)],
                                  {"new": GREEDY}))
    assert res.sampled == [-1, -1, -1, want[0]]
    assert set(res.failed) == {"c", "g", "f"} and res.failed["c"].code == "engine_error"
    runner.execute(StepPlan(3, [], released=["c", "g", "f", "new"]))
    assert runner.failed == {}
