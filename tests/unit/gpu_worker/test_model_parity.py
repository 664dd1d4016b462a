"""Our paged Llama vs HF transformers, driven like the scheduler drives it.

A miniature continuous-batching scheduler (below) mixes chunked prefills with decodes,
admits requests at different steps, hands out shuffled block ids (block 0 included) and
reuses freed blocks, so stale cache contents and block-boundary crossings are exercised.
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from gpu_worker.model_runner import ModelRunner
from gpu_worker.sampler import Sampler
from launcher.tiny_model import build_tiny_model, init_weights
from protocol.ipc import PLACEHOLDER_TOKEN, SamplingParams, SeqChunk, StepPlan
from tests.support.faults import failing_forward

GREEDY = SamplingParams(temperature=0.0)
PROMPT_LENS = [1, 7, 16, 17, 64, 100, 190, 300]
ARRIVALS = [0, 0, 1, 3, 2, 5, 0, 8]
NEW_TOKENS = 32


# ---------------------------------------------------------------- fixtures / helpers


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("tiny") / "model")


@pytest.fixture(scope="module")
def hf_tiny(tiny_dir):
    return _hf_model(tiny_dir)


@pytest.fixture(scope="module")
def prompts(tiny_dir) -> list[list[int]]:
    """Real token ids: slices of the corpus, each starting with bos."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tiny_dir / "tokenizer.json"))
    corpus = (Path(__file__).resolve().parents[3] / "launcher/tiny_model/corpus.txt").read_text()
    ids = tok.encode(corpus, add_special_tokens=False).ids
    out = []
    for i, n in enumerate(PROMPT_LENS):
        start = 997 * i
        out.append([0] + ids[start : start + n - 1])
    return out


def _hf_model(path):
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None  # never stop early: compare exactly n tokens
    return model


def hf_greedy(model, prompt: list[int], n: int) -> list[int]:
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False)
    assert out.shape[1] == len(prompt) + n
    return out[0, len(prompt) :].tolist()


def run_continuous(
    runner: ModelRunner,
    prompts: list[list[int]],
    params: list[SamplingParams],
    *,
    new_tokens: int = NEW_TOKENS,
    arrivals: list[int] | None = None,
    chunk: int = 64,
    max_prefill_chunks: int = 2,
    seed: int = 0,
    placeholders: bool = False,
) -> list[list[int]]:
    """Mini scheduler: reserve blocks at admission, chunk prefills, batch decodes.
    ``placeholders``: decodes feed PLACEHOLDER_TOKEN, as a run-ahead scheduler does."""
    rng = random.Random(seed)
    bs = runner.block_size
    free = list(range(runner.num_blocks))
    rng.shuffle(free)
    arrivals = arrivals or [0] * len(prompts)
    reqs = [dict(rid=f"r{i}", prompt=p, arrival=a, params=sp, out=[], blocks=None, fed=0, done=False)
            for i, (p, a, sp) in enumerate(zip(prompts, arrivals, params))]
    released: list[str] = []
    step = 0
    while not all(r["done"] for r in reqs):
        new_sampling = {}
        for r in reqs:
            if r["blocks"] is None and r["arrival"] <= step:
                need = -(-(len(r["prompt"]) + new_tokens) // bs)
                if need <= len(free):
                    r["blocks"] = [free.pop() for _ in range(need)]
                    new_sampling[r["rid"]] = r["params"]
        seqs, prefilling = [], 0
        for r in reqs:
            if r["blocks"] is None or r["done"]:
                continue
            plen = len(r["prompt"])
            if r["fed"] < plen:
                if prefilling == max_prefill_chunks:
                    continue
                n = min(chunk, plen - r["fed"])
                seqs.append(SeqChunk(r["rid"], r["prompt"][r["fed"] : r["fed"] + n], r["fed"], r["blocks"],
                                     r["fed"] + n == plen))
                r["fed"] += n
                prefilling += 1
            else:
                pos = plen + len(r["out"]) - 1
                fed = PLACEHOLDER_TOKEN if placeholders else r["out"][-1]
                seqs.append(SeqChunk(r["rid"], [fed], pos, r["blocks"], True))
        rng.shuffle(seqs)  # plan order must not matter
        result = runner.execute(StepPlan(step, seqs, new_sampling, released))
        assert result.step_id == step and result.forward_s >= 0
        released = []
        sampled = iter(result.sampled)
        by_rid = {r["rid"]: r for r in reqs}
        for s in seqs:
            if s.sample:
                r = by_rid[s.rid]
                r["out"].append(next(sampled))
                if len(r["out"]) == new_tokens:
                    r["done"] = True
                    free.extend(r["blocks"])
                    released.append(r["rid"])
        assert next(sampled, None) is None
        step += 1
        assert step < 10_000
    return [r["out"] for r in reqs]


# ---------------------------------------------------------------- greedy parity


@pytest.fixture(scope="module")
def hf_reference(hf_tiny, prompts) -> list[list[int]]:
    return [hf_greedy(hf_tiny, p, NEW_TOKENS) for p in prompts]


def test_greedy_matches_hf_continuous_batch(tiny_dir, prompts, hf_reference):
    # 40 blocks < the 63 all requests need at once: later ones wait and reuse freed blocks.
    runner = ModelRunner(str(tiny_dir), block_size=16, num_blocks=40)
    ours = run_continuous(runner, prompts, [GREEDY] * len(prompts), arrivals=ARRIVALS)
    for plen, got, want in zip(PROMPT_LENS, ours, hf_reference):
        assert got == want, f"prompt of {plen} tokens diverged"
    for want in hf_reference:  # the random model is not degenerate
        assert len(set(want)) >= 8


def test_placeholder_decodes_match_hf(tiny_dir, prompts, hf_reference):
    """Every decode fed as PLACEHOLDER_TOKEN (the worker fills in its own last sample)."""
    runner = ModelRunner(str(tiny_dir), block_size=16, num_blocks=64)
    assert run_continuous(runner, prompts, [GREEDY] * len(prompts), placeholders=True) == hf_reference
    runner.execute(StepPlan(10_000, [], released=[f"r{i}" for i in range(len(prompts))]))
    assert runner.last_sampled == {}  # dropped with the released requests
    with pytest.raises(ValueError, match="placeholder"):  # nothing sampled for "z" yet
        runner.execute(StepPlan(0, [SeqChunk("z", [PLACEHOLDER_TOKEN], 0, [0], True)], {"z": GREEDY}))


def test_failed_step_does_not_fail_the_next_steps_other_requests(tiny_dir, prompts, hf_reference):
    """Step 1 fails (a fault injected on token 999) after step 2 was planned with a
    placeholder for its request: step 2 still runs, and its other request gets HF's token."""
    runner = ModelRunner(str(tiny_dir), num_blocks=64)
    runner._forward = failing_forward(runner._forward, 999)
    with pytest.raises(RuntimeError, match="injected fault"):
        runner.execute(StepPlan(0, [SeqChunk("bad", [5, 999, 6], 0, [0], True)], {"bad": GREEDY}))
    step2 = StepPlan(1, [SeqChunk("bad", [PLACEHOLDER_TOKEN], 3, [0], True),
                         SeqChunk("good", prompts[0], 0, list(range(1, 40)), True)], {"good": GREEDY})
    assert runner.execute(step2).sampled[1] == hf_reference[0][0]


def test_greedy_matches_hf_other_block_size(tiny_dir, prompts, hf_reference):
    runner = ModelRunner(str(tiny_dir), block_size=8, num_blocks=200)
    ours = run_continuous(runner, prompts, [GREEDY] * len(prompts), chunk=23, max_prefill_chunks=8, seed=3)
    assert ours == hf_reference


def _build_variant(path: Path, kind: str) -> Path:
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    common = dict(vocab_size=512, hidden_size=64, intermediate_size=160, num_hidden_layers=2,
                  num_attention_heads=4, max_position_embeddings=1024, tie_word_embeddings=False)
    if kind == "qwen2":  # q/k/v biases, untied lm_head, plain RoPE
        model = Qwen2ForCausalLM(Qwen2Config(num_key_value_heads=2, rms_norm_eps=1e-6, **common))
        shard = None
    else:  # every Llama bias, MHA, scaled RoPE, sharded checkpoint
        rope_type = kind.split("-")[1]
        cfg = LlamaConfig(num_key_value_heads=4, attention_bias=True, mlp_bias=True,
                          rope_scaling={"rope_type": rope_type, "factor": 4.0}, **common)
        model = LlamaForCausalLM(cfg)
        shard = "150KB"
    init_weights(model, seed=7)
    kwargs = {"max_shard_size": shard} if shard else {}
    model.save_pretrained(path, **kwargs)
    return path


@pytest.mark.parametrize("kind", ["qwen2", "llama-linear-bias", "llama-dynamic-bias"])
def test_variant_matches_hf(kind, tmp_path):
    path = _build_variant(tmp_path / kind, kind)
    if kind != "qwen2":
        assert (path / "model.safetensors.index.json").exists()
    runner = ModelRunner(str(path), block_size=16, num_blocks=64)
    assert runner.config.qkv_bias and not runner.config.tie_word_embeddings
    hf = _hf_model(path)
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 512, (n,), generator=g).tolist() for n in (1, 20, 70, 150)]
    want = [hf_greedy(hf, p, 16) for p in prompts]
    got = run_continuous(runner, prompts, [GREEDY] * 4, new_tokens=16, arrivals=[0, 1, 0, 2], chunk=32)
    assert got == want


# ---------------------------------------------------------------- sampling


def test_seeded_sampling_is_batch_invariant(tiny_dir, prompts):
    seeded = SamplingParams(temperature=0.8, top_p=0.9, top_k=50, seed=1234)
    runner = ModelRunner(str(tiny_dir), num_blocks=64, seed=5)
    alone = run_continuous(runner, [prompts[5]], [seeded], new_tokens=24)[0]

    others = [SamplingParams(temperature=1.0), SamplingParams(temperature=0.7, seed=99), GREEDY]
    runner = ModelRunner(str(tiny_dir), num_blocks=64, seed=6)
    batch = run_continuous(runner, [prompts[2], prompts[5], prompts[6], prompts[3]],
                           [others[0], seeded, others[1], others[2]], new_tokens=24, arrivals=[0, 2, 1, 0], seed=9)
    assert batch[1] == alone
    # A different seed gives a different stream; unseeded temperature 1 is not greedy.
    runner = ModelRunner(str(tiny_dir), num_blocks=64)
    other_seed = run_continuous(runner, [prompts[5]], [SamplingParams(temperature=0.8, top_p=0.9, top_k=50, seed=1)],
                                new_tokens=24)[0]
    assert other_seed != alone


def test_tiny_temperature_is_greedy(tiny_dir, prompts, hf_reference):
    runner = ModelRunner(str(tiny_dir), num_blocks=64)
    picks = [0, 4, 7]
    params = [SamplingParams(temperature=1e-4), SamplingParams(temperature=1e-30, top_p=0.5),
              SamplingParams(temperature=1e-4, top_k=3, seed=5)]
    got = run_continuous(runner, [prompts[i] for i in picks], params)
    assert got == [hf_reference[i] for i in picks]


def test_sampler_filters():
    sampler = Sampler(seed=0)
    probs = torch.tensor([[0.05, 0.5, 0.3, 0.15]])
    logits = probs.log().repeat(3, 1)
    logits[2] *= 1e6  # huge logits and a tiny temperature must stay finite
    params = [SamplingParams(top_k=2), SamplingParams(top_p=0.7), SamplingParams(temperature=1e-20)]
    p = sampler._probs(logits, params)
    assert torch.isfinite(p).all()
    assert p[0].nonzero().flatten().tolist() == [1, 2]
    assert p[1].nonzero().flatten().tolist() == [1, 2]  # 0.5 < 0.7, then 0.5 + 0.3 covers it
    assert p[2].tolist() == [0.0, 1.0, 0.0, 0.0]
    seen = set()
    for _ in range(200):
        seen.update(sampler.sample(logits[:2], params[:2], [None, None])[0])
    assert seen == {1, 2}
    # Seeded rows: same generator seed, same draws, whatever rows surround them.
    g1, g2 = torch.Generator().manual_seed(3), torch.Generator().manual_seed(3)
    p_open = SamplingParams(temperature=1.0)
    a = [sampler.sample(logits[:1], [p_open], [g1])[0][0] for _ in range(20)]
    b = [sampler.sample(logits, [p_open, p_open, GREEDY], [None, g2, None])[0][1] for _ in range(20)]
    assert a == b


# ---------------------------------------------------------------- runner plumbing


def test_dummy_load_format(tiny_dir, tmp_path):
    only_config = tmp_path / "cfg"
    only_config.mkdir()
    (only_config / "config.json").write_bytes((tiny_dir / "config.json").read_bytes())
    dummy = ModelRunner(str(only_config), load_format="dummy", num_blocks=16)
    real = ModelRunner(str(tiny_dir), num_blocks=16)
    shapes = lambda r: {n: tuple(p.shape) for n, p in r.model.named_parameters()}  # noqa: E731
    assert shapes(dummy) == shapes(real)
    assert not torch.equal(dummy.model.model.embed_tokens.weight, real.model.model.embed_tokens.weight)
    again = ModelRunner(str(only_config), load_format="dummy", num_blocks=16)
    assert all(torch.equal(a, b) for a, b in zip(dummy.model.parameters(), again.model.parameters()))
    res = dummy.execute(StepPlan(0, [SeqChunk("x", [0, 5, 9], 0, [3], True)], {"x": GREEDY}))
    assert len(res.sampled) == 1 and 0 <= res.sampled[0] < 2048


def test_kv_budget_and_limits(tiny_dir):
    runner = ModelRunner(str(tiny_dir), kv_cache_memory_bytes=2**20, max_model_len=100)
    # 2 (k, v) * 4 layers * 16 slots * 2 kv heads * 16 dims * 4 bytes = 16 KiB per block;
    # the budget's 64 blocks are 63 for the scheduler and the runner's scratch block.
    assert runner.num_blocks == 63 and runner.scratch_block == 63 and runner.max_model_len == 100
    assert tuple(runner.kv_caches[0][0].shape) == (64, 16, 2, 16)
    assert ModelRunner(str(tiny_dir), num_blocks=4, max_model_len=10**6).max_model_len == 2048
    with pytest.raises(ValueError, match="max_model_len"):
        runner.execute(StepPlan(0, [SeqChunk("a", [1] * 101, 0, list(range(7)), True)], {"a": GREEDY}))
    with pytest.raises(ValueError, match="block_table"):
        runner.execute(StepPlan(0, [SeqChunk("a", [1] * 17, 0, [0], True)], {"a": GREEDY}))
    with pytest.raises(ValueError, match="out of range"):  # the scratch block is not the scheduler's
        runner.execute(StepPlan(0, [SeqChunk("a", [1], 0, [63], True)], {"a": GREEDY}))
    with pytest.raises(ValueError, match="SamplingParams"):
        runner.execute(StepPlan(0, [SeqChunk("b", [1, 2], 0, [0], True)]))


def test_released_state_is_dropped(tiny_dir):
    runner = ModelRunner(str(tiny_dir), num_blocks=8)
    seeded = SamplingParams(temperature=1.0, seed=4)
    first = runner.execute(StepPlan(0, [SeqChunk("a", [0, 7, 8], 0, [1], True)], {"a": seeded})).sampled
    assert "a" in runner.generators
    res = runner.execute(StepPlan(1, [], released=["a"]))
    assert res.sampled == [] and "a" not in runner.sampling and "a" not in runner.generators
    # Re-registered after release: the seeded stream starts over.
    again = runner.execute(StepPlan(2, [SeqChunk("a", [0, 7, 8], 0, [5], True)], {"a": seeded})).sampled
    assert again == first
