"""Client constraints -> llguidance grammars, checked before anything is scheduled.

llguidance is Candor's one grammar engine (see the README for why and what it costs).
The tokenizer worker turns a ``GuidedSpec`` into the engine's grammar text, and compiles
it against the model's vocabulary so a grammar the engine cannot enforce (an unsupported
JSON-schema keyword, a regex it cannot compile) is a 400 naming the field, before
generation, never a silently partial constraint. Results are cached by a hash of the spec.
The gpu_worker builds its matchers from the same text.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections import OrderedDict
from typing import NamedTuple

import llguidance

from protocol.ipc import GuidedSpec

_CACHE_SIZE = 256
# Compact JSON: one spelling per value, so output never wanders into unbounded whitespace.
JSON_DEFAULTS = {"whitespace_flexible": False}


class GrammarError(Exception):
    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions",
                "dependentSchemas")
_SCHEMA_LISTS = ("anyOf", "allOf", "oneOf", "prefixItems")
_SCHEMA_ONE = ("items", "additionalProperties", "not", "if", "then", "else", "contains",
               "propertyNames", "additionalItems", "unevaluatedProperties")


def close_objects(schema):
    """Objects that list ``properties`` and say nothing of ``additionalProperties`` get
    ``false``, as vLLM's default engine does: the output still validates against the
    schema, and the model cannot wander into keys nobody asked for (with random weights
    it otherwise fills ``max_tokens`` with one)."""
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    for key in _SCHEMA_MAPS:
        if isinstance(out.get(key), dict):
            out[key] = {name: close_objects(sub) for name, sub in out[key].items()}
    for key in _SCHEMA_LISTS:
        if isinstance(out.get(key), list):
            out[key] = [close_objects(sub) for sub in out[key]]
    for key in _SCHEMA_ONE:
        if isinstance(out.get(key), dict):
            out[key] = close_objects(out[key])
    if isinstance(out.get("properties"), dict) and "additionalProperties" not in out:
        out["additionalProperties"] = False
    return out


def grammar_text(spec: GuidedSpec) -> str:
    """The llguidance grammar for one spec; ValueError for a malformed one."""
    if spec.kind == "json_schema":
        schema = json.loads(spec.spec)
        if not isinstance(schema, dict):
            raise ValueError("a JSON schema must be an object")
        return llguidance.LLMatcher.grammar_from_json_schema(close_objects(schema),
                                                            defaults=JSON_DEFAULTS)
    if spec.kind == "json_object":
        return llguidance.LLMatcher.grammar_from_json_schema('{"type": "object"}',
                                                            defaults=JSON_DEFAULTS)
    if spec.kind == "regex":
        return llguidance.LLMatcher.grammar_from_regex(spec.spec)
    if spec.kind == "choice":
        return llguidance.grammar_from("choice", spec.spec)
    return llguidance.grammar_from("grammar", spec.spec)


# JSON values whose every spelling is known: a schema of only these has a longest output.
_FINITE_TYPES = {"boolean": (True, False), "null": (None,)}


def longest_output_bytes(spec: GuidedSpec) -> int | None:
    """The most bytes any output of ``spec`` can have, where that is cheap and certain (a
    choice list; a JSON schema of booleans/null: a const, an enum or those types); None
    otherwise. Every token is at least a byte, so it bounds the tokens before the end."""
    if spec.reasoning is not None:  # the <think> block before the answer is unbounded
        return None
    if spec.kind == "choice":
        return max(len(choice.encode()) for choice in json.loads(spec.spec))
    if spec.kind != "json_schema":
        return None
    schema = json.loads(spec.spec)
    if not isinstance(schema, dict):
        return None
    if "const" in schema:
        values = [schema["const"]]
    elif isinstance(schema.get("enum"), list):
        values = schema["enum"]
    else:
        types = schema.get("type")
        types = [types] if isinstance(types, str) else types
        if not isinstance(types, list) or not types or any(t not in _FINITE_TYPES for t in types):
            return None
        values = [v for t in types for v in _FINITE_TYPES[t]]
    if not values or not all(v is None or isinstance(v, bool) for v in values):
        return None
    return max(len(json.dumps(v)) for v in values)


END_THINK = "</think>"


def _avoiding(text: str) -> str:
    """A Rust regex (Lark ``/.../`` form) for strings that do not contain ``text``, whose
    first character occurs nowhere else in it (true of ``</think>``): the automaton of the
    standard construction, written out. It may end in a proper prefix of ``text``."""
    def esc(c: str) -> str:
        return "\\/" if c == "/" else re.escape(c)
    first = text[0]
    assert first not in text[1:]
    chain = ""  # optional run of text[1:-1]: (/(t(h(...)?)?)?) for </think>
    for c in reversed(text[1:-1]):
        chain = f"{esc(c)}({chain})?" if chain else esc(c)
    back = f"(({chain})?{esc(first)})*"  # partial matches cut short by a new first char

    def leave(k: int) -> str:  # a character that breaks the partial match at k
        cls = f"[^{esc(text[k])}{esc(first)}]"
        return cls if k == len(text) - 1 else f"({cls}|{esc(text[k])}{leave(k + 1)})"
    return (f"([^{esc(first)}]|{esc(first)}{back}{leave(1)})*"
            f"({esc(first)}{back}({chain})?)?")


def after_reasoning(answer: str, parser: str) -> str:
    """``answer`` (llguidance grammar text) behind a free ``<think>`` block: deepseek_r1
    replies start inside the block (the template opened it), qwen3 replies open it. The
    block is one lexeme that ends at the first ``</think>``."""
    try:
        grammars = json.loads(answer)["grammars"]
    except (ValueError, KeyError, TypeError):
        grammars = [{"lark_grammar": answer}]
    grammars = [dict(grammars[0], name="answer"), *grammars[1:]]
    opening = '"<think>" ' if parser == "qwen3" else ""
    wrapper = "\n".join([f"start: {opening}REASONING WS @answer",
                         f"REASONING: /{_avoiding(END_THINK)}<\\/think>/",
                         r"WS: /[ \t\r\n]*/"])
    return json.dumps({"grammars": [{"lark_grammar": wrapper}, *grammars]})


class _Rejection(NamedTuple):
    """Why the grammar engine refused a spec, without the field that carried it."""
    what: str
    detail: str


class GrammarCompiler:
    def __init__(self, tokenizer: llguidance.LLTokenizer) -> None:
        self.tokenizer = tokenizer
        self._cache: OrderedDict[str, str | _Rejection] = OrderedDict()

    def compile(self, spec: GuidedSpec) -> str:
        """The grammar text the worker will enforce, or GrammarError naming the field.
        The cache is keyed by what is compiled, not by who asked: a rejection is kept
        without a field name, so each caller's error names its own field."""
        key = hashlib.sha256(f"{spec.kind}\0{spec.reasoning}\0{spec.spec}".encode()).hexdigest()
        got = self._cache.get(key)
        if got is None:
            got = self._compile(spec)
            self._cache[key] = got
            if len(self._cache) > _CACHE_SIZE:
                self._cache.popitem(last=False)
        else:
            self._cache.move_to_end(key)
        if isinstance(got, _Rejection):
            raise GrammarError(f"`{spec.field}`: this {got.what} cannot be enforced by "
                               f"Candor's grammar engine (llguidance): {got.detail}",
                               spec.field)
        return got

    def _compile(self, spec: GuidedSpec) -> str | _Rejection:
        what = {"json_schema": "JSON schema", "json_object": "JSON object constraint",
                "regex": "regular expression", "choice": "choice list",
                "grammar": "grammar"}[spec.kind]
        try:
            grammar = grammar_text(spec)
            if spec.reasoning is not None:
                grammar = after_reasoning(grammar, spec.reasoning)
            failed, messages = llguidance.LLMatcher.validate_grammar_with_warnings(
                grammar, self.tokenizer)
            if not failed:
                matcher = llguidance.LLMatcher(self.tokenizer, grammar)
                failed, messages = matcher.is_error(), [matcher.get_error()]
        except (ValueError, TypeError) as err:
            failed, messages = True, [str(err)]
        if not failed:
            return grammar
        detail = "; ".join(m for m in messages if m) or "rejected by the grammar engine"
        return _Rejection(what, detail)
