"""Our sandboxed renderer vs transformers' apply_chat_template, on 12 real templates x 21 cases.

transformers is only the reference here (the worker never imports it). Every template x case pair must either raise
on both sides or render the identical string, and the render/raise outcome of each pair must match the matrix in
tests/support/data/chat_templates/MANIFEST.md, so a comparison that silently breaks (e.g. both sides always
raising) fails.
"""

from __future__ import annotations

import datetime as dt
import hashlib
import json
import re
from pathlib import Path

import jinja2
import pytest

from tokenization.chat_template import ChatTemplate, ChatTemplateError

transformers = pytest.importorskip("transformers")
from tokenizers import Tokenizer, models  # noqa: E402
from transformers.utils import chat_template_utils as hf_chat_utils  # noqa: E402

DATA = Path(__file__).resolve().parents[2] / "support" / "data" / "chat_templates"
CASES = json.loads((DATA / "cases.json").read_text(encoding="utf-8"))["cases"]
FROZEN_NOW = dt.datetime(2025, 3, 14, 9, 26, 53)

# MANIFEST column key -> template file stem.
COLUMNS = {
    "L3.2": "llama-3.2-3b-instruct", "L3.3": "llama-3.3-70b-instruct", "H3": "hermes-3-llama-3.1-tool-use",
    "Q2.5": "qwen2.5-7b-instruct", "Q3": "qwen3-0.6b", "Q2VL": "qwen2-vl-7b-instruct",
    "Nemo": "mistral-nemo-instruct-2407", "R1D": "deepseek-r1-distill-llama-8b", "DSV3.1": "deepseek-v3.1",
    "G2": "gemma-2-2b-it", "Gr3.3": "granite-3.3-2b-instruct", "DSC": "deepseek-coder-33b-instruct",
}
TEMPLATES = list(COLUMNS.values())

_QWEN = {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"}
_DEEPSEEK_BOS = "<｜begin▁of▁sentence｜>"
# The special tokens of the MANIFEST table ("value to supply", plus the model's other tokens it lists).
SPECIAL_TOKENS = {
    "llama-3.2-3b-instruct": {"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>"},
    "llama-3.3-70b-instruct": {"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>"},
    "hermes-3-llama-3.1-tool-use": {"bos_token": "<|begin_of_text|>", "eos_token": "<|im_end|>"},
    "qwen2.5-7b-instruct": _QWEN,
    "qwen3-0.6b": _QWEN,
    "qwen2-vl-7b-instruct": _QWEN,
    "mistral-nemo-instruct-2407": {"bos_token": "<s>", "eos_token": "</s>"},
    "deepseek-r1-distill-llama-8b": {"bos_token": _DEEPSEEK_BOS, "eos_token": "<｜end▁of▁sentence｜>"},
    "deepseek-v3.1": {"bos_token": _DEEPSEEK_BOS, "eos_token": "<｜end▁of▁sentence｜>"},
    "gemma-2-2b-it": {"bos_token": "<bos>", "eos_token": "<eos>"},
    "granite-3.3-2b-instruct": {k: "<|end_of_text|>" for k in ("bos_token", "eos_token", "pad_token")},
    "deepseek-coder-33b-instruct": {"bos_token": _DEEPSEEK_BOS, "eos_token": "<|EOT|>"},
}
# Render/raise totals from the MANIFEST (also parsed below; hard-coded so a parsing bug cannot hide a mismatch).
EXPECTED_TOTALS = {
    "L3.2": (20, 1), "L3.3": (20, 1), "H3": (7, 14), "Q2.5": (19, 2), "Q3": (18, 3), "Q2VL": (21, 0),
    "Nemo": (18, 3), "R1D": (18, 3), "DSV3.1": (15, 6), "G2": (10, 11), "Gr3.3": (18, 3), "DSC": (18, 3),
}
ERROR_KINDS = {"TE": jinja2.TemplateError, "TyE": TypeError, "UE": jinja2.UndefinedError}


def parse_manifest() -> tuple[dict[tuple[str, str], str], dict[str, tuple[int, int]]]:
    """The MANIFEST matrix as {(template, case): "ok" | "TE" | "TyE" | "UE"} and its per-template totals."""
    lines = (DATA / "MANIFEST.md").read_text(encoding="utf-8").splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("| case |"))
    header = [c.strip() for c in lines[start].strip().strip("|").split("|")][1:]
    cells: dict[tuple[str, str], str] = {}
    totals: dict[str, tuple[int, int]] = {}
    for line in lines[start + 2:]:
        if not line.startswith("|"):
            break
        row = [c.strip() for c in line.strip().strip("|").split("|")]
        if row[0].startswith("**renders"):
            for key, cell in zip(header, row[1:]):
                ok, raised = cell.split("/")
                totals[key] = (int(ok), int(raised))
            continue
        for key, cell in zip(header, row[1:]):
            match = re.match(r"(ok|✗ (TE|TyE|UE))", cell)
            assert match, f"unparsed MANIFEST cell {cell!r}"
            cells[(COLUMNS[key], row[0].strip("`"))] = "ok" if match.group(1) == "ok" else match.group(2)
    return cells, totals


class _FrozenDatetime(dt.datetime):
    @classmethod
    def now(cls, tz=None):
        return FROZEN_NOW


def _hf_tokenizer(special_tokens: dict[str, str]):
    backend = Tokenizer(models.WordLevel({"<unk>": 0}, unk_token="<unk>"))
    return transformers.PreTrainedTokenizerFast(tokenizer_object=backend, **special_tokens)


def _hf_render(tok, source, messages, **kw):
    try:
        return tok.apply_chat_template(messages, chat_template=source, tokenize=False, **kw)
    except Exception as exc:  # noqa: BLE001 - any failure counts as "raises"
        return exc


def _our_render(template: ChatTemplate, messages, special_tokens, **kw):
    try:
        return template.render(messages, special_tokens=special_tokens, **kw)
    except ChatTemplateError as exc:
        return exc


@pytest.fixture(scope="module")
def frozen_hf_clock():
    """HF's strftime_now reads `datetime.now()` from chat_template_utils' globals at call time; freeze it there."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(hf_chat_utils, "datetime", _FrozenDatetime)
        yield


@pytest.fixture(scope="module")
def outcomes(frozen_hf_clock):
    """{(template, case_id): (hf_result, our_result)} for all 252 pairs; a result is a str or an exception."""
    results = {}
    for name in TEMPLATES:
        source = (DATA / f"{name}.jinja").read_text(encoding="utf-8")
        tokens = SPECIAL_TOKENS[name]
        tok = _hf_tokenizer(tokens)
        assert tok.special_tokens_map == tokens
        ours = ChatTemplate(source, origin="test", now=lambda: FROZEN_NOW)
        for case in CASES:
            kw = dict(tools=case["tools"], add_generation_prompt=case["add_generation_prompt"], **case["kwargs"])
            results[(name, case["id"])] = (
                _hf_render(tok, source, case["messages"], **kw),
                _our_render(ours, case["messages"], tokens, **kw),
            )
    return results


@pytest.mark.parametrize("case_id", [c["id"] for c in CASES])
@pytest.mark.parametrize("name", TEMPLATES)
def test_matches_transformers(outcomes, name, case_id):
    hf, ours = outcomes[(name, case_id)]
    if isinstance(hf, Exception):
        assert isinstance(ours, ChatTemplateError), f"HF raised {hf!r} but we rendered {ours!r}"
    else:
        assert not isinstance(ours, Exception), f"HF rendered {hf!r} but we raised {ours!r}"
        assert ours == hf


def test_outcomes_match_manifest_matrix(outcomes):
    cells, totals = parse_manifest()
    assert totals == EXPECTED_TOTALS
    assert len(cells) == len(TEMPLATES) * len(CASES) == len(outcomes) == 252
    counts = {key: [0, 0] for key in COLUMNS}
    key_of = {v: k for k, v in COLUMNS.items()}
    for (name, case_id), expected in cells.items():
        hf, ours = outcomes[(name, case_id)]
        counts[key_of[name]][expected != "ok"] += 1
        if expected == "ok":
            assert isinstance(hf, str) and isinstance(ours, str) and ours, (name, case_id, hf, ours)
        else:
            kind = ERROR_KINDS[expected]
            assert isinstance(hf, kind), (name, case_id, hf)
            assert isinstance(ours, ChatTemplateError) and isinstance(ours.__cause__, kind), (name, case_id, ours)
            assert ours.raised_by_template == (expected == "TE")
    assert {k: tuple(v) for k, v in counts.items()} == EXPECTED_TOTALS
    equal = sum(isinstance(o, str) and o == h for h, o in outcomes.values())
    assert equal == sum(ok for ok, _ in EXPECTED_TOTALS.values()) == 202


def test_frozen_clock_and_special_tokens_reach_both_sides(outcomes):
    hf, ours = outcomes[("granite-3.3-2b-instruct", "user_only")]
    assert "March 14, 2025" in ours and ours == hf
    hf, ours = outcomes[("llama-3.2-3b-instruct", "user_only")]
    assert "14 Mar 2025" in ours and ours.startswith("<|begin_of_text|>") and ours == hf
    assert outcomes[("mistral-nemo-instruct-2407", "multi_turn")][1].startswith("<s>")


def test_template_error_message_names_the_problem(outcomes):
    _, ours = outcomes[("gemma-2-2b-it", "system_user")]
    assert "System role not supported" in str(ours) and ours.raised_by_template
    _, ours = outcomes[("qwen2.5-7b-instruct", "content_parts_user")]
    assert "can only concatenate str" in str(ours) and not ours.raised_by_template


def test_sha256_matches_manifest():
    manifest = (DATA / "MANIFEST.md").read_text(encoding="utf-8")
    for name in TEMPLATES:
        template = ChatTemplate((DATA / f"{name}.jinja").read_text(encoding="utf-8"), origin="test")
        assert template.sha256 == hashlib.sha256((DATA / f"{name}.jinja").read_bytes()).hexdigest()
        assert f"`{name}.jinja` | {len(template.source.encode())} | `{template.sha256}`" in manifest


def test_declared_variables():
    def declared(name):
        return ChatTemplate((DATA / f"{name}.jinja").read_text(encoding="utf-8"), origin="test").declared_variables

    assert "enable_thinking" in declared("qwen3-0.6b")
    assert "thinking" in declared("deepseek-v3.1")
    assert {"thinking", "controls", "documents"} <= declared("granite-3.3-2b-instruct")
    assert {"date_string", "custom_tools", "tools_in_user_message", "bos_token"} <= declared("llama-3.2-3b-instruct")
    assert "add_vision_id" in declared("qwen2-vl-7b-instruct")
    for name in TEMPLATES:
        assert "messages" in declared(name)
        assert not declared(name) & {"raise_exception", "strftime_now", "namespace", "dict", "range"}
    assert "enable_thinking" not in declared("gemma-2-2b-it")


# --- continue_final_message, against HF ---------------------------------------------------------------------------

_CONVERSATION = [
    {"role": "system", "content": "You are a concise assistant."},
    {"role": "user", "content": "What is the capital of France?"},
]
CONTINUE_CASES = {
    "plain": (_CONVERSATION + [{"role": "assistant", "content": "The capital of France is Pa"}], True),
    "trailing_space": (_CONVERSATION[1:] + [{"role": "assistant", "content": "Sure, here it is:  "}], True),
    "content_parts": (
        _CONVERSATION[1:] + [{"role": "assistant", "content": [{"type": "text", "text": "Paris is the ca"}]}], True),
    "reasoning_field": (
        _CONVERSATION[1:] + [{"role": "assistant", "content": "", "reasoning_content": "The user asks about Fr"}],
        "reasoning_content"),
    "no_content": (_CONVERSATION[1:] + [{"role": "assistant", "content": None}], True),
}


@pytest.mark.parametrize("case", list(CONTINUE_CASES))
@pytest.mark.parametrize("name", TEMPLATES)
def test_continue_final_message_matches_transformers(frozen_hf_clock, name, case):
    source = (DATA / f"{name}.jinja").read_text(encoding="utf-8")
    tokens = SPECIAL_TOKENS[name]
    messages, cont = CONTINUE_CASES[case]
    hf = _hf_render(_hf_tokenizer(tokens), source, messages, continue_final_message=cont)
    ours = _our_render(ChatTemplate(source, origin="t", now=lambda: FROZEN_NOW), messages, tokens,
                       continue_final_message=cont)
    if isinstance(hf, Exception):
        assert isinstance(ours, ChatTemplateError), (hf, ours)
    else:
        assert ours == hf


def test_continue_final_message_is_not_vacuous():
    # How many of the 12 templates can continue each case (the parametrized test shows HF agrees pair by pair).
    expected = {"plain": 10, "trailing_space": 11, "content_parts": 4, "reasoning_field": 1, "no_content": 0}
    for case, (messages, cont) in CONTINUE_CASES.items():
        rendered = 0
        for name in TEMPLATES:
            template = ChatTemplate((DATA / f"{name}.jinja").read_text(), origin="t", now=lambda: FROZEN_NOW)
            result = _our_render(template, messages, SPECIAL_TOKENS[name], continue_final_message=cont)
            rendered += isinstance(result, str)
        assert rendered == expected[case], case


def test_continue_final_message_cuts_after_the_text():
    messages, _ = CONTINUE_CASES["plain"]
    rendered = ChatTemplate((DATA / "qwen2.5-7b-instruct.jinja").read_text(), origin="t").render(
        messages, special_tokens=_QWEN, continue_final_message=True)
    assert rendered.endswith("<|im_start|>assistant\nThe capital of France is Pa")
    messages, _ = CONTINUE_CASES["trailing_space"]
    rendered = ChatTemplate((DATA / "llama-3.3-70b-instruct.jinja").read_text(), origin="t").render(
        messages, special_tokens={}, continue_final_message=True)
    assert rendered.endswith("Sure, here it is:")


# --- contract details, each checked against HF on a small template -------------------------------------------------

SMALL_TEMPLATES = {
    "none_keys": "{{ messages[0].content is defined }} {{ messages[0].meta.k is none }} {{ messages[0]|tojson }}",
    "reasoning_alias": "{% for m in messages %}{{ m|tojson }}|{% endfor %}",
    "tojson_options": "{{ tools|tojson(indent=2) }}#{{ tools|tojson(separators=(',', ':')) }}#{{ tools|tojson }}"
                      "#{{ tools|tojson(True) }}#{{ tools|tojson(sort_keys=true) }}",
    "always_defined": "{{ tools is defined }} {{ tools is none }} {{ documents is none }} {{ documents|tojson }}",
    "generation_tag": "{% for m in messages %}{% generation %}{{ m.content }}{% endgeneration %}{% endfor %}",
    "special_tokens": "{{ bos_token }}|{{ eos_token }}|{{ custom }}",
    "dict_and_namespace": "{% set ns = namespace(n=0) %}{% for m in messages %}{% set ns.n = ns.n + 1 %}{% endfor %}"
                          "{{ ns.n }} {{ dict(a=1)|tojson }} {{ dict.fromkeys(['x'], 0)|tojson }}",
    "loopcontrols": "{% for m in messages %}{% if loop.index > 1 %}{% break %}{% endif %}{{ m.role }}{% endfor %}",
    "trim_blocks": "  {% if true %}\nA\n  {% endif %}\nB\n",
}
SMALL_INPUTS = [
    ([{"role": "user", "content": None, "meta": {"k": None}}], {}),
    ([{"role": "assistant", "content": "x", "reasoning": "r1"}, {"role": "assistant", "thinking": "t",
                                                                   "reasoning_content": "rc"}], {}),
    ([{"role": "user", "content": "hi"}], {"tools": [{"type": "function", "function": {
        "name": "f", "description": "20 °C & 'quoted' <tag>", "parameters": {"z": 1, "a": [1, 2]}}}]}),
    ([{"role": "user", "content": "hi"}], {"tools": [], "documents": [{"title": "T", "text": "é"}]}),
    ([{"role": "user", "content": "hi"}], {"bos_token": "<override>", "custom": 7}),
]


# The only small template x input pairs that raise (on both sides): they read `meta`, which the others lack.
EXPECTED_SMALL_RAISES = {("none_keys", i) for i in range(1, len(SMALL_INPUTS))}


@pytest.mark.parametrize("inputs", range(len(SMALL_INPUTS)))
@pytest.mark.parametrize("template_name", list(SMALL_TEMPLATES))
def test_contract_details_match_transformers(template_name, inputs):
    source = SMALL_TEMPLATES[template_name]
    messages, kw = SMALL_INPUTS[inputs]
    tokens = {"bos_token": "<s>", "eos_token": "</s>"}
    hf = _hf_render(_hf_tokenizer(tokens), source, messages, **kw)
    ours = _our_render(ChatTemplate(source, origin="t"), messages, tokens, **kw)
    if isinstance(hf, Exception):
        assert isinstance(ours, ChatTemplateError), (hf, ours)
        assert (template_name, inputs) in EXPECTED_SMALL_RAISES, hf
    else:
        assert ours == hf


def test_reasoning_and_none_keys_semantics():
    rendered = ChatTemplate(SMALL_TEMPLATES["none_keys"], origin="t").render(SMALL_INPUTS[0][0], special_tokens={})
    assert rendered.startswith("False True ")  # top-level None dropped, nested None kept
    rendered = ChatTemplate(SMALL_TEMPLATES["reasoning_alias"], origin="t").render(
        SMALL_INPUTS[1][0], special_tokens={})
    first, second, _ = rendered.split("|")
    assert json.loads(first) == {"thinking": "r1", "role": "assistant", "content": "x", "reasoning": "r1",
                                 "reasoning_content": "r1"}
    assert json.loads(second) == {"thinking": "t", "role": "assistant", "reasoning_content": "rc"}


def test_errors_are_chat_template_errors():
    ok = ChatTemplate("{{ messages[0].content }}", origin="t")
    with pytest.raises(ChatTemplateError, match="empty conversation"):
        ok.render([], special_tokens={})
    with pytest.raises(ChatTemplateError, match="cannot both be set"):
        ok.render([{"role": "assistant", "content": "x"}], special_tokens={}, add_generation_prompt=True,
                  continue_final_message=True)
    with pytest.raises(ChatTemplateError, match="messages"):
        ok.render([{"role": "user", "content": "x"}], special_tokens={}, messages=[])
    with pytest.raises(ChatTemplateError, match="must be objects"):
        ok.render(["not a message"], special_tokens={})
    with pytest.raises(ChatTemplateError, match="invalid chat template"):
        ChatTemplate("{% if %}", origin="request")
    with pytest.raises(ChatTemplateError, match="underscore"):
        ChatTemplate("{% set ns = namespace(_x=1) %}", origin="t").render([{"role": "user"}], special_tokens={})
    with pytest.raises(ChatTemplateError, match="SecurityError"):
        ChatTemplate("{{ messages.__class__.__mro__ }}", origin="t").render([{"role": "u"}], special_tokens={})
    with pytest.raises(ChatTemplateError, match="boom") as info:
        ChatTemplate("{{ raise_exception('boom') }}", origin="t").render([{"role": "u"}], special_tokens={})
    assert info.value.raised_by_template
    with pytest.raises(ChatTemplateError, match="UndefinedError"):
        ChatTemplate("{{ messages[0].content.x.y }}", origin="t").render([{"role": "u"}], special_tokens={})


def test_caller_messages_are_not_mutated():
    messages = [{"role": "user", "content": "hi", "extra": None},
                {"role": "assistant", "content": [{"type": "text", "text": "he"}]}]
    snapshot = json.dumps(messages)
    ChatTemplate("{% for m in messages %}{{ m.content }}{% endfor %}", origin="t").render(
        messages, special_tokens={}, continue_final_message=True)
    assert json.dumps(messages) == snapshot


def test_strftime_now_uses_injected_clock():
    template = ChatTemplate("{{ strftime_now('%Y-%m-%d') }}", origin="t", now=lambda: FROZEN_NOW)
    assert template.render([{"role": "user"}], special_tokens={}) == "2025-03-14"


def test_render_stops_once_output_passes_the_byte_limit():
    template = ChatTemplate("{% for i in range(100000) %}{{ messages[0].content }}{% endfor %}",
                            origin="test")
    chat = [{"role": "user", "content": "x" * 100}]
    with pytest.raises(ChatTemplateError) as err:
        template.render(chat, special_tokens={}, max_output_bytes=10_000)
    assert err.value.limit == "output"
    assert len(template.render(chat[:1] * 1, special_tokens={}, max_output_bytes=None)) == 10**7


def test_output_limit_with_continue_final_message_applies_after_the_cut():
    source = ("{% for m in messages %}{{ m.content }}|{% endfor %}"
              "{% for i in range(1000) %}trailer{% endfor %}")
    template = ChatTemplate(source, origin="test")
    chat = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Sure"}]
    text = template.render(chat, special_tokens={}, continue_final_message=True,
                           max_output_bytes=64)
    assert text == "hi|Sure"


def test_time_limit_interrupts_a_render_in_the_main_thread():
    from tokenizer_worker.deadline import time_limit

    template = ChatTemplate("{% for a in range(100000) %}{% for b in range(100000) %}"
                            "{% endfor %}{% endfor %}", origin="test")
    with pytest.raises(ChatTemplateError) as err, time_limit(0.2):
        template.render([{"role": "user", "content": "x"}], special_tokens={})
    assert err.value.limit == "time"


def test_tool_call_arguments_reach_each_template_as_it_reads_them(frozen_hf_clock):
    """The SDK sends earlier calls' arguments back as JSON text (case tool_call_string_args);
    the tokenizer worker hands each template what it reads (tokenizer_worker/tool_arguments):
    objects where it writes them with tojson / items (rendering as transformers renders
    tool_call_dict_args), the text where it only concatenates it (DeepSeek: as transformers
    renders the text, where objects would raise)."""
    from tokenizer_worker.tool_arguments import arguments_as_objects, detect_arguments_format

    by_id = {c["id"]: c for c in CASES}
    wire, objects = by_id["tool_call_string_args"], by_id["tool_call_dict_args"]
    formats = {}
    for name in TEMPLATES:
        source = (DATA / f"{name}.jinja").read_text(encoding="utf-8")
        formats[name] = detect_arguments_format(source)
        tokens = SPECIAL_TOKENS[name]
        ours = ChatTemplate(source, origin="test", now=lambda: FROZEN_NOW)
        messages = wire["messages"]
        if formats[name] == "object":
            messages = arguments_as_objects(messages)
        reference = objects if formats[name] == "object" else wire
        kw = dict(tools=wire["tools"], add_generation_prompt=True)
        expected = _hf_render(_hf_tokenizer(tokens), source, reference["messages"], **kw)
        got = _our_render(ours, messages, tokens, **kw)
        if isinstance(expected, Exception):
            assert isinstance(got, ChatTemplateError), (name, got)
        else:
            assert got == expected, name
    assert {n for n, f in formats.items() if f == "text"} == {
        "deepseek-v3.1", "deepseek-r1-distill-llama-8b"}
    assert arguments_as_objects([{"role": "assistant", "tool_calls": [
        {"function": {"name": "f", "arguments": ""}}]}])[0]["tool_calls"][0]["function"][
        "arguments"] == {}
