"""bench.compare's llama.cpp peer, without llama.cpp: a fake server that answers as
llama-cpp-python's does (no token-id prompts, no ignore_eos, no usage in a stream, its
health at /v1/models) is measured like any other, and the bandwidth limit reads the
bytes a GGUF decode step streams."""

from __future__ import annotations

import os
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from gguf import GGMLQuantizationType as T
from tokenizers import Tokenizer

from bench import bandwidth, box, procstat, servers
from bench import compare
from bench.compare import bandwidth_lines, rss_line
from bench.rounds import measure_round
from gpu_worker.gguf.reader import GGUFFile
from launcher.loadgen import Workload
from launcher.tiny_model import build_tiny_model
from tests.support import gguf_zoo

# what llama-cpp-python's server does with a completion request, reduced: pydantic
# refuses a list prompt (422); ignore_eos is not a field (ignored); min_tokens holds EOS
# back; the stream carries one token per frame, a last frame with finish_reason, no usage
LLAMA_LIKE = """
import json, sys
from aiohttp import web

async def completions(request):
    body = await request.json()
    if not isinstance(body["prompt"], str):
        return web.json_response({"detail": "prompt: Input should be a valid string"}, status=422)
    n = body["max_tokens"] if body.get("min_tokens") == body["max_tokens"] else 2  # an early EOS
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await resp.prepare(request)
    for _ in range(n):
        await resp.write(b"data: " + json.dumps({"choices": [{"text": " x", "finish_reason": None}]}).encode() + b"\\n\\n")
    last = {"choices": [{"text": "", "finish_reason": "length" if n == body["max_tokens"] else "stop"}]}
    if not body.get("cut"):  # what interrupt_requests does to a running stream: [DONE] at once
        await resp.write(b"data: " + json.dumps(last).encode() + b"\\n\\n")
    await resp.write(b"data: [DONE]\\n\\n")
    return resp

app = web.Application()
app.router.add_post("/v1/completions", completions)
app.router.add_get("/v1/models", lambda request: web.json_response({"data": []}))
web.run_app(app, host="127.0.0.1", port=int(sys.argv[1]), print=None)
"""


@pytest.fixture(scope="module")
def tokenizer_json(tmp_path_factory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("tiny") / "model") / "tokenizer.json"


@pytest.fixture
def llama_like(tmp_path):
    port = servers.free_port()
    fake = servers.Server("llamacpp", [sys.executable, "-c", LLAMA_LIKE, str(port)],
                          dict(os.environ), port, log_dir=tmp_path, length_by="min_tokens",
                          health_path="/v1/models")
    fake.start()
    try:
        fake.wait_ready(timeout=60)
        yield fake
    finally:
        fake.stop()


def test_text_prompts_are_the_token_ids_decoded(tokenizer_json):
    ids = Workload(num_requests=3, prompt_len=(20, 20), seed=4).prompts()
    text = Workload(num_requests=3, prompt_len=(20, 20), seed=4,
                    text_tokenizer=str(tokenizer_json)).prompts()
    tok = Tokenizer.from_file(str(tokenizer_json))
    assert [t for t, _ in text] == [tok.decode(p) for p, _ in ids]
    assert all(isinstance(t, str) and t for t, _ in text)
    assert [n for _, n in text] == [n for _, n in ids]


def test_a_server_without_ignore_eos_or_usage_is_measured_exactly(llama_like, tokenizer_json):
    text = Workload(num_requests=2, concurrency=1, prompt_len=(8, 8), output_len=(6, 6),
                    text_tokenizer=str(tokenizer_json))
    res = measure_round(llama_like, "m", text, box.BoxMeter(lambda: [llama_like.pid]))
    # min_tokens = max_tokens held both to 6 tokens; finish_reason "length" counts them
    assert res["errors"] == 0 and res["output_tokens"] == 12
    # the same workload as ignore_eos stops early at the fake's EOS: counted per frame
    as_candor = servers.Server("plain", [], {}, llama_like.port)
    as_candor.proc = llama_like.proc
    res = measure_round(as_candor, "m", text, box.BoxMeter(lambda: [llama_like.pid]))
    assert res["errors"] == 0 and res["output_tokens"] == 4
    # a stream cut short before its finish_reason is a failed request, not a short one
    cut = measure_round(llama_like, "m", replace(text, extra_body={"cut": True}), box.BoxMeter())
    assert cut["errors"] == 2 and cut["first_error"] == "[DONE] before any finish_reason"
    # token ids are refused, as llama-cpp-python refuses them
    ids = measure_round(llama_like, "m", Workload(num_requests=1, concurrency=1, prompt_len=(4, 4),
                                                  output_len=(2, 2)), box.BoxMeter())
    assert ids["errors"] == 1 and "HTTP 422" in ids["first_error"]


def test_rss_by_role_reads_the_tree(llama_like):
    rss = procstat.rss_by_role(llama_like.pid)
    assert list(rss) == [procstat.role_of(llama_like.pid, "python")] and sum(rss.values()) > 10 * 2**20
    line = rss_line({"llamacpp": rss})
    assert line.startswith("RSS after the rounds: llamacpp ") and " MiB in all (" in line


def test_the_rss_line_names_every_role_largest_first():
    line = rss_line({"candor": {"scheduler": 100 * 2**20, "gpu_worker": 900 * 2**20},
                     "vllm": {"vllm": 2**30}})
    assert line == ("RSS after the rounds: candor 1000 MiB in all (gpu_worker 900, "
                    "scheduler 100); vllm 1024 MiB in all (vllm 1024)")


@pytest.mark.parametrize("arch,tied", [("llama", False), ("qwen2", True)])
def test_bytes_per_token_reads_the_embedding_only_as_the_output(tmp_path, arch, tied):
    path = gguf_zoo.write(tmp_path / f"{arch}.gguf", arch, T.Q8_0)
    tensors = GGUFFile(path).tensors
    total = sum(t.n_bytes for t in tensors.values())
    embed = tensors["token_embd.weight"].n_bytes
    assert ("output.weight" not in tensors) == tied
    assert bandwidth.gguf_bytes_per_token(path) == (total if tied else total - embed)


def test_read_bandwidth_keeps_the_thread_count():
    before = torch.get_num_threads()
    gbps = bandwidth.read_gbps(1, nbytes=16 * 2**20, repeats=2)
    assert torch.get_num_threads() == before
    assert 0.1 < gbps < 10_000


def test_bandwidth_share_from_the_batch_1_gaps():
    rounds = {"candor": [{"itl_s_p50": 0.01}, {"itl_s_p50": 0.02}, {"itl_s_p50": 0.0125}],
              "llamacpp": [{"itl_s_p50": 0.005}]}
    # 100 MB per token at 10 GB/s: the limit is 100 tok/s
    lines = bandwidth_lines(rounds, 100 * 10**6, 10.0)
    assert lines == ["candor: batch-1 decode 80 tok/s [50..100] (1 / ITL p50) = 80% [50%..100%] "
                     "of the bandwidth limit",
                     "llamacpp: batch-1 decode 200 tok/s [200..200] (1 / ITL p50) = 200% "
                     "[200%..200%] of the bandwidth limit"]


def test_each_side_gets_the_limit_of_its_own_weights():
    """vLLM and candor-fp32 read the float32 folder, candor and llama.cpp the GGUF file."""
    rounds = {"candor": [{"itl_s_p50": 0.01}], "vllm": [{"itl_s_p50": 0.05}]}
    lines = bandwidth_lines(rounds, {"candor": 100 * 10**6, "vllm": 500 * 10**6}, 10.0)
    assert lines[0].startswith("candor: batch-1 decode 100 tok/s") and "= 100%" in lines[0]
    assert lines[1].startswith("vllm: batch-1 decode 20 tok/s") and "= 100%" in lines[1]


def test_every_candor_peer_pair_present_gets_its_ratios():
    one = {"output_tokens_per_s": 10.0, "itl_s_p50": 0.02, "errors": 0}
    two = {"output_tokens_per_s": 20.0, "itl_s_p50": 0.01, "errors": 0}
    rounds = {"candor": [two], "llamacpp": [one], "candor-fp32": [one], "vllm": [two]}
    assert compare.pairs_of(rounds) == [("candor", "llamacpp"), ("candor", "vllm"),
                                        ("candor-fp32", "vllm")]
    text = compare.report({"r1": {"desc": "d", "rounds": rounds}})
    assert "candor/llamacpp by round pair" in text  # the summary table's column
    assert "candor/vllm by round pair" in text and "candor-fp32/vllm by round pair" in text
    fp32 = text.split("candor-fp32/vllm by round pair")[1]
    assert "output tok/s" in fp32 and "0.50x" in fp32
