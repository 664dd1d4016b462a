"""Render chat templates the way transformers' ``apply_chat_template`` does, without importing transformers.

The tokenizer worker has to stay a lean process (no torch, no transformers), yet the prompt it builds must be
byte-for-byte the one the model was trained with, i.e. what ``tokenizer.apply_chat_template(..., tokenize=False)``
returns. So this module reproduces HF's rendering contract (checked against transformers 5.24 / jinja2 3.1.6, see
``tests/support/data/chat_templates/MANIFEST.md``):

* a sandboxed ``ImmutableSandboxedEnvironment`` with ``trim_blocks``/``lstrip_blocks``, ``loopcontrols`` and a
  ``{% generation %}`` tag (ours also sizes every value a template builds before building it: template_sandbox.py), plus HF's globals (``raise_exception``, ``strftime_now``, a restricted ``dict``, a
  ``namespace`` that rejects ``_``-prefixed names) and HF's ``tojson`` filter (no HTML escaping, no key sorting,
  non-ASCII kept, ``indent``/``separators`` accepted);
* message normalisation: top-level ``None``-valued message keys are dropped (nested ``None`` is kept, as in HF),
  reasoning is aliased under both ``thinking`` and ``reasoning_content``, everything the template sees is rebuilt
  from plain JSON types;
* ``tools`` and ``documents`` are always defined (``None`` when absent); kwargs override special tokens;
* ``continue_final_message`` cuts the render right after the final message's text.

Every failure surfaces as :class:`ChatTemplateError` so the server can answer 400 instead of crashing.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Mapping, Sequence
from datetime import datetime
from typing import Any

import jinja2
import jinja2.ext
import jinja2.meta
import jinja2.nodes
import jinja2.utils

from tokenization.template_sandbox import DEFAULT_LIMIT, TemplateSandbox, ValueTooLarge, value_limit

__all__ = ["ChatTemplate", "ChatTemplateError", "RenderTimeout", "REASONING_FIELDS"]

# Names a message's reasoning may arrive under; HF fills `thinking` and `reasoning_content` from the first present.
REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")
# Variables the renderer itself binds; a kwarg with one of these names would clash (HF fails with a TypeError).
_RESERVED_VARIABLES = frozenset({"messages", "tools", "documents", "add_generation_prompt"})
# HF appends this marker to the text being continued, renders, then cuts the output at the marker.
_CONTINUE_TAG = "CONTINUE_FINAL_MESSAGE_TAG "


class ChatTemplateError(Exception):
    """Any failure to compile or render a chat template, or an input the template contract rejects.

    ``raised_by_template`` is true when the template itself called ``raise_exception`` (e.g. "System role not
    supported"), i.e. the conversation is invalid for this model rather than the template being broken.

    ``limit`` names the bound a render ran into ("time", "output" or "value"), None otherwise.
    """

    def __init__(self, message: str, *, raised_by_template: bool = False, limit: str | None = None) -> None:
        super().__init__(message)
        self.raised_by_template = raised_by_template
        self.limit = limit


class RenderTimeout(Exception):
    """Raised (from a timer signal) inside a render that ran past its wall-time limit."""


class _TemplateRaised(jinja2.TemplateError):
    """What ``raise_exception`` throws; a TemplateError subclass, as HF raises a plain TemplateError."""


class _GenerationTag(jinja2.ext.Extension):
    """Parses ``{% generation %}...{% endgeneration %}`` and renders its body unchanged.

    HF uses the tag to compute assistant-token masks for training; for serving only the rendered text matters, but
    templates containing the tag must still compile.
    """

    tags = {"generation"}

    def parse(self, parser: Any) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_body", []), [], [], body).set_lineno(lineno)

    @staticmethod
    def _body(caller: Callable[[], str]) -> str:
        return caller()


class _Namespace(jinja2.utils.Namespace):
    """``namespace()`` that refuses ``_``-prefixed attribute names, which could reach CPython internals."""

    def __init__(*args: Any, **kwargs: Any) -> None:  # noqa: N805 - same signature trick as jinja2's Namespace
        self, rest = args[0], args[1:]
        attrs = dict(*rest, **kwargs)
        for name in attrs:
            _Namespace._check_name(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _Namespace._check_name(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check_name(name: Any) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(f"namespace attribute {name!r} may not start with an underscore")


class _DictFactory:
    """The template's ``dict``: only construction and ``fromkeys``, no access to the real type object."""

    def __call__(self, *args: Any, **kwargs: Any) -> dict:
        return dict(*args, **kwargs)

    def fromkeys(self, *args: Any, **kwargs: Any) -> dict:
        return dict.fromkeys(*args, **kwargs)


def _raise_exception(message: Any) -> None:
    raise _TemplateRaised(message)


def _tojson(value: Any, ensure_ascii: bool = False, indent: Any = None, separators: Any = None,
            sort_keys: bool = False) -> str:
    # Parameter order is part of the contract: templates may pass these positionally, as they would to HF's filter.
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _plain(value: Any) -> Any:
    """Deep-copy ``value`` into plain JSON types, as HF does before the template sees anything.

    The copy also lets rendering mark the final message without touching the caller's data; objects that are not
    JSON-like become an inert ``"<TypeName>"`` placeholder, as in HF.
    """
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, str):
        return str.__str__(value)
    if isinstance(value, int):
        return int.__int__(value)
    if isinstance(value, float):
        return float.__float__(value)
    if isinstance(value, Mapping):
        return {_plain(k): _plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_plain(v) for v in value]
    if isinstance(value, tuple):
        return tuple(_plain(v) for v in value)
    return f"<{type(value).__name__}>"


def _alias_reasoning(message: dict) -> dict:
    """Expose a message's reasoning as both ``thinking`` and ``reasoning_content`` (HF key order included)."""
    reasoning = next((message[k] for k in REASONING_FIELDS if message.get(k) is not None), None)
    if reasoning is None:
        return message
    return {"thinking": reasoning, **message, "reasoning_content": reasoning}


class ChatTemplate:
    """A chat template compiled once, rendered many times.

    ``origin`` is a caller-given label of where the source came from (``"checkpoint:tokenizer_config.json"``,
    ``"server-flag"``, ``"request"``...), used in logs and error messages. ``now`` is the clock behind
    ``strftime_now`` so tests can freeze the date.
    """

    def __init__(self, source: str, *, origin: str, now: Callable[[], datetime] = datetime.now) -> None:
        if not isinstance(source, str):
            raise ChatTemplateError(f"chat template ({origin}) must be a string, got {type(source).__name__}")
        self.source = source
        self.origin = origin
        self.sha256 = hashlib.sha256(source.encode("utf-8")).hexdigest()
        self._now = now
        env = TemplateSandbox(
            filters={"tojson": _tojson}, trim_blocks=True, lstrip_blocks=True,
            extensions=[_GenerationTag, jinja2.ext.loopcontrols],
        )
        env.globals["raise_exception"] = _raise_exception
        env.globals["strftime_now"] = self._strftime_now
        env.globals["dict"] = _DictFactory()
        env.globals["namespace"] = _Namespace
        try:
            self._template = env.from_string(source)
            undeclared = jinja2.meta.find_undeclared_variables(env.parse(source))
        except jinja2.TemplateError as exc:  # syntax errors, unknown tags/filters at compile time
            raise ChatTemplateError(f"invalid chat template ({origin}): {type(exc).__name__}: {exc}") from exc
        # Variables the template reads from its context, other than the globals supplied above (and jinja's own).
        self.declared_variables: frozenset[str] = frozenset(undeclared) - frozenset(env.globals)

    def __repr__(self) -> str:
        return f"ChatTemplate(origin={self.origin!r}, sha256={self.sha256[:12]}...)"

    def _strftime_now(self, fmt: str) -> str:
        return self._now().strftime(fmt)

    def render(
        self,
        messages: Sequence[Mapping[str, Any]],
        /,
        *,
        tools: Sequence[Mapping[str, Any]] | None = None,
        documents: Sequence[Mapping[str, Any]] | None = None,
        add_generation_prompt: bool = False,
        special_tokens: Mapping[str, str],
        continue_final_message: bool | str = False,
        max_output_bytes: int | None = None,
        **kwargs: Any,
    ) -> str:
        """Render ``messages`` exactly as ``apply_chat_template(..., tokenize=False)`` would.

        ``special_tokens`` is the tokenizer's ``special_tokens_map``; ``kwargs`` (chat_template_kwargs) override it.
        ``continue_final_message`` may be ``True`` (continue ``content``) or the name of the field to continue.
        ``max_output_bytes`` stops the render as soon as its UTF-8 output grows past that many bytes (a template's
        loops can otherwise build any amount of text); with ``continue_final_message`` it applies after the cut.
        No single value the template builds may pass it either (nor 16 MiB, whichever is more): sized before it
        is built, since one allocation in C cannot be interrupted.
        Raises :class:`ChatTemplateError` for anything that goes wrong.
        """
        if not messages:
            raise ChatTemplateError("cannot apply a chat template to an empty conversation")
        if continue_final_message and add_generation_prompt:
            raise ChatTemplateError("continue_final_message and add_generation_prompt cannot both be set")
        clashing = _RESERVED_VARIABLES & kwargs.keys()
        if clashing:
            raise ChatTemplateError(f"chat template kwargs may not override {sorted(clashing)}")
        for what, items in (("messages", messages), ("tools", tools or ()), ("documents", documents or ())):
            for item in items:
                if not isinstance(item, Mapping):
                    raise ChatTemplateError(f"chat {what} must be objects, got {type(item).__name__}")

        # Drop top-level None-valued keys first (so `content: null` reads as undefined), then rebuild as plain data.
        chat = [_alias_reasoning(_plain({k: v for k, v in m.items() if v is not None})) for m in messages]
        context = _plain({**special_tokens, **kwargs})
        try:
            final_text = self._mark_final_message(chat, continue_final_message) if continue_final_message else None
            with value_limit(max(max_output_bytes or 0, DEFAULT_LIMIT)):
                pieces = self._template.generate(
                    messages=chat, tools=_plain(tools), documents=_plain(documents),
                    add_generation_prompt=add_generation_prompt, **context,
                )
                rendered = self._collect(pieces, None if final_text is not None else max_output_bytes)
            if final_text is not None:
                rendered = self._cut_after_final_message(rendered, final_text)
                if max_output_bytes is not None and len(rendered.encode("utf-8")) > max_output_bytes:
                    raise self._too_long(max_output_bytes)
        except ChatTemplateError:
            raise
        except RenderTimeout as exc:
            raise ChatTemplateError(f"chat template ({self.origin}) {exc}", limit="time") from exc
        except ValueTooLarge as exc:
            raise ChatTemplateError(f"chat template ({self.origin}): {exc}", limit="value") from exc
        except _TemplateRaised as exc:
            raise ChatTemplateError(f"chat template error: {exc.message}", raised_by_template=True) from exc
        except Exception as exc:  # the template is untrusted code: TypeError, UndefinedError, SecurityError, ...
            raise ChatTemplateError(f"chat template failed to render: {type(exc).__name__}: {exc}") from exc
        return rendered

    def _too_long(self, max_output_bytes: int) -> ChatTemplateError:
        return ChatTemplateError(f"chat template ({self.origin}) rendered more than {max_output_bytes} bytes",
                                 limit="output")

    def _collect(self, pieces: Any, max_output_bytes: int | None) -> str:
        if max_output_bytes is None:
            return "".join(pieces)
        out: list[str] = []
        size = 0
        for piece in pieces:
            size += len(piece) if piece.isascii() else len(piece.encode("utf-8"))
            if size > max_output_bytes:
                pieces.close()
                raise self._too_long(max_output_bytes)
            out.append(piece)
        return "".join(out)

    def _mark_final_message(self, chat: list[dict], continue_final_message: bool | str) -> str:
        """Append the continue marker to the text being continued; return that text (before the marker)."""
        field = continue_final_message if isinstance(continue_final_message, str) else "content"
        final = chat[-1].get(field)
        if final is None:
            raise ChatTemplateError(f'continue_final_message is set but the final message has no "{field}"')
        fields = [field]
        if field in REASONING_FIELDS:  # reasoning is aliased under several names: mark every copy
            fields = [f for f in REASONING_FIELDS if chat[-1].get(f) == final]
        if not any(f in self.source for f in fields):
            raise ChatTemplateError(f'continue_final_message: the chat template never reads "{field}"')
        if isinstance(final, (list, tuple)):  # content parts: continue the last text part
            for part in reversed(final):
                if isinstance(part, dict) and "text" in part:
                    text = part["text"]
                    part["text"] = text + _CONTINUE_TAG
                    return text
            raise ChatTemplateError("continue_final_message: the final message has no text part to continue")
        for f in fields:
            chat[-1][f] = chat[-1][f] + _CONTINUE_TAG
        return final

    @staticmethod
    def _cut_after_final_message(rendered: str, final_text: str) -> str:
        marker = _CONTINUE_TAG.strip()
        if final_text.strip() not in rendered or marker not in rendered:
            raise ChatTemplateError(
                "continue_final_message: the chat template dropped part of the final message, so it cannot be continued"
            )
        at = rendered.rindex(marker)
        if rendered[at:at + len(_CONTINUE_TAG)] == _CONTINUE_TAG:
            return rendered[:at]
        return rendered[:at].rstrip()  # the template trimmed the message's trailing whitespace
