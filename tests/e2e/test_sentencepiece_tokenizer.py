"""A SentencePiece-style tokenizer.json (Metaspace, byte fallback), as Llama-2, Mistral
and Gemma ship it: the tokenizer worker encodes and renders exactly like transformers, the
length floor stays below the real count, and through the real server greedy text keeps its
leading spaces and whole characters, streamed or not, equal to HF decoding in context."""

from __future__ import annotations

import json
import urllib.request

import pytest

from tests.support import model_zoo
from tests.support.sentencepiece_zoo import build_sentencepiece_tokenizer
from tests.support.server import CandorServer

VOCAB = 1024
MODEL = "sp"
TEXTS = ["Hello world", "  two leading spaces and  doubled", "émoji 🦙 and 中文 bytes",
         "line\nbreak\ttab", "once upon a time", " a", "ok."]


@pytest.fixture(scope="module")
def sp_model_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("sp") / "model"
    model_zoo.build("qwen3", out, None, vocab_size=VOCAB, bos_token_id=1, eos_token_id=2,
                    pad_token_id=0)
    build_sentencepiece_tokenizer(out, VOCAB)
    return out


@pytest.fixture(scope="module")
def hf_tokenizer(sp_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(sp_model_dir)


def test_worker_encodes_and_renders_like_transformers(sp_model_dir, hf_tokenizer):
    from tokenizer_worker.length_bound import TokenLengthBound, utf8_len
    from tokenization.tokenizer_files import CheckpointTokenizer

    tok = CheckpointTokenizer(sp_model_dir)
    assert "<0xF0>" in hf_tokenizer.get_vocab()  # byte fallback is in play
    bound = TokenLengthBound(tok.backend)
    for text in TEXTS:
        ids = tok.encode(text, add_special_tokens=True)
        assert ids == hf_tokenizer(text).input_ids, text
        assert tok.decode(ids, skip_special_tokens=True) == hf_tokenizer.decode(
            ids, skip_special_tokens=True)
        assert bound.min_tokens(utf8_len(text)) <= len(ids) - 1, text
    messages = [{"role": "user", "content": "hi there"},
                {"role": "assistant", "content": "  spaced reply"},
                {"role": "user", "content": "中文?"}]
    text, _ = tok.render_chat(messages, add_generation_prompt=True,
                              chat_template=tok.chat_template(False))
    assert text == hf_tokenizer.apply_chat_template(messages, tokenize=False,
                                                    add_generation_prompt=True)


def _post(srv: CandorServer, route: str, body: dict) -> tuple[int, bytes]:
    req = urllib.request.Request(srv.base_url + route, data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"}, method="POST")
    with urllib.request.urlopen(req, timeout=60) as resp:
        return resp.status, resp.read()


@pytest.fixture(scope="module")
def sp_server(sp_model_dir):
    srv = CandorServer(sp_model_dir, "--served-model-name", MODEL).start()
    yield srv
    assert srv.stop() == 0


@pytest.fixture(scope="module")
def hf_sp_model(sp_model_dir):
    return model_zoo.hf_model(sp_model_dir)


def _in_context(hf_tokenizer, prompt_ids: list[int], gen_ids: list[int]) -> str:
    """The generated text as a whole decode shows it: decode(prompt + gen) - decode(prompt)."""
    whole = hf_tokenizer.decode(prompt_ids + gen_ids, skip_special_tokens=True)
    head = hf_tokenizer.decode(prompt_ids, skip_special_tokens=True)
    assert whole.startswith(head)
    return whole[len(head):]


@pytest.mark.parametrize("prompt", TEXTS)
def test_served_text_keeps_spaces_and_characters(sp_server, hf_sp_model, hf_tokenizer, prompt):
    _, raw = _post(sp_server, "/tokenize", {"model": MODEL, "prompt": prompt})
    prompt_ids = json.loads(raw)["tokens"]
    assert prompt_ids == hf_tokenizer(prompt).input_ids
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 24, "temperature": 0,
            "ignore_eos": True, "return_token_ids": True}
    _, raw = _post(sp_server, "/v1/completions", body)
    choice = json.loads(raw)["choices"][0]
    assert choice["token_ids"] == model_zoo.hf_greedy(hf_sp_model, prompt_ids, 24)
    assert choice["text"] == _in_context(hf_tokenizer, prompt_ids, choice["token_ids"])
    _, raw = _post(sp_server, "/v1/completions", {**body, "stream": True})
    streamed = "".join(json.loads(line[6:])["choices"][0]["text"]
                       for line in raw.decode().split("\n")
                       if line.startswith("data: {"))
    assert streamed == choice["text"]
    assert "\ufffd" not in choice["text"] or "\ufffd" in _in_context(
        hf_tokenizer, prompt_ids, choice["token_ids"])


def test_chat_through_the_server_matches_hf_rendering(sp_server, hf_tokenizer):
    messages = [{"role": "user", "content": " leading space kept"}]
    _, raw = _post(sp_server, "/v1/chat/completions/render",
                   {"model": MODEL, "messages": messages})
    rendered = json.loads(raw)
    assert rendered["prompt"] == hf_tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True)
    assert rendered["prompt_token_ids"] == hf_tokenizer.apply_chat_template(
        messages, tokenize=True, add_generation_prompt=True, return_dict=True)["input_ids"]
