"""The deterministic mode at the runner: a request's tokens and logprobs (top_logprobs and
prompt logprobs included) are bitwise the same alone, inside random batches, under other
prefill chunkings, on a prefix-cache hit, recomputed after preemption, with placeholders
(run-ahead), and on every architecture's switches (MoE, windows, soft-caps, q/k norms,
biases, GELU). Equality of the whole ``TokenLogprob`` structs, never a tolerance."""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch

from gpu_worker.model_runner import ModelRunner
from launcher.tiny_model import build_tiny_model
from protocol.ipc import PLACEHOLDER_TOKEN, SamplingParams, SeqChunk, StepPlan
from tests.support import model_zoo

GREEDY = SamplingParams(temperature=0.0, logprobs=5)
SEEDED = SamplingParams(temperature=0.9, top_p=0.95, top_k=40, seed=77, logprobs=3)
PROMPT = 50  # target prompt length: three full 16-token blocks and a bit
NEW = 12


@dataclass
class Req:
    rid: str
    prompt: list[int]
    params: SamplingParams
    new: int = NEW
    arrival: int = 0
    prefix_from: str | None = None  # a request whose first full blocks this prompt reuses
    preempt_after: int | None = None  # recompute from scratch after this many tokens
    out: list = field(default_factory=list)  # (token, its TokenLogprob)
    prompt_logprobs: list | None = None
    blocks: list[int] | None = None
    fed: int = 0
    feed: list[int] = field(default_factory=list)  # what the next prefill chunks feed
    kept: int = 0
    preempted: bool = False


def serve(runner: ModelRunner, reqs: list[Req], *, chunk: int, max_prefill: int = 2, seed: int = 0,
          placeholders: bool = True) -> dict[str, Req]:
    """A small continuous-batching scheduler in the scheduler's image: chunked prefills,
    decodes fed as placeholders, shuffled plan order, shared prefix blocks, preemption by
    recompute (same rid, the worker keeps its sampler state)."""
    rng = random.Random(seed)
    bs = runner.block_size
    free = list(range(runner.num_blocks))
    rng.shuffle(free)
    by_rid = {r.rid: r for r in reqs}
    step = 0
    while any(len(r.out) < r.new for r in reqs):
        new_sampling = {}
        for r in reqs:
            if r.blocks is None and r.arrival <= step:
                src = by_rid.get(r.prefix_from) if r.prefix_from else None
                shared = 0
                if src is not None:  # full blocks of a common prefix, one token left to compute
                    common = next((i for i, (a, b) in enumerate(zip(src.prompt, r.prompt)) if a != b),
                                  min(len(src.prompt), len(r.prompt)))
                    shared = min(common, len(r.prompt) - 1) // bs
                    if src.blocks is None or src.fed < shared * bs:
                        continue  # the prefix's blocks are not written yet
                r.blocks = list(src.blocks[:shared]) if shared else []
                r.fed = len(r.blocks) * bs
                r.blocks += [free.pop() for _ in range(-(-(len(r.prompt) + r.new) // bs) - len(r.blocks))]
                r.feed = list(r.prompt)
                new_sampling[r.rid] = r.params
        seqs, prefilling = [], 0
        for r in reqs:
            if r.blocks is None or len(r.out) >= r.new:
                continue
            if r.preempt_after is not None and len(r.out) == r.preempt_after and not r.preempted:
                r.preempted = True  # recompute prompt + generated on fresh blocks
                r.feed = r.prompt + [t for t, _ in r.out]
                r.blocks = [free.pop() for _ in range(len(r.blocks))]
                r.fed, r.kept = 0, 0
            if r.fed < len(r.feed):
                if prefilling == max_prefill:
                    continue
                n = min(chunk, len(r.feed) - r.fed)
                last = r.fed + n == len(r.feed)
                seqs.append(SeqChunk(r.rid, r.feed[r.fed:r.fed + n], r.fed, r.blocks[r.kept:], last, r.kept))
                r.fed += n
                prefilling += 1
            else:
                token = PLACEHOLDER_TOKEN if placeholders else r.out[-1][0]
                seqs.append(SeqChunk(r.rid, [token], len(r.prompt) + len(r.out) - 1, r.blocks[r.kept:], True,
                                     r.kept))
            r.kept = len(r.blocks)
        rng.shuffle(seqs)
        result = runner.execute(StepPlan(step, seqs, new_sampling, []))
        logprobs = iter(result.logprobs or [None] * len(result.sampled))
        sampled = iter(result.sampled)
        for s in seqs:
            if s.sample:
                r, lp = by_rid[s.rid], next(logprobs)
                r.out.append((next(sampled), lp.token if lp is not None else None))
                if lp is not None and lp.prompt is not None:
                    r.prompt_logprobs = lp.prompt
        step += 1
        assert step < 5000
    runner.execute(StepPlan(step, [], {}, released=list(by_rid)))  # the next run starts afresh
    return by_rid


def _prompt(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(6, model_zoo.VOCAB) for _ in range(n)]


def _others(rng: random.Random, count: int) -> list[Req]:
    out = []
    for i in range(count):
        params = rng.choice([GREEDY, SEEDED, SamplingParams(temperature=1.0),
                             SamplingParams(temperature=0.7, seed=i, logprobs=20)])
        out.append(Req(f"x{i}", _prompt(rng, rng.randint(1, 90)), params, new=rng.randint(1, 20),
                       arrival=rng.randint(0, 6)))
    return out


def _target(params: SamplingParams, **kw) -> Req:
    return Req("t", _prompt(random.Random(5), PROMPT), params, **kw)


def _scenarios(params: SamplingParams) -> dict[str, tuple[list[Req], dict]]:
    """name -> (requests, serve() options); the target is always rid "t"."""
    rng = random.Random(11)
    base = _target(params)
    return {
        "alone, one chunk": ([_target(params)], dict(chunk=256)),
        "alone, 7-token chunks": ([_target(params)], dict(chunk=7)),
        "alone, no placeholders": ([_target(params)], dict(chunk=16, placeholders=False)),
        "busy batch": ([_target(params, arrival=2), *_others(rng, 14)], dict(chunk=16, max_prefill=3, seed=1)),
        "other busy batch": ([_target(params, arrival=0), *_others(rng, 20)], dict(chunk=33, seed=2)),
        "prefix-cache hit": ([Req("p", base.prompt[:40] + _prompt(rng, 9), GREEDY, new=2),
                              _target(params, arrival=1, prefix_from="p"), *_others(rng, 5)],
                             dict(chunk=16, seed=3)),
        "preempted and recomputed": ([_target(params, preempt_after=5), *_others(rng, 6)],
                                     dict(chunk=24, seed=4)),
    }


def _check(runner: ModelRunner, params: SamplingParams) -> None:
    results = {name: serve(runner, reqs, **opts)["t"] for name, (reqs, opts) in _scenarios(params).items()}
    want = results.pop("alone, one chunk")
    assert len({t for t, _ in want.out}) >= 3  # not a degenerate model
    assert all(lp is not None and len(lp.top_ids) == params.logprobs for _, lp in want.out)
    for name, got in results.items():
        assert got.out == want.out, f"{name}: tokens or logprobs differ from the request alone"


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("tiny") / "model")


@pytest.mark.parametrize("params", [GREEDY, SEEDED], ids=["greedy", "seeded"])
def test_tiny_model_is_batch_invariant(tiny_dir, params):
    runner = ModelRunner(str(tiny_dir), num_blocks=400)
    assert runner.deterministic, runner.deterministic_note
    _check(runner, params)


def test_prompt_logprobs_are_batch_invariant(tiny_dir):
    params = SamplingParams(temperature=0.0, logprobs=2, prompt_logprobs=4, num_prompt_tokens=PROMPT)
    runner = ModelRunner(str(tiny_dir), num_blocks=400)
    rng = random.Random(8)
    alone = serve(runner, [_target(params)], chunk=256)["t"]
    chunked = serve(runner, [_target(params, arrival=1), *_others(rng, 10)], chunk=9, seed=5)["t"]
    assert alone.prompt_logprobs is not None and len(alone.prompt_logprobs) == PROMPT
    assert chunked.prompt_logprobs == alone.prompt_logprobs
    assert chunked.out == alone.out


@pytest.mark.parametrize("arch", ["qwen3_moe", "gemma2", "mistral-window", "olmo2", "starcoder2",
                                  "llama-yarn-gelu", "phi3"])
def test_architecture_is_batch_invariant(arch, tmp_path):
    path = model_zoo.build(arch, tmp_path / arch)
    runner = ModelRunner(str(path), num_blocks=400)
    assert runner.deterministic, runner.deterministic_note
    _check(runner, GREEDY)


# (--deterministic flag, the batch-invariant kernel builds) -> (mode on, backend), or the
# error a worker refuses to start with.
FLAG_MAPPING = [
    (None, True, (True, "cpu_kernel")),
    (True, True, (True, "cpu_kernel")),
    (False, True, (False, "cpu_kernel")),
    (None, False, (False, "torch")),
    (True, False, RuntimeError),
    (False, False, (False, "torch")),
]


@pytest.mark.parametrize("asked,kernel,expected", FLAG_MAPPING)
def test_flag_maps_to_the_mode_the_layers_and_the_attention_backend(tiny_dir, monkeypatch, asked, kernel,
                                                                     expected):
    """The three states of ``--deterministic`` where the device has a batch-invariant
    attention kernel and where it has none: unset runs it where it can (off with the
    reason elsewhere), set requires it, ``--no-`` turns it off. The mode is one decision
    the layers (``Numerics``: padded matmuls) and the attention backend (its spec) share."""
    from gpu_worker.attention import cpu_kernel_backend

    if not kernel:
        monkeypatch.setattr(cpu_kernel_backend, "load", lambda: None)  # as where no compiler exists
    elif cpu_kernel_backend.load() is None:
        pytest.skip("no C++ toolchain for the CPU attention kernel")
    if expected is RuntimeError:
        with pytest.raises(RuntimeError, match="--deterministic asked for, but: .*not batch-invariant"):
            ModelRunner(str(tiny_dir), num_blocks=40, deterministic=asked)
        return
    on, backend = expected
    runner = ModelRunner(str(tiny_dir), num_blocks=40, deterministic=asked)
    assert runner.deterministic is on and runner.attn_spec.batch_invariant is on
    assert runner.attn_backend.name == backend
    assert runner.model.tp.numerics is runner.numerics
    if on:
        assert runner.deterministic_note.startswith("on") and runner.numerics.min_rows >= 1
    else:
        assert runner.numerics.min_rows == 1  # no padding
        why = "(--no-deterministic)" if asked is False else "torch: not batch-invariant"
        assert runner.deterministic_note.startswith("off") and why in runner.deterministic_note
