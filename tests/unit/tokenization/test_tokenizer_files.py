"""CheckpointTokenizer (no transformers) vs AutoTokenizer on small byte-level BPE checkpoints built here.

Each checkpoint is trained with `tokenizers`, saved with transformers' save_pretrained (as a real checkpoint would
be), then sometimes edited to exercise the config quirks transformers handles: chat templates in different places,
`add_bos_token` that transformers ignores, tokens declared only in tokenizer_config.json, no post-processor.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tokenization.chat_template import ChatTemplateError
from tokenization.tokenizer_files import CheckpointTokenizer

transformers = pytest.importorskip("transformers")
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors, trainers  # noqa: E402

BOS, EOS, EOT, PAD = "<|begin_of_text|>", "<|end_of_text|>", "<|eot_id|>", "<|pad|>"
TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|start|>{{ m.role }}\n{{ m.content }}<|eot_id|>{% endfor %}"
    "{% if add_generation_prompt %}<|start|>assistant\n{% endif %}"
)
TOOL_TEMPLATE = "{{ bos_token }}TOOLS {{ tools|tojson }}" + TEMPLATE[len("{{ bos_token }}"):]
CORPUS = [
    "The quick brown fox jumps over the lazy dog. " * 3,
    "Hello world! How are you today? I'm fine, thanks; and you?",
    "def square(x):\n    return x ** 2  # squares a number\n\nprint(square(12))\n",
    "Café, naïve, façade, jalapeño, Zürich, São Paulo, Kraków, Ångström.",
    "日本語のテキストと中文文本, 한국어 텍스트, русский текст, ελληνικά.",
    "emoji 🤖🚀👍🏽 and 👨‍👩‍👧 family, numbers 3.14159 2.71828 1e-9, JSON {\"a\": [1, 2, 3]}",
    "\t tabs\tand   spaces   and\nnew\nlines\r\n",
] * 8
STRINGS = [
    "", " ", "Hello world", "   leading and trailing   ", "tabs\tand\nnewlines\n\n\n", "\r\n windows \r\n",
    "ünïcödé café naïve Ångström", "日本語のテキスト", "emoji 🤖🚀👍🏽 family 👨‍👩‍👧 flag 🇫🇷",
    f"special {EOT} inside {BOS}text{EOS}", f"{BOS}{BOS}", "<tool_call>{\"a\": 1}</tool_call>",
    "<|begin_of_text", "a" * 300, "def f(x):\n    return x**2  # comment", "\u200b zero\u00a0width",
    "x" + " " * 17 + "y",
]
CONVERSATION = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": f"Say {EOT} and 🤖 please"},
    {"role": "assistant", "content": "🤖", "reasoning_content": None},
    {"role": "user", "content": "  again  "},
]
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "°C & <b>", "parameters": {}}}]


def _train_backend(post_processor: bool) -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=500, special_tokens=[BOS, EOS, EOT, PAD], initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS, trainer)
    tok.add_tokens([AddedToken("<tool_call>", special=False), AddedToken("</tool_call>", special=False)])
    if post_processor:
        tok.post_processor = processors.TemplateProcessing(
            single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, tok.token_to_id(BOS))]
        )
    return tok


def _edit_json(path: Path, edit) -> None:
    data = json.loads(path.read_text(encoding="utf-8")) if path.exists() else {}
    edit(data)
    path.write_text(json.dumps(data, ensure_ascii=False, indent=2), encoding="utf-8")


def build_checkpoint(directory: Path, variant: str) -> Path:
    """A tokenizer checkpoint as transformers saves it, then edited for `variant`."""
    backend = _train_backend(post_processor=variant != "no_post_processor")
    template = {"default": TEMPLATE, "tool_use": TOOL_TEMPLATE} if variant == "template_dict" else TEMPLATE
    hf = transformers.PreTrainedTokenizerFast(
        tokenizer_object=backend, bos_token=BOS, eos_token=EOT, pad_token=PAD, chat_template=template
    )
    hf.save_pretrained(directory)
    eot, eos = backend.token_to_id(EOT), backend.token_to_id(EOS)
    _edit_json(directory / "generation_config.json", lambda d: d.update(eos_token_id=[eos, eot], bos_token_id=0))
    _edit_json(directory / "config.json", lambda d: d.update(model_type="llama", eos_token_id=eos))
    config = directory / "tokenizer_config.json"
    if variant == "legacy_config_list":  # older checkpoints: named templates inside tokenizer_config.json
        (directory / "chat_template.jinja").unlink()
        _edit_json(config, lambda d: d.update(chat_template=[
            {"name": "default", "template": TEMPLATE}, {"name": "tool_use", "template": TOOL_TEMPLATE}]))
    elif variant == "config_quirks":
        added = json.loads((directory / "tokenizer.json").read_text(encoding="utf-8"))["added_tokens"]

        def quirks(d):
            d["add_bos_token"] = False  # ignored by transformers when tokenizer.json exists
            d["image_token"] = "<image>"  # model-specific special token, declared only here
            d["unk_token"] = "<unk_cfg>"  # named token missing from tokenizer.json
            # transformers 4.x wrote added_tokens_decoder; here it also declares a token tokenizer.json lacks,
            # and flags </tool_call> special where tokenizer.json does not.
            d["added_tokens_decoder"] = {str(t.pop("id")): t for t in added}
            d["added_tokens_decoder"]["501"]["special"] = True
            d["added_tokens_decoder"]["9000"] = {"content": "<cfg_only>", "special": True, "lstrip": False,
                                                 "rstrip": False, "normalized": False, "single_word": False}
        _edit_json(config, quirks)
        _edit_json(directory / "generation_config.json", lambda d: d.pop("eos_token_id"))  # fall back to config.json
    return directory


VARIANTS = ["jinja_file", "template_dict", "legacy_config_list", "config_quirks", "no_post_processor"]


@pytest.fixture(scope="module", params=VARIANTS)
def checkpoint(request, tmp_path_factory):
    directory = build_checkpoint(tmp_path_factory.mktemp(request.param), request.param)
    return request.param, directory, CheckpointTokenizer(directory), transformers.AutoTokenizer.from_pretrained(
        directory)


def assert_equivalent(ours: CheckpointTokenizer, hf, strings=STRINGS) -> None:
    """Everything the worker takes from a tokenizer equals what AutoTokenizer gives."""
    assert ours.special_tokens_map == hf.special_tokens_map
    assert ours.all_special_ids == hf.all_special_ids
    assert ours.vocab_size == len(hf)
    assert ours.backend.get_added_tokens_decoder() == hf.backend_tokenizer.get_added_tokens_decoder()
    for text in strings:
        for add_special in (True, False):
            ids = ours.encode(text, add_special_tokens=add_special)
            assert ids == hf(text, add_special_tokens=add_special)["input_ids"], (text, add_special)
            for skip in (True, False):
                assert ours.decode(ids, skip_special_tokens=skip) == hf.decode(ids, skip_special_tokens=skip)
    every_id = list(range(ours.vocab_size))
    for skip in (True, False):
        assert ours.decode(every_id, skip_special_tokens=skip) == hf.decode(every_id, skip_special_tokens=skip)


def test_tokenization_matches_autotokenizer(checkpoint):
    _, _, ours, hf = checkpoint
    assert_equivalent(ours, hf)


def test_bos_comes_from_tokenizer_json_post_processor(checkpoint):
    variant, _, ours, _ = checkpoint
    bos_id = ours.backend.token_to_id(BOS)
    with_specials = ours.encode("Hello", add_special_tokens=True)
    assert (with_specials[0] == bos_id) == (variant != "no_post_processor")
    assert ours.encode("Hello", add_special_tokens=False)[0] != bos_id


def test_eos_token_ids(checkpoint):
    variant, _, ours, hf = checkpoint
    eos, eot = ours.backend.token_to_id(EOS), ours.backend.token_to_id(EOT)
    assert hf.eos_token_id == eot
    # generation_config's [eos, eot] plus the tokenizer's eos (eot); config.json's eos when generation_config lacks it.
    assert ours.eos_token_ids == [eos, eot]


def test_special_token_quirks(checkpoint):
    variant, _, ours, hf = checkpoint
    if variant != "config_quirks":
        assert ours.special_tokens_map == {"bos_token": BOS, "eos_token": EOT, "pad_token": PAD}
        return
    assert ours.special_tokens_map["image_token"] == "<image>" and ours.special_tokens_map["unk_token"] == "<unk_cfg>"
    for token in ("<image>", "<cfg_only>", "<unk_cfg>"):
        assert ours.backend.token_to_id(token) == hf.convert_tokens_to_ids(token) is not None
        assert ours.encode(f"a{token}b", add_special_tokens=False) == hf(f"a{token}b", add_special_tokens=False)[
            "input_ids"]


@pytest.mark.parametrize("tools", [None, TOOLS])
def test_chat_template_resolution_and_rendering(checkpoint, tools):
    variant, _, ours, hf = checkpoint
    template = ours.chat_template(tools_present=tools is not None)
    assert template is not None and template.source == hf.get_chat_template(None, tools)
    expected_origin = {
        "legacy_config_list": "checkpoint:tokenizer_config.json[",
        "template_dict": "checkpoint:additional_chat_templates/" if tools else "checkpoint:chat_template.jinja",
    }.get(variant, "checkpoint:chat_template.jinja")
    assert template.origin.startswith(expected_origin)
    text, used = ours.render_chat(CONVERSATION, tools=tools, add_generation_prompt=True)
    assert used is template
    assert text == hf.apply_chat_template(CONVERSATION, tools=tools, add_generation_prompt=True, tokenize=False)
    ids = hf.apply_chat_template(CONVERSATION, tools=tools, add_generation_prompt=True, return_dict=False)
    assert ours.encode(text, add_special_tokens=False) == ids
    assert text.startswith(BOS) and ids.count(ours.backend.token_to_id(BOS)) == 1  # no double BOS


def test_render_chat_errors_and_overrides(tmp_path):
    directory = build_checkpoint(tmp_path / "ckpt", "jinja_file")
    ours = CheckpointTokenizer(directory)
    with pytest.raises(ChatTemplateError):
        ours.render_chat([])
    override = ours.chat_template(False).__class__("{{ eos_token }}{{ greeting }}", origin="request")
    text, used = ours.render_chat([{"role": "user", "content": "x"}], chat_template=override, greeting="hi")
    assert (text, used.origin) == (EOT + "hi", "request")
    (directory / "chat_template.jinja").unlink()
    bare = CheckpointTokenizer(directory)
    assert bare.chat_template(tools_present=False) is None
    with pytest.raises(ChatTemplateError, match="no chat template"):
        bare.render_chat([{"role": "user", "content": "x"}])
    (directory / "chat_template.json").write_text(json.dumps({"chat_template": "legacy {{ messages|length }}"}))
    legacy = CheckpointTokenizer(directory)
    assert legacy.chat_template(False).origin == "checkpoint:chat_template.json"
    assert legacy.render_chat([{"role": "user", "content": "x"}])[0] == "legacy 1"


def test_only_named_templates_without_default(tmp_path):
    directory = build_checkpoint(tmp_path / "ckpt", "legacy_config_list")
    _edit_json(directory / "tokenizer_config.json", lambda d: d.update(chat_template=[
        {"name": "tool_use", "template": TOOL_TEMPLATE}]))
    ours = CheckpointTokenizer(directory)
    assert ours.chat_template(tools_present=True).source == TOOL_TEMPLATE
    with pytest.raises(ChatTemplateError, match="default"):
        ours.chat_template(tools_present=False)


def test_tiny_model_checkpoint(tmp_path):
    """The project's own tiny test model must tokenize identically too."""
    try:
        from launcher.tiny_model import build_tiny_model
    except ImportError as exc:
        pytest.skip(f"launcher.tiny_model.build_tiny_model is not available yet ({exc})")
    out_dir = tmp_path / "tiny"
    returned = build_tiny_model(out_dir)
    directory = Path(returned) if isinstance(returned, (str, Path)) else out_dir
    ours = CheckpointTokenizer(directory)
    hf = transformers.AutoTokenizer.from_pretrained(directory)
    assert_equivalent(ours, hf)
    generation_eos = json.loads((directory / "generation_config.json").read_text())["eos_token_id"]
    generation_eos = generation_eos if isinstance(generation_eos, list) else [generation_eos]
    assert ours.eos_token_ids == list(dict.fromkeys([*generation_eos, hf.eos_token_id]))
    template = ours.chat_template(tools_present=False)
    if template is not None:
        messages = [{"role": "user", "content": "Hello 🤖"}]
        text, _ = ours.render_chat(messages, add_generation_prompt=True)
        assert text == hf.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)


def test_worker_modules_stay_lean():
    """The tokenizer worker must not pull in transformers or torch."""
    import subprocess
    import sys

    code = ("import sys, tokenization.tokenizer_files, tokenization.chat_template; "
            "heavy = {'transformers', 'torch'} & set(sys.modules); assert not heavy, heavy")
    subprocess.run([sys.executable, "-c", code], check=True,
                   cwd=Path(__file__).resolve().parents[3])
