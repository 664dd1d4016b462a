"""Tool-call parsers on the exact text each real chat template writes for a call.

The model-side text comes from rendering an assistant turn with ``tool_calls`` through the
checkpoint's own template (tests/support/data/chat_templates) and cutting off the prompt and the
end-of-turn token: that is what a model trained on the template emits. Each case is parsed
whole and streamed in pieces of several sizes; the stream must concatenate to the whole
answer, and no tag may reach ``content``.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from api_frontend import tool_parsers
from api_frontend.tool_parsers.stream import ToolCallStream, parse_whole
from tokenization.chat_template import ChatTemplate

DATA = Path(__file__).resolve().parents[2] / "support" / "data" / "chat_templates"
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "description": "city"},
                                                    "unit": {"type": "string", "description": "unit"}},
                   "required": ["city"]}}}
TIME = {"type": "function", "function": {"name": "get_time", "description": "Time", "parameters": {
    "type": "object", "properties": {"zone": {"type": "string", "description": "IANA zone"}}}}}
CALLS = [("get_weather", {"city": "Zürich", "unit": "°C \"quoted\" <b>"}),
         ("get_time", {"zone": "Europe/Paris"})]
USER = {"role": "user", "content": "Weather and time in Zürich?"}
NAMES = ("get_weather", "get_time")  # the request's tools: a call must name one of them


def _parser(name: str):
    return tool_parsers.get(name, NAMES)

# template stem, parser, special tokens, end-of-turn text after the calls, several calls?
TEMPLATES = [
    ("hermes-3-llama-3.1-tool-use", "hermes", {"bos_token": "<|begin_of_text|>",
                                               "eos_token": "<|im_end|>"}, "<|im_end|>", True),
    ("qwen2.5-7b-instruct", "hermes", {"eos_token": "<|im_end|>"}, "<|im_end|>", True),
    ("qwen3-0.6b", "hermes", {"eos_token": "<|im_end|>"}, "<|im_end|>", True),
    ("llama-3.3-70b-instruct", "llama3_json", {"bos_token": "<|begin_of_text|>",
                                               "eos_token": "<|eot_id|>"}, "<|eot_id|>", False),
    ("mistral-nemo-instruct-2407", "mistral", {"bos_token": "<s>", "eos_token": "</s>"},
     "</s>", True),
    ("deepseek-v3.1", "deepseek_v31", {"bos_token": "<｜begin▁of▁sentence｜>",
                                       "eos_token": "<｜end▁of▁sentence｜>"},
     "<｜end▁of▁sentence｜>", True),
]


def _model_text(stem: str, special: dict, eot: str, calls) -> str:
    """The assistant turn the template renders for ``calls``, as the model would emit it."""
    template = ChatTemplate((DATA / f"{stem}.jinja").read_text(encoding="utf-8"), origin=stem)
    tool_calls = [{"id": f"call{i:05d}", "type": "function",
                   "function": {"name": n, "arguments": a}} for i, (n, a) in enumerate(calls)]
    if stem == "deepseek-v3.1":  # its template writes arguments as given: a JSON string
        for c in tool_calls:
            c["function"]["arguments"] = json.dumps(c["function"]["arguments"],
                                                    ensure_ascii=False)
    prompt = template.render([USER], tools=[WEATHER, TIME], add_generation_prompt=True,
                             special_tokens=special)
    full = template.render([USER, {"role": "assistant", "content": "",
                                   "tool_calls": tool_calls}],
                           tools=[WEATHER, TIME], special_tokens=special)
    assert full.startswith(prompt), (prompt[-80:], full[len(prompt) - 80:])
    turn = full[len(prompt):]
    turn = turn.removeprefix("<think>\n\n</think>\n\n")  # Qwen3's empty reasoning block
    return turn[:turn.rindex(eot)]


def _stream(parser_name: str, text: str, size: int):
    stream = ToolCallStream(_parser(parser_name))
    content, calls = "", {}
    pieces = [text[i:i + size] for i in range(0, len(text), size)] or [""]
    for k, piece in enumerate(pieces):
        new, deltas = stream.feed(piece, final=k == len(pieces) - 1)
        content += new
        # at most one delta per call in a chunk: clients read a chunk's first one only
        assert len({d.index for d in deltas}) == len(deltas), deltas
        for d in deltas:
            if d.id is not None:  # a call's first delta: id, type, name, arguments so far
                assert d.index == len(calls) and d.type == "function"
                assert d.function.name and d.function.arguments is not None
                calls[d.index] = [d.function.name, d.function.arguments]
            else:
                assert d.function.name is None and d.function.arguments
                calls[d.index][1] += d.function.arguments
    return content, [tuple(c) for c in calls.values()]


def _check(parser_name: str, text: str, calls, content: str | None) -> None:
    whole = parse_whole(_parser(parser_name), text)
    got = [(c.function.name, json.loads(c.function.arguments)) for c in whole.calls]
    assert got == [(n, a) for n, a in calls]
    assert whole.content == content
    for size in (1, 2, 3, 7, len(text) or 1):
        s_content, s_calls = _stream(parser_name, text, size)
        assert s_content == (whole.content or ""), size
        assert s_calls == [(c.function.name, c.function.arguments) for c in whole.calls], size
        if calls:  # a call's tags never leak (text that is no call keeps its own)
            for marker in _parser(parser_name).markers:
                assert marker not in s_content or marker in content


@pytest.mark.parametrize("stem,parser,special,eot,several", TEMPLATES,
                         ids=[t[0] for t in TEMPLATES])
def test_parser_reads_its_templates_calls(stem, parser, special, eot, several):
    one = _model_text(stem, special, eot, CALLS[:1])
    _check(parser, one, CALLS[:1], None)
    if several:
        _check(parser, _model_text(stem, special, eot, CALLS), CALLS, None)


@pytest.mark.parametrize("stem,parser,special,eot,several", TEMPLATES,
                         ids=[t[0] for t in TEMPLATES])
def test_parser_detected_from_template(stem, parser, special, eot, several):
    assert tool_parsers.detect((DATA / f"{stem}.jinja").read_text(encoding="utf-8")) == parser


def test_detection_needs_one_format():
    assert tool_parsers.detect("{{ messages }}") is None
    assert tool_parsers.detect("<tool_call> [TOOL_CALLS]") is None
    tiny = Path(__file__).resolve().parents[3] / "launcher" / "tiny_model" / "chat_template.jinja"
    assert tool_parsers.detect(tiny.read_text()) == "hermes"


W = '{"name": "get_weather", "arguments": {"city": "Zürich"}}'
T = '{"name": "get_time", "arguments": {"zone": "UTC"}}'
CW, CT = ("get_weather", {"city": "Zürich"}), ("get_time", {"zone": "UTC"})


@pytest.mark.parametrize("parser,text,calls,content", [
    ("hermes", f"Let me check.\n<tool_call>\n{W}\n</tool_call>", [CW], "Let me check."),
    ("hermes", f"<tool_call>{W}</tool_call>\n<tool_call>{T}</tool_call>\nDone.", [CW, CT],
     "Done."),
    ("hermes", "No calls here, just <tool text.", [], "No calls here, just <tool text."),
    ("hermes", "<tool_call>not json</tool_call>", [], "<tool_call>not json</tool_call>"),
    ("hermes", '<tool_call>{"arguments": {"city": "X"}, "name": "get_weather"}</tool_call>',
     [("get_weather", {"city": "X"})], None),
    ("hermes", f"<tool_call>{W}", [CW], None),  # the end tag never came (max_tokens)
    ("llama3_json", W.replace("arguments", "parameters"), [CW], None),
    ("llama3_json", "<|python_tag|>" + W.replace("arguments", "parameters") + "; "
     + T.replace("arguments", "parameters"), [CW, CT], None),
    ("llama3_json", "It is sunny.", [], "It is sunny."),
    ("llama3_json", '{"answer": 42}', [], '{"answer": 42}'),
    ("mistral", f"Sure. [TOOL_CALLS][{W}, {T}]", [CW, CT], "Sure."),
    ("mistral", "Plain [TOOL answer", [], "Plain [TOOL answer"),
    ("granite", f"<|tool_call|>[{W}, {T}]", [CW, CT], None),
    ("granite", "I cannot do that.", [], "I cannot do that."),
    ("deepseek_v31", "Checking.<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>"
     '{"city": "Zürich"}<｜tool▁call▁end｜><｜tool▁call▁begin｜>get_time<｜tool▁sep｜>'
     '{"zone": "UTC"}<｜tool▁call▁end｜><｜tool▁calls▁end｜>', [CW, CT], "Checking."),
    # text between or after calls is content from there on, as written (it was dropped)
    ("deepseek_v31", "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>"
     '{"city": "Zürich"}<｜tool▁call▁end｜>Hmm.<｜tool▁call▁begin｜>get_time<｜tool▁sep｜>'
     '{"zone": "UTC"}<｜tool▁call▁end｜><｜tool▁calls▁end｜>', [CW],
     'Hmm.<｜tool▁call▁begin｜>get_time<｜tool▁sep｜>{"zone": "UTC"}<｜tool▁call▁end｜>'
     "<｜tool▁calls▁end｜>"),
    ("deepseek_v31", "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>"
     '{"city": "Zürich"}<｜tool▁call▁end｜> Done.', [CW], "Done."),
    ("deepseek_v31", "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>"
     '{"city": "Zürich"}<｜tool▁call▁end｜>\n<｜tool▁call▁begin｜>get_time<｜tool▁sep｜>'
     '{"zone": "UTC"}<｜tool▁call▁end｜>\n<｜tool▁calls▁end｜>', [CW, CT], None),
    # a call whose name never ended (max_tokens) is no call: its text is content
    ("deepseek_v31", "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>"
     '{"city": "Zürich"}<｜tool▁call▁end｜><｜tool▁call▁begin｜>get_ti', [CW],
     "<｜tool▁call▁begin｜>get_ti"),
    ("pythonic", '[get_weather(city="Zürich"), get_time(zone="UTC")]', [CW, CT], None),
    ("pythonic", "[get_weather(city='Zürich')]", [CW], None),
    ("pythonic", "[1, 2] is a list", [], "[1, 2] is a list"),
    ("pythonic", "Hello", [], "Hello"),
    # arguments written as a JSON string (some models do): the call's arguments are that text
    ("llama3_json", '{"name": "get_time", "parameters": "{\\"zone\\": \\"UTC\\"}"}', [CT], None),
    ("hermes", '<tool_call>{"name": "get_time", "arguments": "{\\"zone\\": \\"UTC\\"}"}'
     '</tool_call>', [CT], None),
])
def test_parser_cases(parser, text, calls, content):
    _check(parser, text, calls, content)


NOPE = '{"name": "launch_rockets", "arguments": {"count": 3}}'


@pytest.mark.parametrize("parser,text,calls,content", [
    # an object with a string "name" is not a call: a call has arguments (or parameters)
    ("llama3_json", '{"name": "John", "age": 30}', [], '{"name": "John", "age": 30}'),
    ("llama3_json", '{"name": "get_time"}', [], '{"name": "get_time"}'),
    ("llama3_json", '{"name": "get_time", "parameters": 5}', [],
     '{"name": "get_time", "parameters": 5}'),
    ("hermes", '<tool_call>{"name": "get_time", "zone": "UTC"}</tool_call>', [],
     '<tool_call>{"name": "get_time", "zone": "UTC"}</tool_call>'),
    # a name no declared tool has is not a call either: its text stays content, verbatim
    ("llama3_json", NOPE.replace("arguments", "parameters"), [],
     NOPE.replace("arguments", "parameters")),
    ("llama3_json", W + "; " + NOPE, [CW], NOPE),
    ("hermes", f"<tool_call>{NOPE}</tool_call>", [], f"<tool_call>{NOPE}</tool_call>"),
    ("hermes", f"<tool_call>{W}</tool_call><tool_call>{NOPE}</tool_call>", [CW],
     f"<tool_call>{NOPE}</tool_call>"),
    ("hermes", f"<tool_call>{NOPE}", [], f"<tool_call>{NOPE}"),
    ("mistral", f"[TOOL_CALLS][{NOPE}]", [], f"[TOOL_CALLS][{NOPE}]"),
    ("mistral", f"Sure. [TOOL_CALLS][{W}, {NOPE}]", [CW], f"Sure. {NOPE}]"),
    ("granite", f"<|tool_call|>[{NOPE}]", [], f"<|tool_call|>[{NOPE}]"),
    ("deepseek_v31", "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>launch_rockets<｜tool▁sep｜>{}"
     "<｜tool▁call▁end｜><｜tool▁calls▁end｜>", [],
     "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>launch_rockets<｜tool▁sep｜>{}"
     "<｜tool▁call▁end｜><｜tool▁calls▁end｜>"),
    ("deepseek_v31", "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_time<｜tool▁sep｜>"
     '{"zone": "UTC"}<｜tool▁call▁end｜><｜tool▁call▁begin｜>launch_rockets<｜tool▁sep｜>{}'
     "<｜tool▁call▁end｜><｜tool▁calls▁end｜>", [CT],
     "<｜tool▁call▁begin｜>launch_rockets<｜tool▁sep｜>{}<｜tool▁call▁end｜><｜tool▁calls▁end｜>"),
    ("pythonic", '[launch_rockets(count=3)]', [], '[launch_rockets(count=3)]'),
    ("pythonic", '[get_time(zone="UTC"), launch_rockets()]', [],
     '[get_time(zone="UTC"), launch_rockets()]'),
])
def test_only_declared_tools_are_called(parser, text, calls, content):
    """Policy: a call needs its arguments and a name from the request's ``tools``; any
    other text, however call-like, is content, whole and streamed alike (vLLM returns such
    a call; SGLang drops it with a log line)."""
    _check(parser, text, calls, content)


def test_required_and_named_shapes():
    text = ('[{"name": "get_weather", "parameters": {"city": "Zürich"}}, '
            '{"name": "get_time", "parameters": {"zone": "UTC"}}]')
    whole = parse_whole(tool_parsers.RequiredCallsParser(NAMES), text)
    assert [(c.function.name, json.loads(c.function.arguments)) for c in whole.calls] == [CW, CT]
    named = parse_whole(tool_parsers.NamedCallParser("get_weather"), '{"city": "Zürich"}')
    assert named.content is None and named.calls[0].function.arguments == '{"city": "Zürich"}'


def test_streamed_arguments_arrive_in_fragments():
    """Arguments stream while the model writes them, not all at once at the end."""
    stream = ToolCallStream(_parser("hermes"))
    text = f"<tool_call>{W}</tool_call>"
    fragments = []
    for ch in text:
        _, deltas = stream.feed(ch)
        fragments += [d.function.arguments for d in deltas]
    assert len(fragments) > 5 and "".join(fragments) == '{"city": "Zürich"}'


def test_unknown_parser_named():
    with pytest.raises(KeyError, match="known"):
        tool_parsers.get("nope", NAMES)


# ---------------------------------------------------------------- reasoning parsers

from api_frontend import reasoning  # noqa: E402


def _reasoning_stream(name: str, text: str, size: int) -> tuple[str, str]:
    stream = reasoning.ReasoningStream(reasoning.get(name))
    pieces = [text[i:i + size] for i in range(0, len(text), size)] or [""]
    out = ["", ""]
    for k, piece in enumerate(pieces):
        thought, content = stream.feed(piece, k == len(pieces) - 1)
        out[0] += thought
        out[1] += content
    return out[0], out[1]


def _qwen3_reply(thought: str, answer: str) -> str:
    """What Qwen3's template writes for an assistant turn with reasoning (the model's text)."""
    template = ChatTemplate((DATA / "qwen3-0.6b.jinja").read_text(encoding="utf-8"),
                            origin="qwen3")
    special = {"eos_token": "<|im_end|>"}
    prompt = template.render([USER], add_generation_prompt=True, special_tokens=special)
    full = template.render([USER, {"role": "assistant", "content": answer,
                                   "reasoning_content": thought}], special_tokens=special)
    return full[len(prompt):full.rindex("<|im_end|>")]


@pytest.mark.parametrize("name,text,thought,answer", [
    ("qwen3", _qwen3_reply("The user wants weather.", "It is sunny."),
     "\nThe user wants weather.\n", "\n\nIt is sunny."),
    ("qwen3", "No thinking here <think> at all.", "", "No thinking here <think> at all."),
    ("qwen3", "<think>cut short by max_tokens", "cut short by max_tokens", ""),
    ("deepseek_r1", "Let me think.</think>\n\nParis.", "Let me think.", "\n\nParis."),
    ("deepseek_r1", "<think>\nRepeated tag.\n</think>Rome", "\nRepeated tag.\n", "Rome"),
    ("deepseek_r1", "Still thinking <th", "Still thinking <th", ""),
])
def test_reasoning_split_whole_and_streamed(name, text, thought, answer):
    assert reasoning.get(name).split(text, True) == (thought, answer)
    for size in (1, 2, 5, len(text)):
        got = _reasoning_stream(name, text, size)
        assert got == (thought, answer), size
        assert "</think>" not in got[0] + got[1]


def test_reasoning_detection_and_switches():
    assert reasoning.detect((DATA / "qwen3-0.6b.jinja").read_text()) == "qwen3"
    r1 = (DATA / "deepseek-r1-distill-llama-8b.jinja").read_text()
    assert reasoning.detect(r1) == "deepseek_r1"
    assert reasoning.detect((DATA / "deepseek-v3.1.jinja").read_text()) is None
    assert reasoning.detect((DATA / "hermes-3-llama-3.1-tool-use.jinja").read_text()) is None
    assert not reasoning.get("deepseek_r1").active({"thinking": False})
    assert reasoning.get("qwen3").active({})


LONG_WORDS = "the keeper lit the lamp and watched the boats come home " * 200  # ~11k chars


@pytest.mark.parametrize("parser,text", [
    ("hermes", LONG_WORDS),
    ("hermes", f"Sure.<tool_call>{W[:-2]}, \"note\": \"{LONG_WORDS}\"}}}}</tool_call>"),
    ("deepseek_v31", "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>"
     f'{{"city": "Zürich", "note": "{LONG_WORDS}"}}<｜tool▁call▁end｜><｜tool▁calls▁end｜>'),
    ("llama3_json", f'{{"name": "get_time", "parameters": {{"zone": "{LONG_WORDS}"}}}}'),
    ("mistral", f'[TOOL_CALLS][{{"name": "get_time", "arguments": {{"zone": "{LONG_WORDS}"}}}}]'),
    ("pythonic", LONG_WORDS),
    ("named", f'{{"zone": "{LONG_WORDS}"}}'),
    ("required", f'[{{"name": "get_time", "parameters": {{"zone": "{LONG_WORDS}"}}}}]'),
])
def test_streaming_rescans_only_where_the_view_can_change(parser, text):
    """A streamed reply is not re-read whole for every token (quadratic in its length: a
    32k-character reply cost 0.3-1.1 s of frontend CPU): text that only extends the
    content or the open call's arguments is passed on as it comes. The stream still
    concatenates to the whole answer."""
    made = {"named": lambda: tool_parsers.NamedCallParser("get_time"),
            "required": lambda: tool_parsers.RequiredCallsParser(NAMES)}
    p = made[parser]() if parser in made else _parser(parser)
    scans = 0
    scan = p.scan

    def counted(t: str, final: bool):
        nonlocal scans
        scans += 1
        return scan(t, final)
    p.scan = counted
    stream = ToolCallStream(p)
    content, args = "", {}
    pieces = [text[k:k + 4] for k in range(0, len(text), 4)]
    for k, piece in enumerate(pieces):
        got, deltas = stream.feed(piece, final=k == len(pieces) - 1)
        content += got
        for d in deltas:
            args[d.index] = args.get(d.index, "") + (d.function.arguments or "")
    whole = parse_whole(made[parser]() if parser in made else _parser(parser), text)
    assert content == (whole.content or "")
    assert list(args.values()) == [c.function.arguments for c in whole.calls]
    assert scans < len(pieces) // 10, f"{scans} scans for {len(pieces)} pieces"


@pytest.mark.parametrize("name,text", [
    ("qwen3", f"<think>{LONG_WORDS}</think>{LONG_WORDS}"),
    ("deepseek_r1", f"{LONG_WORDS}</think>{LONG_WORDS}"),
    ("qwen3", LONG_WORDS),  # thinking off: all answer
])
def test_reasoning_stream_rescans_only_near_tags(name, text):
    """Reasoning replies are long (thousands of tokens): the stream reads the whole text
    again only where a tag may begin, not for every token (a 32k-character reply cost
    over a second of frontend CPU); it still concatenates to the whole split."""
    parser = reasoning.get(name)
    scans = 0
    bounds = parser.bounds

    def counted(t: str, final: bool):
        nonlocal scans
        scans += 1
        return bounds(t, final)
    parser.bounds = counted
    stream = reasoning.ReasoningStream(parser)
    pieces = [text[k:k + 4] for k in range(0, len(text), 4)]
    out = ["", ""]
    for k, piece in enumerate(pieces):
        thought, content = stream.feed(piece, k == len(pieces) - 1)
        out[0] += thought
        out[1] += content
    assert tuple(out) == reasoning.get(name).split(text, True)
    assert scans < len(pieces) // 10, f"{scans} scans for {len(pieces)} pieces"
