"""A GGUF file's tokenizer and chat template, as the prepared directory gives them to the
tokenizer worker, detokenizer and grammar compiler, equal transformers' GGUF tokenizer
(``AutoTokenizer.from_pretrained(dir, gguf_file=...)``): the default model's and tiny
files carrying real templates, on every shared message case (tests/support/data/chat_templates),
through the real conversion (a process of its own, as at a first start)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from gguf import GGMLQuantizationType as T
from transformers import AutoTokenizer

from launcher.default_model import default_gguf
from launcher.gguf_checkpoint import prepare
from tokenization.chat_template import ChatTemplateError
from tokenization.tokenizer_files import CheckpointTokenizer
from tests.support import gguf_zoo
from tests.unit.tokenization.test_chat_templates import FROZEN_NOW, frozen_hf_clock  # noqa: F401 - a fixture
from tests.unit.tokenization.test_tokenizer_files import STRINGS, assert_equivalent

DATA = Path(__file__).resolve().parents[1] / "support" / "data" / "chat_templates"
CASES = json.loads((DATA / "cases.json").read_text(encoding="utf-8"))["cases"]
TOOL_TEMPLATE = "TOOLS {{ tools | length }}{% for m in messages %}[{{ m.role }}]{{ m.content }}{% endfor %}"
# file -> (architecture of the tiny file, the shared template its metadata carries)
TINY = {"qwen2-chatml": ("qwen2", "qwen2.5-7b-instruct"), "llama-3.2": ("llama", "llama-3.2-3b-instruct"),
        "gemma2": ("gemma2", "gemma-2-2b-it")}


@pytest.fixture(scope="module")
def tokenizers(tmp_path_factory):
    """name -> (ours from the prepared directory, transformers' from the file)."""
    root = tmp_path_factory.mktemp("gguf-tok")
    env = {"CANDOR_GGUF_CACHE": str(root / "cache")}
    paths = {"smollm2": default_gguf()}
    for name, (arch, template) in TINY.items():
        extra = {"tokenizer.chat_template.tool_use": TOOL_TEMPLATE} if name == "qwen2-chatml" else None
        paths[name] = gguf_zoo.write(root / f"{name}.gguf", arch, T.Q8_0,
                                     template=(DATA / f"{template}.jinja").read_text(encoding="utf-8"),
                                     extra_metadata=extra)
    out = {}
    for name, path in paths.items():
        directory = prepare(str(path), None, env)
        ours = CheckpointTokenizer(directory, now=lambda: FROZEN_NOW)
        out[name] = ours, AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    return out


@pytest.mark.parametrize("name", ["smollm2", *TINY])
def test_tokenizer_equals_transformers_gguf_tokenizer(name, tokenizers):
    ours, hf = tokenizers[name]
    assert_equivalent(ours, hf, STRINGS + ["<|im_start|>user\nWhat is the capital of France?<|im_end|>\n"])


def _render(render, *args, **kwargs):
    try:
        return render(*args, **kwargs)
    except Exception as exc:  # noqa: BLE001 - either side raising counts as "raises"
        return exc


@pytest.mark.parametrize("case", CASES, ids=[c["id"] for c in CASES])
@pytest.mark.parametrize("name", ["smollm2", *TINY])
def test_chat_template_renders_as_transformers(name, case, tokenizers, frozen_hf_clock):
    ours, hf = tokenizers[name]
    kw = dict(tools=case["tools"], add_generation_prompt=case["add_generation_prompt"], **case["kwargs"])
    theirs = _render(hf.apply_chat_template, case["messages"], tokenize=False, **kw)
    if name == "qwen2-chatml" and case["tools"]:  # llama.cpp's named tool_use template, which
        theirs = _render(hf.apply_chat_template, case["messages"], tokenize=False,  # transformers
                         chat_template=TOOL_TEMPLATE, **kw)  # reads only when it is named
    got = _render(lambda *a, **k: ours.render_chat(*a, **k)[0], case["messages"], **kw)
    if isinstance(theirs, Exception):
        assert isinstance(got, ChatTemplateError), (theirs, got)
        return
    assert got == theirs
    assert ours.encode(got, add_special_tokens=False) == hf(theirs, add_special_tokens=False)["input_ids"]


def test_the_default_models_special_tokens(tokenizers):
    """SmolLM2: ChatML, <|im_end|> ends a turn (eos), no BOS added to a plain prompt."""
    ours, hf = tokenizers["smollm2"]
    assert ours.special_tokens_map == {"bos_token": "<|im_start|>", "eos_token": "<|im_end|>",
                                       "unk_token": "<|endoftext|>", "pad_token": "<|im_end|>"}
    assert ours.eos_token_ids == [2] == [hf.eos_token_id]
    assert ours.encode("Hello", add_special_tokens=True) == ours.encode("Hello", add_special_tokens=False)
    template = ours.chat_template(tools_present=False)
    assert template.origin == "checkpoint:chat_template.jinja" and "<|im_start|>" in template.source


def test_a_gguf_with_an_add_bos_flag_adds_bos(tokenizers):
    ours, hf = tokenizers["llama-3.2"]
    bos = ours.backend.token_to_id("<|begin_of_text|>")
    assert ours.encode("Hello", add_special_tokens=True)[0] == bos == hf("Hello")["input_ids"][0]


def test_the_comparison_renders_what_the_templates_render(tokenizers):
    """So a comparison cannot pass by both sides raising: the shared templates render the
    MANIFEST's counts of cases (and SmolLM2's own 18 of 21)."""
    rendered = {}
    for name in ["smollm2", *TINY]:
        ours, _ = tokenizers[name]
        rendered[name] = sum(isinstance(_render(ours.render_chat, c["messages"], tools=c["tools"],
                                                add_generation_prompt=c["add_generation_prompt"], **c["kwargs"]),
                                        tuple) for c in CASES)
    assert rendered == {"smollm2": 18, "qwen2-chatml": 19, "llama-3.2": 20, "gemma2": 10}
