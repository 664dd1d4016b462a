"""The tokenizer worker under hostile input, through the real processes: huge prompts are
refused before tokenizing, templates are bounded in time, output and size, a stuck worker is
restarted and fails only its own requests; /tokenize, /tokenizer_info and --chat-template
behave as vLLM's do."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import aiohttp
import pytest

from tests.support.polling import wait_until
from tests.support.server import REPO, CandorServer, role_of

MODEL = "tiny-llama"
CONTEXT = 1024
TEMPLATES = Path("/work/shared/templates")
if not TEMPLATES.is_dir():
    TEMPLATES = Path(__file__).parents[1] / "support/data/chat_templates"
# Inline --chat-template (vLLM accepts the template itself as the flag's value).
INLINE_TEMPLATE = ("{% for m in messages %}<|start_header_id|>{{ m.role }}<|end_header_id|>\n"
                   "{{ m.content }}<|eot_id|>{% endfor %}"
                   "{% if add_generation_prompt %}<|start_header_id|>assistant"
                   "<|end_header_id|>\n{% endif %}")
NESTED_LOOPS = ("{% for a in range(100000) %}{% for b in range(100000) %}{{ '' }}"
                "{% endfor %}{% endfor %}")
CHAT = [{"role": "user", "content": "hello there"}]


@pytest.fixture(scope="module")
def tok_server(tiny_model_dir):
    srv = CandorServer(tiny_model_dir, "--served-model-name", MODEL, "--max-model-len",
                       str(CONTEXT), "--tokenizer-workers", "2",
                       "--allow-request-chat-template", "--chat-template",
                       INLINE_TEMPLATE).start()
    yield srv
    assert srv.stop() == 0


async def _post(server, path: str, body, timeout: float = 60):
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=timeout)) as session:
        async with session.post(server.base_url + path, json=body) as resp:
            return resp.status, await resp.json(content_type=None)


async def _get(server, path: str):
    async with aiohttp.ClientSession() as session:
        async with session.get(server.base_url + path) as resp:
            return resp.status, await resp.json(content_type=None)


def _tokenizer_pids(server) -> list[int]:
    return [pid for pid in server.children() if role_of(pid).startswith("tokenizer_worker")]


def _rss_mb(pid: int, field: str = "VmRSS") -> float:
    """Resident MB now, or at its peak so far (``VmHWM``)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(f"{field}:"):
            return int(line.split()[1]) / 1024
    raise AssertionError(f"no {field}")


def _chat(content: str = "hello there", **extra) -> dict:
    return {"model": MODEL, "messages": [{"role": "user", "content": content}],
            "max_tokens": 4, **extra}


# ---------------------------------------------------------------- the length floor


def test_length_floor_never_exceeds_the_real_count(tiny_model_dir):
    from tokenizer_worker.length_bound import TokenLengthBound
    from tokenization.tokenizer_files import CheckpointTokenizer

    tok = CheckpointTokenizer(tiny_model_dir)
    bound = TokenLengthBound(tok.backend)
    assert bound.longest_token_bytes is not None and bound.longest_token_bytes > 1
    longest = max((tok.decode([i], skip_special_tokens=False) for i in range(tok.vocab_size)),
                  key=lambda t: len(t.encode("utf-8")))
    texts = ["", "a", " " * 5000, "hello world " * 300, "日本語のテキスト" * 200,
             "<|eot_id|>" * 50, "\n\n\t  x" * 400, longest * 40, "🙂" * 300]
    for text in texts:
        size = len(text.encode("utf-8"))
        assert bound.min_tokens(size) <= len(tok.encode(text, add_special_tokens=False)), text[:20]


# ---------------------------------------------------------------- huge prompts


async def test_huge_prompt_is_refused_before_tokenizing_and_memory_returns(tok_server):
    pids = _tokenizer_pids(tok_server)
    before = {pid: _rss_mb(pid) for pid in pids}
    prompt = "hello world " * 2_500_000  # 30 MB, under the 32 MB body limit
    started = time.monotonic()
    status, body = await _post(tok_server, "/v1/completions",
                               {"model": MODEL, "prompt": prompt, "max_tokens": 8})
    elapsed = time.monotonic() - started
    assert status == 400, body
    err = body["error"]
    assert err["param"] == "prompt" and err["code"] == "context_length_exceeded"
    assert "at least" in err["message"] and f"{CONTEXT} tokens" in err["message"]
    assert elapsed < 10, elapsed  # tokenizing it took 35 s
    after = {pid: _rss_mb(pid) for pid in pids}
    print(f"tokenizer RSS MB before {before} after {after}; refused in {elapsed:.2f}s")
    for pid in pids:
        assert after[pid] - before[pid] < 100, (before, after)
    status, body = await _post(tok_server, "/v1/chat/completions", _chat("hello " * 3_000_000))
    assert status == 400 and body["error"]["param"] == "messages", body
    assert body["error"]["code"] == "context_length_exceeded"
    status, _ = await _post(tok_server, "/v1/chat/completions", _chat())
    assert status == 200


async def test_prompt_near_the_context_is_not_refused_by_the_floor(tok_server):
    unit = "the quick brown fox jumps over the lazy dog. "
    status, body = await _post(tok_server, "/tokenize",
                               {"prompt": unit * 10, "add_special_tokens": False})
    assert status == 200, body
    per_unit = body["count"] / 10
    prompt = unit * int((CONTEXT - 8) / per_unit)
    status, body = await _post(tok_server, "/tokenize", {"prompt": prompt})
    assert status == 200, body
    assert CONTEXT - 40 < body["count"] <= CONTEXT - 2, body["count"]
    count = body["count"]
    status, body = await _post(tok_server, "/v1/completions", {
        "model": MODEL, "prompt": prompt, "max_tokens": CONTEXT - count})
    assert status == 200, body
    status, body = await _post(tok_server, "/v1/completions", {
        "model": MODEL, "prompt": prompt, "max_tokens": CONTEXT - count + 1})
    assert status == 400 and f"{count} in the prompt" in body["error"]["message"]


# ---------------------------------------------------------------- templates


async def test_request_template_that_loops_forever_is_cut_at_the_time_limit(tok_server):
    started = time.monotonic()
    status, body = await _post(tok_server, "/v1/chat/completions",
                               _chat(chat_template=NESTED_LOOPS))
    assert status == 400, body
    assert body["error"]["param"] == "chat_template"
    assert body["error"]["code"] == "chat_template_timeout"
    assert time.monotonic() - started < 8
    status, _ = await _post(tok_server, "/v1/chat/completions", _chat())
    assert status == 200


async def test_request_template_output_is_bounded_by_the_context(tok_server):
    template = "{% for i in range(100000) %}{{ messages[0].content }}{% endfor %}"
    started = time.monotonic()
    status, body = await _post(tok_server, "/v1/chat/completions",
                               _chat("x" * 2000, chat_template=template))
    assert status == 400, body
    assert body["error"]["param"] == "chat_template"
    assert body["error"]["code"] == "context_length_exceeded"
    assert time.monotonic() - started < 5


async def test_oversized_request_template_is_refused(tok_server):
    template = "{# " + "x" * (2 << 20) + " #}" + INLINE_TEMPLATE
    status, body = await _post(tok_server, "/v1/chat/completions", _chat(chat_template=template))
    assert status == 400, body
    assert body["error"]["param"] == "chat_template"
    assert body["error"]["code"] == "chat_template_too_large"


@pytest.mark.parametrize("template", [
    "{% set x = 'a' * 200000000 %}{{ x | length }}",  # the issue's: ~200 MB in one C call
    "{{ 'x'.ljust(300000000) }}",
    "{{ ['a' * 1000000] * 1000 }}",  # printing it would take 1 GB
    "{{ 10 ** 100000000 }}",  # minutes of C time the render timer cannot cut
])
async def test_request_template_cannot_build_a_huge_value(tok_server, template):
    """One expression can no longer allocate without bound: every value a template builds
    is sized before it is built (the timer cannot interrupt C; the output cap sees text only
    once it exists). A 400 naming chat_template, fast, and the worker's peak memory stays
    where it was."""
    pids = _tokenizer_pids(tok_server)
    peaks = {pid: _rss_mb(pid, "VmHWM") for pid in pids}
    started = time.monotonic()
    status, body = await _post(tok_server, "/v1/chat/completions", _chat(chat_template=template))
    assert status == 400, body
    err = body["error"]
    assert (err["param"], err["code"]) == ("chat_template", "chat_template_too_large"), err
    assert "one template value may hold" in err["message"] or "bits" in err["message"]
    assert time.monotonic() - started < 5
    for pid in pids:
        assert _rss_mb(pid, "VmHWM") - peaks[pid] < 50, (pid, peaks)
    status, _ = await _post(tok_server, "/v1/chat/completions", _chat())
    assert status == 200


def test_watchdog_ends_a_worker_stuck_in_native_code():
    """A call that holds the GIL and never returns to bytecode: no timer signal or Python
    thread can stop it, faulthandler's C thread does."""
    code = ("import ctypes\nfrom tokenizer_worker.deadline import Watchdog\n"
            "with Watchdog(1.0).guard():\n    ctypes.PyDLL(None).sleep(60)\n")
    started = time.monotonic()
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True,
                         text=True, timeout=30)
    assert out.returncode != 0
    assert time.monotonic() - started < 10
    assert "Timeout" in out.stderr


def _cpu_ticks(pid: int) -> int:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return int(fields[11]) + int(fields[12])


async def test_lost_tokenizer_worker_is_restarted_and_fails_only_its_requests(tok_server):
    pids_before = set(_tokenizer_pids(tok_server))
    ticks = {pid: _cpu_ticks(pid) for pid in pids_before}
    held = asyncio.create_task(_post(tok_server, "/v1/chat/completions",
                                     _chat(chat_template=NESTED_LOOPS), timeout=60))
    # the worker rendering the held template burns CPU (0.2 s of it); the other one idles
    busy = await asyncio.to_thread(
        wait_until, lambda: next((pid for pid in pids_before
                                  if _cpu_ticks(pid) - ticks[pid] >= 20), None),
        "a tokenizer worker busy with the held request")
    # The other worker keeps serving while one is busy: requests go to the least loaded.
    for _ in range(3):
        status, _ = await _post(tok_server, "/v1/chat/completions", _chat(), timeout=10)
        assert status == 200
    os.kill(busy, signal.SIGKILL)
    status, body = await held
    assert status == 503, body
    assert body["error"]["code"] == "tokenizer_lost"
    assert "tokenizer_worker" in body["error"]["message"]
    wait_until(lambda: tok_server.health()[0] == 200 and len(_tokenizer_pids(tok_server)) == 2,
               "the lost tokenizer worker replaced and /health 200", timeout=30, interval=0.2)
    now = set(_tokenizer_pids(tok_server))
    assert busy not in now and pids_before - {busy} <= now  # only the lost one was replaced
    for _ in range(4):
        status, _ = await _post(tok_server, "/v1/chat/completions", _chat(), timeout=10)
        assert status == 200


# ---------------------------------------------------------------- reserved template kwargs


@pytest.mark.parametrize("key,top", [("add_generation_prompt", "add_generation_prompt"),
                                     ("tools", "tools"), ("messages", "messages")])
async def test_reserved_chat_template_kwargs_are_400(tok_server, key, top):
    status, body = await _post(tok_server, "/v1/chat/completions",
                               _chat(chat_template_kwargs={key: True}))
    assert status == 400, body
    assert body["error"]["param"] == f"chat_template_kwargs.{key}"
    assert f"`{top}`" in body["error"]["message"]


# ---------------------------------------------------------------- vLLM's /tokenize fields


async def test_tokenize_speaks_vllms_fields(tok_server):
    status, with_bos = await _post(tok_server, "/tokenize",
                                   {"prompt": "hello", "return_token_strs": True})
    assert status == 200, with_bos
    assert list(with_bos) == ["count", "max_model_len", "tokens", "token_strs"]
    assert with_bos["max_model_len"] == CONTEXT
    status, bare = await _post(tok_server, "/tokenize",
                               {"prompt": "hello", "add_special_tokens": False})
    assert status == 200, bare
    assert with_bos["tokens"][1:] == bare["tokens"] and with_bos["count"] == bare["count"] + 1
    assert len(with_bos["token_strs"]) == with_bos["count"]
    status, chat = await _post(tok_server, "/tokenize", {
        "messages": CHAT, "add_generation_prompt": None, "return_token_strs": None,
        "tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}]})
    assert status == 200, chat
    status, detok = await _post(tok_server, "/detokenize", {"tokens": chat["tokens"]})
    assert status == 200
    assert detok["prompt"].endswith("assistant<|end_header_id|>\n")  # the inline template
    status, cont = await _post(tok_server, "/tokenize", {
        "messages": CHAT + [{"role": "assistant", "content": "Hi"}],
        "continue_final_message": True, "add_generation_prompt": False})
    assert status == 200, cont
    status, body = await _post(tok_server, "/tokenize", {"prompt": "x", "tools": []})
    assert status == 400 and body["error"]["param"] == "tools"


async def test_tokenizer_info(tok_server):
    status, info = await _get(tok_server, "/tokenizer_info")
    assert status == 200, info
    assert info["tokenizer_class"]
    assert info["model_max_length"] == CONTEXT
    assert info["eos_token"] and info["bos_token"] == "<|begin_of_text|>"
    assert info["chat_template"] == INLINE_TEMPLATE
    assert info["vocab_size"] > 0 and info["eos_token_ids"]


def test_chat_template_flag_checked_before_anything_starts(tiny_model_dir, tmp_path):
    bad_file = tmp_path / "bad.jinja"
    bad_file.write_text("{% for m in messages %}{{ m.content }")
    big_file = tmp_path / "big.jinja"
    big_file.write_text("{# " + "x" * (2 << 20) + " #}")
    cases = {str(bad_file): "bad.jinja", "{{ unclosed": "inline",
             "no/such/template.jinja": "neither an existing file", str(big_file): "bytes"}
    for value, says in cases.items():
        out = subprocess.run([sys.executable, str(REPO / "launch_cluster.py"), "serve",
                              "--model", str(tiny_model_dir), "--port", "1",
                              "--chat-template", value],
                             cwd=REPO, capture_output=True, text=True, timeout=60)
        assert out.returncode != 0
        lines = [line for line in out.stderr.splitlines() if line.strip()]
        assert len(lines) == 1 and says in lines[0], out.stderr
        assert "started" not in out.stdout + out.stderr


async def test_real_template_file_still_works_with_inline_detection(tok_server):
    template = (TEMPLATES / "qwen2.5-7b-instruct.jinja").read_text()
    status, body = await _post(tok_server, "/tokenize",
                               {"messages": CHAT, "chat_template": template})
    assert status == 200, body
    status, text = await _post(tok_server, "/detokenize", {"tokens": body["tokens"]})
    assert "<|im_start|>user\nhello there<|im_end|>" in text["prompt"]
    assert json.dumps(text)  # plain JSON back
