"""Speculative decoding with an EAGLE-3 head (``{"method": "eagle3", "model": DIR,
"num_speculative_tokens": k}``) never changes an answer, through the real processes: a
server drafting with a tiny random head in vLLM's checkpoint layout answers the probes
of test_e2e_speculative (greedy, seeded, penalties, n, stop strings, chat, json_schema,
tools; logprobs throughout) with bitwise the choices of a server without speculation,
alone, in a concurrent batch and streamed, and counts its drafts in vLLM's
``spec_decode`` metrics. A random head keeps few drafts: correctness only. A head that
does not fit the target is refused at start in one line. With two tensor-parallel ranks
rank 0 drafts, and the answers are those of the same ranks without speculation."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest

from tests.e2e.test_e2e_speculative import MODEL, PROBES, _all, _choices, _per_choice
from tests.support import model_zoo
from tests.support.metrics_text import scrape
from tests.support.server import REPO, CandorServer

K = 4
FLAGS = ("--served-model-name", MODEL, "--max-model-len", "1024")


def _spec(head) -> str:
    return json.dumps({"method": "eagle3", "model": str(head), "num_speculative_tokens": K})


@pytest.fixture(scope="module")
def head_dir(tiny_model_dir, tmp_path_factory):
    return model_zoo.build_eagle3(tmp_path_factory.mktemp("eagle3") / "head", tiny_model_dir,
                                  aux_layers=[1, 2, 4])


@pytest.fixture(scope="module")
def servers(tiny_model_dir, head_dir, tmp_path_factory):
    """(off, drafting with the head)."""
    logs = tmp_path_factory.mktemp("eagle3-e2e")
    started: list[CandorServer] = []
    try:
        for name, extra in (("off", ()), ("on", ("--speculative-config", _spec(head_dir)))):
            started.append(CandorServer(tiny_model_dir, *FLAGS, *extra).start(log_path=logs / name))
        yield tuple(started)
    finally:
        codes = [srv.stop() for srv in started]
        assert all(code == 0 for code in codes), codes


async def test_on_equals_off_alone_and_batched(servers):
    off, on = servers
    want = await _all(off, concurrent=False)
    assert want["greedy"]["choices"][0]["logprobs"]["top_logprobs"]
    for concurrent in (False, True):
        got = await _all(on, concurrent)
        for name in PROBES:
            assert _choices(got[name]) == _choices(want[name]), \
                f"{name} (concurrent={concurrent}): the EAGLE-3 head changed the answer"
        counted = [got[n]["candor"].get("speculative") for n in PROBES]
        assert any(c and c["drafted"] > 0 for c in counted), counted
        assert all(c is None or (0 <= c["accepted"] <= c["drafted"] and c["exact"])
                   for c in counted), counted
    on.wait_all_blocks_free()
    assert all("speculative" not in want[n]["candor"] for n in PROBES)


async def test_on_equals_off_streamed(servers):
    off, on = servers
    want = await _all(off, concurrent=False, stream=True)
    got = await _all(on, concurrent=True, stream=True)
    for name in PROBES:
        assert _per_choice(got[name]) == _per_choice(want[name]), f"{name} streamed: differs"


async def test_metrics_count_the_heads_drafts_with_vllm_names(servers):
    off, on = servers
    await _all(on, concurrent=True)
    deadline = time.monotonic() + 30
    while True:  # the counters follow the scheduler's heartbeat
        s = scrape(on)
        drafts = s.total("vllm:spec_decode_num_drafts_total")
        if drafts > 0 or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert drafts > 0, "no drafts counted after the speculative requests (30 s)"
    tokens = s.total("vllm:spec_decode_num_draft_tokens_total")
    accepted = s.total("vllm:spec_decode_num_accepted_tokens_total")
    assert drafts <= tokens <= K * drafts and 0 <= accepted <= tokens
    assert s.total("vllm:spec_decode_num_accepted_tokens_per_pos_total") == accepted
    assert scrape(off).total("vllm:spec_decode_num_drafts_total") == 0
    print(f"EAGLE-3 random head: {drafts} drafts, {tokens} draft tokens, {accepted} accepted")


@pytest.mark.parametrize("build,why", [
    (dict(hidden_size=96), "hidden_size 96, the target's is 64"),
    (dict(drop=("fc.weight",)), "missing tensors: fc.weight"),
], ids=["hidden-size", "no-fc"])
def test_a_head_that_does_not_fit_is_refused_at_start_in_one_line(tiny_model_dir, tmp_path,
                                                                  build, why):
    bad = model_zoo.build_eagle3(tmp_path / "bad", tiny_model_dir, aux_layers=[1, 2, 4], **build)
    out = subprocess.run([sys.executable, str(REPO / "launch_cluster.py"), "serve",
                          str(tiny_model_dir), "--speculative-config", _spec(bad)],
                         capture_output=True, text=True, timeout=120, cwd=REPO)
    assert out.returncode != 0
    lines = [line for line in out.stderr.splitlines() if line.startswith("candor: EAGLE-3 head")]
    assert lines == [f"candor: EAGLE-3 head {bad} (--speculative-config): {why} (target "
                     f"{tiny_model_dir})"], out.stderr
    assert "Traceback" not in out.stderr


async def test_with_tensor_parallelism_rank0_drafts_and_the_answers_equal_off(tiny_model_dir,
                                                                             head_dir, tmp_path):
    """Two ranks: rank 0 holds the head (the target's embeddings gathered from both) and
    proposes; every probe answers as the same two ranks answer without speculation."""
    tp = ("--tensor-parallel-size", "2")
    started: list[CandorServer] = []
    try:
        for name, extra in (("off", ()), ("on", ("--speculative-config", _spec(head_dir)))):
            started.append(CandorServer(tiny_model_dir, *FLAGS, *tp, *extra).start(
                log_path=tmp_path / name))
        off, on = started
        want = await _all(off, concurrent=False)
        got = await _all(on, concurrent=True)
        for name in PROBES:
            assert _choices(got[name]) == _choices(want[name]), f"{name} (TP 2): differs"
        assert got["greedy"]["candor"]["speculative"]["drafted"] > 0
    finally:
        codes = [srv.stop() for srv in started]
        assert all(code == 0 for code in codes), codes
