"""Speculative decoding's ``draft_model`` at the runner: the draft model proposes after each
verified step (``SeqChunk.propose`` -> ``StepResult.drafts``), the next step verifies those
drafts, and the answer is bitwise the one decoding a token a step without a draft model
(tokens, logprobs, top_logprobs), greedy, seeded and with penalties, alone and batched.

Its cache is checked directly: at every step its proposals equal what a fresh draft
model proposes after computing the request's real ids from scratch, through chunked
prefill, prefix-cache hits, preemption (recompute on other blocks) and rejected drafts.
A draft model equal to the target proposes the target's own greedy tokens: every draft
is kept."""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from gpu_worker.draft_model import DraftFeed, DraftModel
from gpu_worker.model_runner import ModelRunner
from launcher.tiny_model import build_tiny_model
from protocol.ipc import SamplingParams, SeqChunk, StepPlan
from tests.support import model_zoo

K = 4
NEW = 24
GREEDY = SamplingParams(temperature=0.0, logprobs=5)
SEEDED = SamplingParams(temperature=0.9, top_p=0.95, top_k=40, seed=77, logprobs=3)
PENALIZED = SamplingParams(temperature=0.8, seed=5, logprobs=4, presence_penalty=0.7,
                           frequency_penalty=0.4, repetition_penalty=1.3,
                           logit_bias=[(7, 2.5), (9, -1.0)], min_tokens=6,
                           min_tokens_stop_ids=[0, 1, 2], num_prompt_tokens=40)


@pytest.fixture(scope="module")
def target(tmp_path_factory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("target") / "model")


@pytest.fixture(scope="module")
def other(target, tmp_path_factory) -> Path:
    """A draft with the target's tokenizer and weights of its own: few drafts match."""
    return model_zoo.build_draft(tmp_path_factory.mktemp("draft") / "model", target)


def _prompt(seed: int, n: int = 40) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(6, 2048) for _ in range(n)]


@dataclass
class Run:
    """What ``generate`` saw: each request's (token, TokenLogprob) list, and per step
    with drafts (drafted, kept)."""

    out: dict[str, list] = field(default_factory=dict)
    verified: list[tuple[int, int]] = field(default_factory=list)
    proposals: int = 0

    @property
    def drafted(self) -> int:
        return sum(d for d, _ in self.verified)

    @property
    def kept(self) -> int:
        return sum(m for _, m in self.verified)


def generate(runner: ModelRunner, prompts: dict[str, tuple[list[int], SamplingParams]], *,
             k: int = K, new: int = NEW, chunk: int | None = None,
             preempt_after: int | None = None, hits: dict[str, list[int]] | None = None,
             spoil=None, check=None, step0: int = 0) -> Run:
    """Drive ``runner`` as the scheduler does with a draft model: prefill (in chunks of
    ``chunk`` ids), then decode with the latest proposals as drafts (none: ``k`` 0).
    ``hits``: rid -> leading blocks already holding its first ids (a prefix-cache hit:
    its first chunk starts after them). ``preempt_after``: recompute a request on new
    blocks once it has that many tokens. ``spoil(rid, step, drafts)`` may replace a
    step's drafts (wrong ones: rejected); ``check(rid, ids, proposals)`` sees every
    proposal with the request's real ids."""
    bs = runner.block_size
    free = [b for b in range(runner.num_blocks) if all(b not in t for t in (hits or {}).values())]
    random.Random(3).shuffle(free)
    span = -(-(max(len(p) for p, _ in prompts.values()) + new + k + 8) // bs)
    tables = {rid: list((hits or {}).get(rid, [])) for rid in prompts}
    for table in tables.values():
        table += [free.pop() for _ in range(span - len(table))]
    run = Run(out={rid: [] for rid in prompts})
    fed = {rid: len((hits or {}).get(rid, [])) * bs for rid in prompts}  # ids in the cache
    proposed: dict[str, list[int]] = {}
    sent: set[str] = set()
    step = step0
    while any(len(o) < new for o in run.out.values()):
        step += 1
        seqs = []
        for rid, (prompt, _) in prompts.items():
            out = run.out[rid]
            if len(out) >= new:
                continue
            ids = prompt + [t for t, _ in out]
            kept = len(tables[rid]) if rid in sent else 0
            blocks = [] if rid in sent else tables[rid]
            if preempt_after is not None and len(out) >= preempt_after and fed[rid] == len(ids) - 1:
                preempt_after = None  # (once) its blocks freed: recomputed on new ones
                tables[rid] = [free.pop() for _ in range(span)]
                fed[rid], kept, blocks = 0, 0, tables[rid]
            todo = ids[fed[rid]:]
            if chunk is not None and len(todo) > chunk:
                seqs.append(SeqChunk(rid, todo[:chunk], fed[rid], blocks, False, kept))
                continue
            draft = proposed.pop(rid, []) if len(todo) == 1 else []
            draft = draft[:new - len(out) - 1]
            if spoil is not None and draft:
                draft = spoil(rid, step, draft)
            seqs.append(SeqChunk(rid, todo, fed[rid], blocks, True, kept, [], draft, [], k))
        new_sampling = {rid: prompts[rid][1] for rid in prompts if rid not in sent}
        sent |= {s.rid for s in seqs}
        result = runner.execute(StepPlan(step, seqs, new_sampling, []))
        assert not result.failed, result.failed
        sampling = [s for s in seqs if s.sample]
        accepted = result.accepted or [0] * len(sampling)
        drafts = result.drafts or [[] for _ in sampling]
        for s in seqs:
            if not s.sample:
                fed[s.rid] += len(s.token_ids)
        for s, token, lp, m, d in zip(sampling, result.sampled, result.logprobs, accepted, drafts):
            assert 0 <= m <= len(s.draft) and len(d) <= k
            if s.draft:
                run.verified.append((len(s.draft), m))
            fed[s.rid] += len(s.token_ids) - len(s.draft) + m
            run.out[s.rid] += [*zip(s.draft[:m], lp.accepted), (token, lp.token)]
            ids = prompts[s.rid][0] + [t for t, _ in run.out[s.rid]]
            if d:
                run.proposals += 1
                proposed[s.rid] = d
                if check is not None:
                    check(s.rid, ids, d)
    runner.execute(StepPlan(step + 1, [], {}, released=list(prompts)))
    run.out = {rid: o[:new] for rid, o in run.out.items()}
    return run


def _plain(target: Path, prompts, new: int = NEW) -> dict[str, list]:
    """Decoding one token a step, no draft model: the reference answer."""
    runner = ModelRunner(str(target), num_blocks=300)
    return generate(runner, prompts, k=0, new=new).out


def _runner(target: Path, draft: Path, num_blocks: int = 300) -> ModelRunner:
    runner = ModelRunner(str(target), num_blocks=num_blocks, forced_drafts=K,
                         draft_model=str(draft))
    assert runner.deterministic and runner.draft.numerics.deterministic, runner.deterministic_note
    return runner


class Reference:
    """A fresh draft model: what it proposes after computing ``ids`` from scratch."""

    def __init__(self, draft: Path, block_size: int) -> None:
        import torch
        self.model = DraftModel(str(draft), k=K, vocab_size=2048, device=torch.device("cpu"),
                                dtype=torch.float32, block_size=block_size, max_model_len=2048,
                                max_num_seqs=1)
        self.model.allocate(64)
        self.model.settle(True)
        self.checked = 0

    def __call__(self, rid: str, ids: list[int], proposals: list[int]) -> None:
        import torch
        with torch.inference_mode():
            want = self.model.step([DraftFeed(0, ids, list(range(64)), len(proposals))])[0]
        assert proposals == want, f"{rid} after {len(ids)} ids: its cache differs from a fresh one"
        self.checked += 1


def test_a_draft_equal_to_the_target_has_every_draft_kept(target):
    prompts = {"g": (_prompt(1), GREEDY)}
    want = _plain(target, prompts)
    run = generate(_runner(target, target), prompts)
    assert run.out == want
    assert run.drafted >= NEW // 2 and run.kept == run.drafted, run.verified
    assert len(run.verified) <= -(-NEW // (K + 1)) + 1  # K + 1 tokens a step


@pytest.mark.parametrize("params", [GREEDY, SEEDED, PENALIZED], ids=["greedy", "seeded", "penalties"])
def test_another_draft_model_never_changes_tokens_or_logprobs(target, other, params):
    prompts = {"t": (_prompt(2), params)}
    want = _plain(target, prompts)
    assert all(lp is not None for _, lp in want["t"])
    run = generate(_runner(target, other), prompts)
    assert run.out == want, "the draft model changed the answer"
    assert run.drafted > 0 and run.kept < run.drafted, run.verified


def test_batched_requests_equal_each_alone(target, other):
    prompts = {f"r{i}": (_prompt(10 + i, 20 + 7 * i), p)
               for i, p in enumerate([GREEDY, SEEDED, PENALIZED, GREEDY])}
    want = {rid: _plain(target, {rid: v})[rid] for rid, v in prompts.items()}
    for draft in (target, other):
        run = generate(_runner(target, draft), prompts)
        assert run.out == want, f"batched with draft {draft.parent.name}: differs"
        assert run.drafted > 0


def test_its_cache_holds_the_real_ids_through_chunks_rejections_and_preemption(target, other):
    """Chunked prefill, drafts rejected (the draft model's own, and spoiled ones), a
    preemption recomputed on other blocks: every proposal is the one a fresh draft model
    makes after the request's real ids."""
    check = Reference(other, 16)
    prompts = {"a": (_prompt(3, 45), GREEDY), "b": (_prompt(4, 37), SEEDED)}

    def spoil(rid, step, drafts):  # every third step: wrong from the second draft on
        return drafts if step % 3 else drafts[:1] + [(t + 1) % 2048 for t in drafts[1:]]
    run = generate(_runner(target, other), prompts, chunk=16, preempt_after=9, spoil=spoil,
                   check=check)
    assert run.out == {rid: _plain(target, {rid: v})[rid] for rid, v in prompts.items()}
    assert check.checked == run.proposals and check.checked > 10


def test_a_prefix_cache_hit_reads_the_draft_cache_its_filler_wrote(target, other):
    """Request b starts after the blocks request a filled (a hit: its first chunk feeds
    from there on); its proposals are a fresh draft model's, and with the draft equal to
    the target every draft of b is kept."""
    prefix = _prompt(5, 48)  # three full blocks of 16
    for draft in (other, target):
        runner = _runner(target, draft)
        generate(runner, {"a": (prefix + [7, 8, 9], GREEDY)}, new=4)
        # the driver gave a the first blocks of its shuffled free list: the same 3 here
        free = list(range(runner.num_blocks))
        random.Random(3).shuffle(free)
        hit = [free.pop() for _ in range(3)]
        check = Reference(draft, runner.block_size) if draft is other else None
        b = generate(runner, {"b": (prefix + [11, 12], GREEDY)}, hits={"b": hit},
                     check=check, step0=100)
        assert b.out == _plain(target, {"b": (prefix + [11, 12], GREEDY)})
        if check is not None:
            assert check.checked == b.proposals > 0
        else:
            assert b.kept == b.drafted > 0, b.verified


def test_proposals_stop_at_the_context_end(target):
    """A request near max_model_len: the draft model proposes no position past it."""
    runner = ModelRunner(str(target), num_blocks=300, forced_drafts=K, draft_model=str(target),
                         max_model_len=64)
    prompt = _prompt(6, 58)
    run = generate(runner, {"e": (prompt, GREEDY)}, new=5)
    assert len(run.out["e"]) == 5 and run.kept == run.drafted
