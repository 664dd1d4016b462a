"""Speculative decoding with a draft model (``{"model": DIR, "num_speculative_tokens": k}``)
never changes an answer, through the real processes: servers drafting with a different
tiny model (few drafts kept) and with the target itself (every greedy draft kept) answer
the probes of test_e2e_speculative (greedy, seeded, penalties, n, stop strings, chat,
json_schema, tools) with bitwise the choices of a server without speculation, alone, in
a concurrent batch, streamed and under preemption; a draft model the launcher cannot
serve with this target is refused at start in one line. With two tensor-parallel ranks
rank 0 drafts, and the answers are still those of the same ranks without speculation."""

from __future__ import annotations

import json
import subprocess
import sys

import aiohttp
import pytest

from tests.e2e.test_e2e_speculative import (MODEL, PARAGRAPH, PROBES, _all, _choices,
                                            _per_choice, _post)
from tests.support import model_zoo
from tests.support.server import REPO, CandorServer

K = 4
FLAGS = ("--served-model-name", MODEL, "--max-model-len", "1024")


def _spec(draft) -> str:
    return json.dumps({"model": str(draft), "num_speculative_tokens": K})


@pytest.fixture(scope="module")
def draft_dir(tiny_model_dir, tmp_path_factory):
    return model_zoo.build_draft(tmp_path_factory.mktemp("draft") / "model", tiny_model_dir)


@pytest.fixture(scope="module")
def servers(tiny_model_dir, draft_dir, tmp_path_factory):
    """(off, drafting with another model, drafting with the target itself)."""
    logs = tmp_path_factory.mktemp("draft-e2e")
    started: list[CandorServer] = []
    try:
        for name, extra in (("off", ()), ("other", ("--speculative-config", _spec(draft_dir))),
                            ("same", ("--speculative-config", _spec(tiny_model_dir)))):
            started.append(CandorServer(tiny_model_dir, *FLAGS, *extra).start(
                log_path=logs / name))
        yield tuple(started)
    finally:
        codes = [srv.stop() for srv in started]
        assert all(code == 0 for code in codes), codes


async def test_on_equals_off_alone_and_batched(servers):
    off, other, same = servers
    want = await _all(off, concurrent=False)
    for srv, label in ((other, "another draft model"), (same, "the target as draft")):
        for concurrent in (False, True):
            got = await _all(srv, concurrent)
            for name in PROBES:
                assert _choices(got[name]) == _choices(want[name]), \
                    f"{name} ({label}, concurrent={concurrent}): the draft changed the answer"
            assert all(got[n]["candor"]["speculative"]["exact"] for n in PROBES
                       if "speculative" in got[n]["candor"])
        srv.wait_all_blocks_free()
    assert all("speculative" not in want[n]["candor"] for n in PROBES)


async def test_a_draft_equal_to_the_target_has_every_greedy_draft_kept(servers):
    """Measured: the target as its own draft keeps every greedy draft (k + 1 tokens a
    step); another tiny model keeps few."""
    _, other, same = servers
    async with aiohttp.ClientSession() as session:
        kept = {label: (await _post(session, srv, "greedy"))["candor"]["speculative"]
                for label, srv in (("same", same), ("other", other))}
    print(f"greedy, 200 tokens, k={K}: {kept}")
    same_counts, other_counts = kept["same"], kept["other"]
    assert same_counts["drafted"] >= 100 and same_counts["accepted"] == same_counts["drafted"], kept
    assert other_counts["drafted"] > 0 and other_counts["accepted"] < other_counts["drafted"] // 2, kept


async def test_on_equals_off_streamed(servers):
    off, other, same = servers
    want = await _all(off, concurrent=False, stream=True)
    for srv in (other, same):
        got = await _all(srv, concurrent=True, stream=True)
        for name in PROBES:
            assert _per_choice(got[name]) == _per_choice(want[name]), f"{name} streamed: differs"


async def test_requests_preempted_while_drafting_equal_off(servers, tiny_model_dir, tmp_path):
    """28 KV blocks for the probes and four long fillers: requests are preempted,
    recomputed into other blocks (the draft cache with them) and draft again; every
    answer is off's, bitwise."""
    import asyncio

    off = servers[0]
    srv = CandorServer(tiny_model_dir, *FLAGS, "--num-kv-blocks", "28", "--speculative-config",
                       _spec(tiny_model_dir)).start(log_path=tmp_path / "log")
    try:
        want = await _all(off, concurrent=False)
        async with aiohttp.ClientSession() as session:
            async def filler(i: int) -> None:
                body = {"model": MODEL, "prompt": f"{i} {PARAGRAPH} {i}", "max_tokens": 150,
                        "temperature": 0, "ignore_eos": True}
                async with session.post(srv.base_url + "/v1/completions", json=body) as resp:
                    assert resp.status == 200, await resp.text()
            got, _ = await asyncio.gather(
                asyncio.gather(*(_post(session, srv, n) for n in PROBES)),
                asyncio.gather(*(filler(i) for i in range(4))))
        for name, payload in zip(PROBES, got):
            assert _choices(payload) == _choices(want[name]), f"{name} under preemption: differs"
        stats = srv.wait_all_blocks_free(what="the preempting server at rest")
        assert stats["preemptions"] > 0, "28 blocks never preempted: the test proves nothing"
        assert stats["spec_drafts"] > 0, stats
    finally:
        assert srv.stop() == 0


def test_a_draft_with_another_vocabulary_is_refused_at_start_in_one_line(tiny_model_dir,
                                                                         draft_dir, tmp_path):
    import shutil
    bad = tmp_path / "bad"
    shutil.copytree(draft_dir, bad)
    config = json.loads((bad / "config.json").read_text())
    (bad / "config.json").write_text(json.dumps({**config, "vocab_size": 1024}))
    out = subprocess.run([sys.executable, str(REPO / "launch_cluster.py"), "serve",
                          str(tiny_model_dir), "--speculative-config", _spec(bad)],
                         capture_output=True, text=True, timeout=120, cwd=REPO)
    assert out.returncode != 0
    lines = [line for line in out.stderr.splitlines() if line.startswith("candor: draft model")]
    assert lines == [f"candor: draft model {bad} (--speculative-config): vocab_size 1024, the "
                     f"target {tiny_model_dir} has 2048: a draft model needs the target's "
                     "vocabulary"], out.stderr
    assert "Traceback" not in out.stderr


async def test_with_tensor_parallelism_rank0_drafts_and_the_answers_equal_off(tiny_model_dir,
                                                                             draft_dir, tmp_path):
    """Two ranks: rank 0 holds the draft model and proposes; every probe answers as the
    same two ranks answer without speculation, and the target as draft keeps every
    greedy draft."""
    tp = ("--tensor-parallel-size", "2")
    started: list[CandorServer] = []
    try:
        for name, extra in (("off", ()), ("same", ("--speculative-config", _spec(tiny_model_dir)))):
            started.append(CandorServer(tiny_model_dir, *FLAGS, *tp, *extra).start(
                log_path=tmp_path / name))
        off, same = started
        want = await _all(off, concurrent=False)
        got = await _all(same, concurrent=True)
        for name in PROBES:
            assert _choices(got[name]) == _choices(want[name]), f"{name} (TP 2): differs"
        greedy = got["greedy"]["candor"]["speculative"]
        assert greedy["drafted"] >= 100 and greedy["accepted"] == greedy["drafted"], greedy
    finally:
        codes = [srv.stop() for srv in started]
        assert all(code == 0 for code in codes), codes


async def test_lora_requests_draft_with_the_base_draft_model_and_equal_off(tiny_model_dir,
                                                                          tmp_path):
    """A LoRA deployment whose draft is the base model: requests for the base keep every
    greedy draft, those for an adapter keep fewer (the adapter moves the target only),
    and every answer, base or adapter, greedy or seeded, is the one without
    speculation."""
    from tests.support import lora_zoo

    base = model_zoo.build("qwen2", tmp_path / "qwen2", tiny_model_dir)
    adapter = lora_zoo.build_adapter(base, tmp_path / "adapters" / "ad", rank=8, alpha=16, seed=3)
    lora = ("--served-model-name", "qwen2", "--max-model-len", "512", "--enable-lora",
            "--lora-modules", f"ad={adapter}", "--max-lora-rank", "8")
    started: list[CandorServer] = []
    try:
        for name, extra in (("off", ()), ("on", ("--speculative-config", _spec(base)))):
            started.append(CandorServer(base, *lora, *extra).start(log_path=tmp_path / name))
        bodies = {f"{model}-{kind}": {"model": model, "prompt": PARAGRAPH, "max_tokens": 48,
                                      "ignore_eos": True, "logprobs": 2, **sampling}
                  for model in ("qwen2", "ad")
                  for kind, sampling in (("greedy", {"temperature": 0}),
                                         ("seeded", {"temperature": 0.8, "seed": 9}))}
        got: dict[str, dict] = {}
        async with aiohttp.ClientSession() as session:
            for srv, label in zip(started, ("off", "on")):
                for name, body in bodies.items():
                    async with session.post(srv.base_url + "/v1/completions", json=body) as resp:
                        payload = await resp.json()
                        assert resp.status == 200, payload
                        got[f"{label} {name}"] = payload
        for name in bodies:
            assert got[f"on {name}"]["choices"] == got[f"off {name}"]["choices"], name
        base_counts = got["on qwen2-greedy"]["candor"]["speculative"]
        assert base_counts["drafted"] > 0 and base_counts["accepted"] == base_counts["drafted"]
        ad = got["on ad-greedy"]["candor"].get("speculative")
        assert ad is not None and ad["drafted"] > 0, got["on ad-greedy"]["candor"]
        print(f"LoRA: base greedy {base_counts}, adapter greedy {ad}")
    finally:
        codes = [srv.stop() for srv in started]
        assert all(code == 0 for code in codes), codes
