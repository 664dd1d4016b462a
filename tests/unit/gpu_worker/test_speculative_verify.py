"""Speculative verification at the runner: a request fed drafts gets bitwise the tokens and
logprobs (top_logprobs included) it gets decoding one token a step, whatever the drafts
(all right, all wrong, right up to some position), greedy or seeded, with penalties,
min_tokens and logit_bias, alone or beside other requests. And the M = 1 vs M = 1 + k row
harness: a verify chunk's rows equal decode rows, kernel by kernel."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from gpu_worker.attention import cpu_kernel_backend
from gpu_worker.model_runner import ModelRunner
from launcher.tiny_model import build_tiny_model
from protocol.ipc import SamplingParams, SeqChunk, StepPlan
from tests.support import model_zoo

PROMPT = 40
NEW = 24
GREEDY = SamplingParams(temperature=0.0, logprobs=5)
SEEDED = SamplingParams(temperature=0.9, top_p=0.95, top_k=40, seed=77, logprobs=3)
PENALIZED = SamplingParams(temperature=0.8, seed=5, logprobs=4, presence_penalty=0.7,
                           frequency_penalty=0.4, repetition_penalty=1.3,
                           logit_bias=[(7, 2.5), (9, -1.0)], min_tokens=6,
                           min_tokens_stop_ids=[0, 1, 2], num_prompt_tokens=PROMPT)


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("tiny") / "model")


def _prompt(seed: int, n: int = PROMPT) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(6, model_zoo.VOCAB) for _ in range(n)]


def generate(runner: ModelRunner, prompts: dict[str, tuple[list[int], SamplingParams]],
             drafter=None, new: int = NEW, preempt_after: int | None = None,
             forced: dict[str, list[int]] | None = None,
             forced_kept: list[tuple[int, int]] | None = None) -> dict[str, list]:
    """Prefill each prompt in one chunk, then decode until ``new`` tokens each (no
    placeholders). ``drafter(rid, step, out)`` -> drafts for that request's next decode
    (None: no speculation). ``preempt_after``: once a request has that many tokens or
    more, it is preempted as the scheduler does it (recompute: prompt + every generated
    token but the last fed again from position 0 on other blocks, the worker keeping its
    sampling state), then decodes on. ``forced``: filled with each request's latest
    ``StepResult.forced`` (the drafter may read it); ``forced_kept``: gets (drafts fed, drafts
    kept) of each step whose drafts were all forced ones. Returns rid ->
    [(token, TokenLogprob)]; asserts every kept count is in range."""
    bs = runner.block_size
    free = list(range(runner.num_blocks))
    random.Random(3).shuffle(free)
    span = -(-(len(max((p for p, _ in prompts.values()), key=len)) + new + 40) // bs)
    tables = {rid: [free.pop() for _ in range(span)] for rid in prompts}
    out: dict[str, list] = {rid: [] for rid in prompts}
    pos: dict[str, int] = {}
    step = 0
    sent: set[str] = set()
    preempted: set[str] = set()
    while any(len(o) < new for o in out.values()):
        step += 1
        seqs = []
        for rid, (prompt, _) in prompts.items():
            if len(out[rid]) >= new:
                continue
            kept = len(tables[rid]) if rid in sent else 0
            blocks = [] if rid in sent else tables[rid]
            if rid not in pos:
                seqs.append(SeqChunk(rid, list(prompt), 0, blocks, True, kept))
                continue
            if preempt_after is not None and len(out[rid]) >= preempt_after and rid not in preempted:
                preempted.add(rid)  # its blocks freed; recomputed on new ones
                tables[rid] = [free.pop() for _ in range(span)]
                ids = list(prompt) + [t for t, _ in out[rid]]
                seqs.append(SeqChunk(rid, ids, 0, tables[rid], True, 0))
                continue
            draft = drafter(rid, step, out[rid]) if drafter else []
            draft = draft[:new - len(out[rid]) - 1]
            seqs.append(SeqChunk(rid, [out[rid][-1][0]], pos[rid], blocks, True, kept, [], draft))
        new_sampling = {rid: prompts[rid][1] for rid in prompts if rid not in sent}
        sent |= set(new_sampling)
        result = runner.execute(StepPlan(step, seqs, new_sampling, []))
        assert not result.failed, result.failed
        accepted = result.accepted or [0] * len(seqs)
        for s, token, lp, m, f in zip(seqs, result.sampled, result.logprobs, accepted,
                                      result.forced or [None] * len(seqs)):
            assert 0 <= m <= len(s.draft)
            if forced_kept is not None and s.draft and s.draft == (forced or {}).get(s.rid):
                forced_kept.append((len(s.draft), m))
            if forced is not None and f is not None:
                forced[s.rid] = f
            kept = list(zip(s.draft[:m], lp.accepted))
            assert all(e.token_id == t for t, e in kept)
            out[s.rid] += [*kept, (token, lp.token)]
            pos[s.rid] = len(prompts[s.rid][0]) + len(out[s.rid]) - 1
    runner.execute(StepPlan(step + 1, [], {}, released=list(prompts)))
    return {rid: o[:new] for rid, o in out.items()}


def _drafters(want: list):
    """name -> drafter over the reference output ``want`` (tokens only)."""
    truth = [t for t, _ in want]

    def right(k):
        return lambda rid, step, out: truth[len(out):len(out) + k]

    def wrong(k):
        return lambda rid, step, out: [(t + 1) % model_zoo.VOCAB for t in truth[len(out):len(out) + k]]

    def partial(k):
        def f(rid, step, out):
            d = truth[len(out):len(out) + k]
            cut = step % (k + 1)
            return d[:cut] + [(t + 3) % model_zoo.VOCAB for t in d[cut:]]
        return f
    return {"right k=4": right(4), "right k=1": right(1), "wrong k=3": wrong(3),
            "partial k=5": partial(5)}


@pytest.mark.parametrize("params", [GREEDY, SEEDED, PENALIZED], ids=["greedy", "seeded", "penalties"])
def test_drafts_never_change_tokens_or_logprobs(tiny_dir, params):
    runner = ModelRunner(str(tiny_dir), num_blocks=200)
    assert runner.deterministic, runner.deterministic_note
    prompts = {"t": (_prompt(1), params)}
    want = generate(runner, prompts)["t"]
    assert len({t for t, _ in want}) >= 3 and all(lp is not None for _, lp in want)
    for name, drafter in _drafters(want).items():
        got = generate(runner, prompts, drafter)["t"]
        assert got == want, f"{name}: tokens or logprobs differ from decoding without drafts"


def test_drafts_in_a_batch_match_each_request_alone(tiny_dir):
    runner = ModelRunner(str(tiny_dir), num_blocks=400)
    prompts = {f"r{i}": (_prompt(10 + i, 20 + 7 * i), p)
               for i, p in enumerate([GREEDY, SEEDED, PENALIZED, GREEDY, SamplingParams(
                   temperature=0.7, seed=4, logprobs=20)])}
    alone = {rid: generate(runner, {rid: v})[rid] for rid, v in prompts.items()}
    truth = {rid: [t for t, _ in o] for rid, o in alone.items()}

    def drafter(rid, step, out):  # right for some, wrong for others, changing each step
        d = truth[rid][len(out):len(out) + 1 + (step + len(rid)) % 4]
        return d if (step + int(rid[1:])) % 3 else [(t + 1) % model_zoo.VOCAB for t in d]
    got = generate(runner, prompts, drafter)
    for rid in prompts:
        assert got[rid] == alone[rid], f"{rid}: differs in a speculating batch"


@pytest.mark.parametrize("params", [GREEDY, SEEDED, PENALIZED], ids=["greedy", "seeded", "penalties"])
def test_a_request_preempted_while_speculating_resumes_bitwise(tiny_dir, params):
    """Drafts kept before the preemption, the recompute of prompt + generated ids (drafts
    accepted and rejected alike gone from the cache) and drafts after it: the tokens and
    logprobs of decoding one token a step without preemption."""
    runner = ModelRunner(str(tiny_dir), num_blocks=200)
    prompts = {"t": (_prompt(1), params)}
    want = generate(runner, prompts)["t"]
    truth = [t for t, _ in want]

    def drafter(rid, step, out):  # right up to a point that moves, then wrong
        d = truth[len(out):len(out) + 4]
        cut = step % 3
        return d[:cut] + [(t + 5) % model_zoo.VOCAB for t in d[cut:]]
    for after in (3, 9, 17):
        got = generate(runner, prompts, drafter, preempt_after=after)["t"]
        assert got == want, f"preempted after {after} tokens: differs"


@pytest.mark.parametrize("arch", ["qwen3_moe", "gemma2", "mistral-window", "phi3"])
def test_verify_rows_equal_decode_rows_on_the_zoo(arch, tmp_path):
    """The model-level M = 1 vs M = 1 + k harness: every architecture's switches (MoE
    experts, windows, soft-caps, fused projections) give a verify chunk's rows the bits of
    decode rows."""
    runner = ModelRunner(str(model_zoo.build(arch, tmp_path / arch)), num_blocks=200)
    assert runner.deterministic, runner.deterministic_note
    prompts = {"t": (_prompt(2), GREEDY)}
    want = generate(runner, prompts, new=12)["t"]
    truth = [t for t, _ in want]
    got = generate(runner, prompts, lambda rid, step, out: truth[len(out):len(out) + 3], new=12)
    assert got["t"] == want


def test_drafts_on_a_prefill_chunk_are_a_plan_error(tiny_dir):
    runner = ModelRunner(str(tiny_dir), num_blocks=50)
    plan = StepPlan(1, [SeqChunk("g", [5, 6], 0, [0], True, 0, [], [7])],
                    {"g": SamplingParams(temperature=0.0)}, [])
    with pytest.raises(ValueError, match="drafts on a chunk that is not a decode"):
        runner.execute(plan)


# ------------------------------------------------------------ grammar-checked drafts

SCHEMA = {"type": "object", "properties": {
    "ok": {"type": "boolean"}, "n": {"type": "integer", "minimum": 0, "maximum": 99},
    "tag": {"enum": ["red", "green", "blue"]}},
    "required": ["ok", "n", "tag"], "additionalProperties": False}


def _constrained(params: SamplingParams) -> SamplingParams:
    import json

    import llguidance
    import msgspec
    return msgspec.structs.replace(
        params, grammar=llguidance.LLMatcher.grammar_from_json_schema(json.dumps(SCHEMA)),
        num_prompt_tokens=PROMPT)


@pytest.mark.parametrize("params", [GREEDY, SEEDED, PENALIZED], ids=["greedy", "seeded", "penalties"])
def test_grammar_checked_drafts_never_change_a_constrained_answer(tiny_dir, params):
    """A json_schema request fed drafts (right, wrong, right up to a point, and the
    tokens its grammar forces, which the worker reports after each sample) gets the
    tokens and logprobs of decoding one token a step: drafts the grammar refuses are
    cut before the forward pass, each verify row has its own position's mask, and the
    matcher is rolled back past rejected drafts. Forced drafts are always kept."""
    params = _constrained(params)
    plain = ModelRunner(str(tiny_dir), num_blocks=200)
    prompts = {"t": (_prompt(1), params)}
    want = generate(plain, prompts)["t"]
    text = [t for t, _ in want]
    assert len(set(text)) >= 6, text
    runner = ModelRunner(str(tiny_dir), num_blocks=200, forced_drafts=4)
    forced: dict[str, list[int]] = {}
    kept: list[tuple[int, int]] = []  # (forced drafts fed, kept) per step that had some
    cases = dict(_drafters(want))
    cases["forced"] = lambda rid, step, out: forced.get(rid, [])
    cases["forced, then wrong"] = lambda rid, step, out: (
        forced.get(rid, []) + [(t + 1) % model_zoo.VOCAB for t in text[len(out):len(out) + 2]])
    for name, drafter in cases.items():
        forced.clear()
        got = generate(runner, prompts, drafter, forced=forced,
                       forced_kept=kept if name == "forced" else None)["t"]
        assert got == want, f"{name}: tokens or logprobs differ from decoding without drafts"
    assert kept and all(k == n for n, k in kept), f"forced drafts refused: {kept}"


def test_forced_tokens_are_what_the_grammar_forces_after_the_sample(tiny_dir):
    import llguidance

    from gpu_worker.grammar import GrammarStates
    params = _constrained(GREEDY)
    runner = ModelRunner(str(tiny_dir), num_blocks=50, forced_drafts=8)
    prompt = _prompt(4)
    result = runner.execute(StepPlan(1, [SeqChunk("j", prompt, 0, [0, 1, 2, 3], True, 0)],
                                     {"j": params}, []))
    (first,), (forced,) = result.sampled, result.forced
    states = GrammarStates(str(tiny_dir), runner.config.vocab_size)
    matcher = llguidance.LLMatcher(states.tokenizer(), params.grammar)
    assert matcher.consume_token(first)
    assert forced == matcher.compute_ff_tokens()[:8] and forced, (first, forced)
    assert ModelRunner(str(tiny_dir), num_blocks=50).execute(
        StepPlan(1, [SeqChunk("j", prompt, 0, [0, 1, 2, 3], True, 0)], {"j": params}, [])
    ).forced == []  # speculation off: nothing computed


# ------------------------------------------------------------ the kernels, M = 1 vs 1 + k

KERNEL = cpu_kernel_backend.load()


def test_each_kernel_gives_a_verify_row_the_bits_of_a_decode_row(tiny_dir):
    """Per kernel of the decode path, on the tiny model's own weights and shapes: the
    matmuls (through ``Numerics``, padded as served), the norm, the activation, paged
    attention, the LM head, log-softmax and top-k: row j of an M = 1 + k batch equals
    the same row computed alone (M = 1), k = 1..8."""
    runner = ModelRunner(str(tiny_dir), num_blocks=50)
    numerics = runner.numerics
    g = torch.Generator().manual_seed(0)
    model = runner.model
    hidden = runner.config.hidden_size
    for k in range(1, 9):
        x = torch.randn(k + 1, hidden, generator=g)
        for weight, bias in model.matmuls():
            if weight.is_meta and id(weight) not in numerics.packed:
                continue
            xin = torch.randn(k + 1, weight.shape[1], generator=g)
            batched = numerics.linear(xin, weight, bias)
            for j in range(k + 1):
                assert torch.equal(numerics.linear(xin[j:j + 1], weight, bias)[0], batched[j]), \
                    f"matmul {tuple(weight.shape)}: row {j} of {k + 1}"
        act = numerics.activation("silu")
        norm = model.final_norm
        for name, f in (("silu", act), ("final norm", norm), ("log_softmax",
                        lambda t: torch.log_softmax(t, dim=-1))):
            batched = f(x)
            for j in range(k + 1):
                assert torch.equal(f(x[j:j + 1])[0], batched[j]), f"{name}: row {j} of {k + 1}"
        logits = model.compute_logits(x)
        values, ids = logits.topk(5, dim=-1)
        for j in range(k + 1):
            assert torch.equal(model.compute_logits(x[j:j + 1])[0], logits[j]), f"LM head row {j}"
            v1, i1 = logits[j:j + 1].topk(5, dim=-1)
            assert torch.equal(v1[0], values[j]) and torch.equal(i1[0], ids[j])


@pytest.mark.skipif(KERNEL is None, reason="no C++ toolchain for the CPU attention kernel")
@pytest.mark.parametrize("k", [1, 2, 4, 8])
def test_attention_verify_chunk_rows_equal_decode_rows(k):
    """Paged attention: the 1 + k rows of a verify chunk at the end of a sequence, beside
    other sequences' decode rows, equal each row attended alone."""
    from tests.unit.gpu_worker.test_batch_invariance import Sequences
    seqs = Sequences([37 + k, 20, 64], 4, 2, 32, seed=k)
    alone = seqs.alone()
    n = seqs.lens[0]
    rows = [(1, 19), *[(0, p) for p in range(n - k - 1, n)], (2, 63)]
    out = seqs.attend(rows)
    for i, row in enumerate(rows):
        assert torch.equal(out[i], alone[row]), f"row {row} of a verify chunk of {k + 1}"


# ------------------------------------------------------------ unseeded: the distribution

UNSEEDED = SamplingParams(temperature=1.0, top_k=8)
DRAWS = 3000


def _outcomes(runner: ModelRunner, prompt: list[int], params: SamplingParams,
              draft: list[int], speculate: bool, tag: str) -> list[tuple[int, ...]]:
    """DRAWS unseeded requests sharing ``prompt``'s first block (written once), each
    decoding its own continuation: with ``speculate``, one step fed ``draft`` (what it
    emits: the kept drafts and the token after them); without, one token a step while it
    follows ``draft``. Either way an outcome is the emitted tokens up to the first one
    that leaves ``draft``, or all of them: the same outcome space for both."""
    bs = runner.block_size
    assert len(prompt) == bs + 1
    rids = [f"{tag}{i}" for i in range(DRAWS)]
    tables = {rid: [0, 1 + i] for i, rid in enumerate(rids)}  # block 0: the prompt's
    step = 100 if speculate else 200
    runner.execute(StepPlan(step, [SeqChunk(f"{tag}-prompt", prompt[:bs], 0, [0], False, 0)],
                            {}, []))
    if speculate:
        seqs = [SeqChunk(rid, [prompt[bs]], bs, tables[rid], True, 0, [], list(draft))
                for rid in rids]
        result = runner.execute(StepPlan(step + 1, seqs, {rid: params for rid in rids}, []))
        assert not result.failed
        out = [tuple(draft[:m]) + (t,) for t, m in zip(result.sampled, result.accepted)]
    else:
        out = []
        live = {rid: [] for rid in rids}
        fed = {rid: [prompt[bs]] for rid in rids}
        new = {rid: params for rid in rids}
        while live:
            seqs = [SeqChunk(rid, fed[rid], bs + len(got), [] if not new else tables[rid], True,
                             0 if new else 2) for rid, got in live.items()]
            step += 1
            result = runner.execute(StepPlan(step, seqs, new, []))
            assert not result.failed
            new = {}
            for s, t in zip(seqs, result.sampled):
                got = live[s.rid]
                got.append(t)
                if len(got) > len(draft) or t != draft[len(got) - 1]:
                    out.append(tuple(live.pop(s.rid)))
                else:
                    fed[s.rid] = [t]
    runner.execute(StepPlan(step + 50, [], {}, released=[*rids, f"{tag}-prompt"]))
    return out


def _at_depth(outcomes: list[tuple[int, ...]], draft: list[int], j: int) -> list[int]:
    """The emitted token at position ``j`` of the outcomes that followed the drafts up
    to it (its conditional law given ``draft[:j]``)."""
    return [o[j] for o in outcomes if len(o) > j and list(o[:j]) == draft[:j]]


def _homogeneity_p(a: list, b: list) -> float:
    """Chi-square test that two samples come from one distribution (values expected
    fewer than 5 times in either sample pooled into one column)."""
    from collections import Counter

    from scipy.stats import chi2_contingency
    ca, cb = Counter(a), Counter(b)
    keys = sorted(set(ca) | set(cb), key=lambda k: -(ca[k] + cb[k]))
    common = [k for k in keys if (ca[k] + cb[k]) / 2 >= 5]
    rows = [[c[k] for k in common] for c in (ca, cb)]
    rare = [sum(c[k] for k in keys if k not in common) for c in (ca, cb)]
    if min(rare) >= 5:
        rows = [r + [x] for r, x in zip(rows, rare)]
    return chi2_contingency(rows).pvalue


def test_unseeded_sampling_with_drafts_keeps_the_distribution(tiny_dir):
    """Unseeded rows draw from the engine's shared generator, so speculation cannot keep
    their tokens, only their distribution: the law of each of the first three tokens
    emitted, given the drafts before it (drafts where the model's greedy choice is, so
    every position is reached often), is the same with drafts verified in one step as
    decoding one token a step. 2 x 3000 draws; chi-square homogeneity per position at
    p > 0.001 / 3; the test's own randomness is the runner's seed, fixed, so it cannot
    flake. Its power: a reference sampled at temperature 1.3 instead of 1.0 is told
    apart (p < 1e-4 at some position)."""
    runner = ModelRunner(str(tiny_dir), num_blocks=DRAWS + 8, seed=1234)
    prompt = _prompt(7, runner.block_size + 1)
    greedy = generate(runner, {"g": (prompt, GREEDY)}, new=2)["g"]
    draft = [t for t, _ in greedy]
    spec = _outcomes(runner, prompt, UNSEEDED, draft, True, "s")
    plain = _outcomes(runner, prompt, UNSEEDED, draft, False, "p")

    def p_values(other):
        return [_homogeneity_p(_at_depth(spec, draft, j), _at_depth(other, draft, j))
                for j in range(3)]
    reached = [len(_at_depth(spec, draft, j)) for j in range(3)]
    assert min(reached) > 150, f"positions 0, 1, 2 reached {reached} times: too few to test"
    same = p_values(plain)
    assert min(same) > 1e-3 / 3, f"speculation changed the unseeded distribution: p = {same}"
    hotter = _outcomes(runner, prompt, msgspec_replace(UNSEEDED, temperature=1.3), draft,
                       False, "h")
    assert min(p_values(hotter)) < 1e-4, "the test cannot tell temperature 1.3 from 1.0"


def msgspec_replace(params: SamplingParams, **changes) -> SamplingParams:
    import msgspec
    return msgspec.structs.replace(params, **changes)


def test_sampler_draws_verify_rows_of_a_group_independently():
    """At the sampler, against the exact law: groups of two verify rows with the same
    logits (where a row reusing its neighbour's noise would show most), the first fed
    draft ``d``: an outcome is the first row's token when it is not ``d``, else ``d``
    and the second row's token; P(t) = p(t), P(d, t) = p(d) p(t). 20000 groups in one
    call, chi-square goodness of fit at p > 0.001 (the sampler's seed fixed: no flake)."""
    from collections import Counter

    from gpu_worker.sampler import Sampler
    from scipy.stats import chisquare
    groups, d = 20000, 2
    logits = torch.tensor([1.2, 0.4, 1.0, -0.3, 0.7])
    p = torch.softmax(logits.double(), dim=-1).tolist()
    sampler = Sampler("cpu", seed=99)
    params = [SamplingParams(temperature=1.0)] * (2 * groups)
    tokens, _, failed = sampler.sample(logits.repeat(2 * groups, 1), params,
                                       [None] * (2 * groups), follow=[d, None] * groups)
    assert not failed
    outcomes = Counter((a,) if a != d else (d, b) for a, b in zip(tokens[::2], tokens[1::2]))
    law = {(t,): p[t] for t in range(5) if t != d} | {(d, t): p[d] * p[t] for t in range(5)}
    keys = sorted(law)
    assert set(outcomes) <= set(keys)
    total = sum(law.values())
    fit = chisquare([outcomes[k] for k in keys], [law[k] / total * groups for k in keys]).pvalue
    assert fit > 1e-3, f"verify rows do not draw as decode rows would: p = {fit:.2g}"
