"""Speculative decoding's ``eagle3`` at the runner: a tiny random EAGLE-3 head in vLLM's
checkpoint layout proposes after each verified step from the target's aux hidden states.

The head's forward is checked against a plain-torch reference written from the layout
(fc over the three target states, the midlayer over concat(embeds, hidden), norm,
lm_head, d2t), draft after draft; the target's aux states against transformers' own
hidden states (vLLM's numbering: id i is the stream entering layer i). Through the
runner: the answer is bitwise the one without speculation (greedy, seeded, penalties,
alone and batched), and every proposal equals what a fresh head proposes after the
request's real ids computed from scratch, through chunked prefill (rows carried over a
chunk boundary), rejected drafts and preemption. A head that does not fit is refused."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from gpu_worker.eagle3 import Eagle3Drafter
from gpu_worker.model_config import load_config
from gpu_worker.model_runner import ModelRunner
from launcher.tiny_model import build_tiny_model
from protocol.ipc import StepPlan
from tests.support import model_zoo
from tests.unit.gpu_worker.test_draft_model import GREEDY, PENALIZED, SEEDED, _plain, _prompt, generate

K = 4
LAYERS = [1, 2, 4]  # the tiny target has 4 layers: 4 is the last one's output


@pytest.fixture(scope="module")
def target(tmp_path_factory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("target") / "model")


@pytest.fixture(scope="module")
def head(target, tmp_path_factory) -> Path:
    return model_zoo.build_eagle3(tmp_path_factory.mktemp("head") / "h", target, aux_layers=LAYERS)


@pytest.fixture(scope="module")
def small_vocab_head(target, tmp_path_factory) -> Path:
    """A draft vocabulary of 300 target ids (d2t maps them), its own embeddings, the
    default aux layers (2, 2, 1) and norm_before_residual."""
    return model_zoo.build_eagle3(tmp_path_factory.mktemp("head") / "v", target, seed=5,
                                  draft_vocab=300, embeddings=True, norm_before_residual=True)


def _runner(target: Path, head: Path, num_blocks: int = 300, **kw) -> ModelRunner:
    runner = ModelRunner(str(target), num_blocks=num_blocks, forced_drafts=K, draft_model=str(head),
                         draft_method="eagle3", **kw)
    assert runner.deterministic and runner.draft.numerics.deterministic, runner.deterministic_note
    assert isinstance(runner.draft, Eagle3Drafter)
    return runner


# ---------------------------------------------------------------------- the reference


def _tensors(path: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file
    return load_file(str(path / "model.safetensors"))


def _rms(x: torch.Tensor, w: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def _rope(x: torch.Tensor, pos: torch.Tensor, theta: float = 10000.0) -> torch.Tensor:
    d = x.shape[-1]
    inv = 1.0 / theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d)
    ang = pos[:, None].double() * inv[None]
    cos, sin = torch.cat([ang.cos()] * 2, -1).float(), torch.cat([ang.sin()] * 2, -1).float()
    rot = torch.cat([-x[..., d // 2:], x[..., :d // 2]], -1)
    return x * cos[:, None] + rot * sin[:, None]


def reference_prenorm(t: dict[str, torch.Tensor], ids: list[int], hidden: torch.Tensor,
                      embed: torch.Tensor, norm_before_residual: bool = False) -> torch.Tensor:
    """The head over rows 0..n-1 (row r: the id at r + 1 and ``hidden`` [n, H]), causal,
    written from the layout alone: its output state (before ``norm``) per row."""
    p, n = "midlayer.", len(ids)
    e = _rms(embed[torch.tensor(ids)], t[p + "input_layernorm.weight"])
    h = _rms(hidden, t[p + "hidden_norm.weight"])
    residual = h if norm_before_residual else hidden
    x = torch.cat([e, h], -1)
    q = (x @ t[p + "self_attn.q_proj.weight"].T).view(n, 4, 16)
    k = (x @ t[p + "self_attn.k_proj.weight"].T).view(n, 2, 16)
    v = (x @ t[p + "self_attn.v_proj.weight"].T).view(n, 2, 16)
    pos = torch.arange(n)
    q, k = _rope(q, pos), _rope(k, pos)
    k, v = k.repeat_interleave(2, 1), v.repeat_interleave(2, 1)
    scores = torch.einsum("qhd,khd->hqk", q, k) / math.sqrt(16)
    scores = scores.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
    attn = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).reshape(n, 64)
    residual = residual + attn @ t[p + "self_attn.o_proj.weight"].T
    m = _rms(residual, t[p + "post_attention_layernorm.weight"])
    mlp = (F.silu(m @ t[p + "mlp.gate_proj.weight"].T) * (m @ t[p + "mlp.up_proj.weight"].T)) \
        @ t[p + "mlp.down_proj.weight"].T
    return residual + mlp


def reference_drafts(t, ids: list[int], aux: torch.Tensor, embed: torch.Tensor, k: int,
                     norm_before_residual: bool = False) -> list[int]:
    """k greedy drafts after ``ids`` (the target's ``aux`` rows for all but the last)."""
    rows = list(ids[1:])
    hidden = aux @ t["fc.weight"].T
    drafts: list[int] = []
    for _ in range(k):
        pre = reference_prenorm(t, rows, hidden, embed, norm_before_residual)
        best = int((_rms(pre[-1], t["norm.weight"]) @ t["lm_head.weight"].T).argmax())
        drafts.append(best + int(t["d2t"][best]))
        rows.append(drafts[-1])
        hidden = torch.cat([hidden, pre[-1:]])
    return drafts


def _target_aux(runner: ModelRunner, ids: list[int]) -> torch.Tensor:
    """The target's aux rows for ``ids`` (a forward from scratch on blocks 0.. of a fresh
    runner's cache)."""
    table = list(range(-(-len(ids) // runner.block_size)))
    meta = runner.attn_backend.build([(0, len(ids), table)], 0)
    with torch.inference_mode():
        runner.model(torch.tensor(ids), torch.arange(len(ids)), runner.kv_caches, meta)
    return runner.model.captured.clone()


@pytest.mark.parametrize("which", ["head", "small_vocab_head"])
def test_the_heads_forward_equals_a_plain_torch_reference(target, which, request):
    path = request.getfixturevalue(which)
    runner = _runner(target, path, num_blocks=64)
    drafter = runner.draft
    t = _tensors(path)
    cfg = json.loads((path / "config.json").read_text())
    embed = t.get("embed_tokens.weight")
    if embed is None:  # the target's table (the tiny model ties it to its LM head)
        embed = runner.model.model.embed_tokens.weight.detach().clone()
    ids = _prompt(7, 37)
    aux = _target_aux(runner, ids[:-1])
    assert aux.shape == (36, 3 * 64)
    # the prenorm rows of one pass, against the reference's
    feed = drafter.feed("x", 0, ids[:-1], ids[-1], list(range(8)), K, aux)
    with torch.inference_mode():
        got = drafter.step([feed])[0]
    want = reference_drafts(t, ids, aux, embed, K, cfg.get("norm_before_residual", False))
    assert got == want
    if which == "small_vocab_head":
        allowed = set((torch.arange(300) + t["d2t"]).tolist())
        assert set(got) <= allowed


def test_aux_states_are_the_stream_entering_those_layers_as_transformers_has_it(target, head):
    from tests.support.model_zoo import hf_model
    runner = _runner(target, head, num_blocks=64)
    ids = _prompt(8, 30)
    aux = _target_aux(runner, ids)
    with torch.no_grad():
        states = hf_model(target)(torch.tensor([ids]), output_hidden_states=True).hidden_states
    for j, layer in enumerate(LAYERS[:2]):  # (HF's last state is after the final norm)
        torch.testing.assert_close(aux[:, j * 64:(j + 1) * 64], states[layer][0], rtol=1e-4, atol=1e-4)


def test_off_the_target_keeps_no_aux_states(target):
    runner = ModelRunner(str(target), num_blocks=64)
    assert runner.model.aux_layers == ()
    _target_aux_none = runner.model.captured
    assert _target_aux_none is None


# ---------------------------------------------------------------------- through the runner


@pytest.mark.parametrize("params", [GREEDY, SEEDED, PENALIZED], ids=["greedy", "seeded", "penalties"])
def test_a_head_never_changes_tokens_or_logprobs(target, head, params):
    prompts = {"t": (_prompt(2), params)}
    want = _plain(target, prompts)
    run = generate(_runner(target, head), prompts)
    assert run.out == want, "the head changed the answer"
    assert run.drafted > 0 and run.proposals > 0, run.verified


def test_batched_requests_equal_each_alone(target, head, small_vocab_head):
    prompts = {f"r{i}": (_prompt(10 + i, 20 + 7 * i), p)
               for i, p in enumerate([GREEDY, SEEDED, PENALIZED, GREEDY])}
    want = {rid: _plain(target, {rid: v})[rid] for rid, v in prompts.items()}
    for path in (head, small_vocab_head):
        run = generate(_runner(target, path), prompts, chunk=16)
        assert run.out == want, f"batched with head {path.name}: differs"
        assert run.drafted > 0


class Fresh:
    """What a fresh head proposes after computing a request's real ids from scratch."""

    def __init__(self, target: Path, head: Path) -> None:
        self.runner = _runner(target, head, num_blocks=64)
        self.checked = 0

    def __call__(self, rid: str, ids: list[int], proposals: list[int]) -> None:
        aux = _target_aux(self.runner, ids[:-1])
        drafter = self.runner.draft
        feed = drafter.feed("fresh", 0, ids[:-1], ids[-1], list(range(64)), len(proposals), aux)
        with torch.inference_mode():
            want = drafter.step([feed])[0]
        assert proposals == want, f"{rid} after {len(ids)} ids: its cache differs from a fresh one"
        self.checked += 1


def test_its_cache_holds_the_real_rows_through_chunks_rejections_and_preemption(target, head):
    """Chunked prefill (a chunk's last row waits for the next chunk's first id), drafts
    rejected (its own, and spoiled ones), a preemption recomputed on other blocks: every
    proposal is the one a fresh head makes after the request's real ids."""
    check = Fresh(target, head)
    prompts = {"a": (_prompt(3, 45), GREEDY), "b": (_prompt(4, 37), SEEDED)}

    def spoil(rid, step, drafts):  # every third step: wrong from the second draft on
        return drafts if step % 3 else drafts[:1] + [(t + 1) % 2048 for t in drafts[1:]]
    run = generate(_runner(target, head), prompts, chunk=16, preempt_after=9, spoil=spoil,
                   check=check)
    assert run.out == {rid: _plain(target, {rid: v})[rid] for rid, v in prompts.items()}
    assert check.checked == run.proposals and check.checked > 10


def test_a_released_request_leaves_no_carried_row(target, head):
    runner = _runner(target, head)
    generate(runner, {"c": (_prompt(9, 40), GREEDY)}, chunk=16, new=3)
    assert runner.draft.carry == {}
    runner.execute(StepPlan(500, [], {}, released=["c"]))


def test_proposals_stop_at_the_context_end(target, head):
    runner = _runner(target, head, max_model_len=64)
    run = generate(runner, {"e": (_prompt(6, 58), GREEDY)}, new=5)
    assert len(run.out["e"]) == 5


# ---------------------------------------------------------------------- refusals


@pytest.mark.parametrize("change,why", [
    (dict(hidden_size=96), "hidden_size 96, the target's is 64"),
    (dict(drop=("fc.weight",)), "missing tensors: fc.weight"),
    (dict(drop=("midlayer.self_attn.k_proj.weight", "lm_head.weight")),
     "missing tensors: lm_head.weight, midlayer.self_attn.k_proj.weight"),
    (dict(aux_layers=[1, 2, 9]), r"\[9\] outside the target's 0..4"),
    (dict(eagle_aux_hidden_state_layer_ids=[1, 2]),  # two states named, fc reads three
     r"fc.weight has shape \[64, 192\], \[64, 128\] expected"),
])
def test_a_head_that_does_not_fit_is_refused_naming_why(target, tmp_path, change, why):
    path = model_zoo.build_eagle3(tmp_path / "bad", target, **change)
    with pytest.raises(ValueError, match=why):
        Eagle3Drafter(str(path), k=K, target=load_config(target), device=torch.device("cpu"),
                      dtype=torch.float32, block_size=16, max_model_len=512, max_num_seqs=4)


def test_padded_decode_steps_keep_the_aux_states_too(target, head):
    """The CUDA-graph path's static buffers (run eagerly on CPU): a decode-only step's aux
    states come back through the static aux buffer, in the runner's row order, and the
    head proposes what it proposes after eager steps."""
    prompts = {f"p{i}": (_prompt(20 + i, 18 + 5 * i), p) for i, p in enumerate([GREEDY, SEEDED, GREEDY])}

    def spoil(rid, step, drafts):  # every other step carries no drafts: decode-only
        return [] if step % 2 else drafts
    seen = {}
    for name in ("eager", "padded"):
        runner = _runner(target, head)
        if name == "padded":
            runner.decode_graphs = runner.static_decode([2, 8])
            assert runner.decode_graphs.aux is not None
        proposals: list = []
        run = generate(runner, prompts, spoil=spoil,
                       check=lambda rid, ids, p: proposals.append((rid, len(ids), p)))
        seen[name] = (run.out, proposals)
        if name == "padded":
            assert runner.decode_graphs.steps > 5, runner.decode_graphs.steps
    assert seen["padded"] == seen["eager"]
    assert len(seen["eager"][1]) > 10
