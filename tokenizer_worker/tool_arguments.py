"""Earlier assistant turns' tool-call arguments, in the form the chat template reads.

OpenAI clients send ``tool_calls[].function.arguments`` back as the JSON text the API
returned. Templates written for transformers' convention (Qwen2.5, Llama 3.x, Mistral,
Hermes, Qwen3) read an object: they write it with ``| tojson`` (a string would come out
JSON-encoded twice) or walk its items; vLLM parses the text first for them. A few templates
(DeepSeek R1 and V3.1) concatenate it as text, where an object would fail the render. So,
as for message content (content_format.py), the template's syntax tree decides: arguments
it only ever prints or concatenates stay text; otherwise the text becomes the object it
encodes, and text that encodes no JSON object is a 400 naming its path.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any, Literal

import jinja2
import jinja2.nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment

ArgumentsFormat = Literal["object", "text"]
_OBJECT_FILTERS = frozenset({"tojson", "items", "dictsort"})


class ArgumentsError(ValueError):
    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


def _reads_arguments(node: jinja2.nodes.Node) -> bool:
    if isinstance(node, jinja2.nodes.Getattr):
        return node.attr == "arguments"
    if isinstance(node, jinja2.nodes.Getitem):
        return isinstance(node.arg, jinja2.nodes.Const) and node.arg.value == "arguments"
    return False


def _uses(node: jinja2.nodes.Node, parent: jinja2.nodes.Node | None
          ) -> Iterator[ArgumentsFormat | None]:
    """How each read of ``arguments`` uses the value: as an object, as text, or neither
    (a test such as ``is string``, an assignment)."""
    if _reads_arguments(node):
        if isinstance(parent, jinja2.nodes.Filter) and parent.node is node:
            yield "object" if parent.name in _OBJECT_FILTERS else None
        elif isinstance(parent, (jinja2.nodes.Getattr, jinja2.nodes.Getitem)) and \
                parent.node is node:
            yield "object"  # arguments.city, arguments['city'], arguments.items()
        elif isinstance(parent, (jinja2.nodes.Add, jinja2.nodes.Concat, jinja2.nodes.Output)):
            yield "text"
        else:
            yield None
    for child in node.iter_child_nodes():
        yield from _uses(child, node)


def detect_arguments_format(source: str) -> ArgumentsFormat:
    """"text" when the template prints or concatenates tool-call arguments and never reads
    them as an object; "object" otherwise (transformers' convention, and vLLM's)."""
    try:
        tree = ImmutableSandboxedEnvironment(extensions=["jinja2.ext.loopcontrols"]).parse(source)
    except jinja2.TemplateError:
        return "object"  # unparsable templates fail later, with their own error
    uses = set(_uses(tree, None))
    return "text" if "text" in uses and "object" not in uses else "object"


def _as_object(arguments: Any, param: str) -> Any:
    if not isinstance(arguments, str):
        return arguments
    if not arguments.strip():
        return {}  # a function without parameters, sent back as ""
    try:
        value = json.loads(arguments)
    except ValueError as err:
        raise ArgumentsError(f"`{param}` is not JSON ({err}); tool-call arguments are the "
                             "JSON text of an object, as the API returned them", param) from None
    if not isinstance(value, dict):
        raise ArgumentsError(f"`{param}` must encode a JSON object, not "
                             f"{type(value).__name__}", param)
    return value


def arguments_as_objects(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """``messages`` with every tool call's arguments decoded into the object they encode
    (copies where they change; the caller's messages are left as they are)."""
    out = []
    for i, message in enumerate(messages):
        calls = message.get("tool_calls")
        if isinstance(calls, list) and any(
                isinstance(c, dict) and isinstance((c.get("function") or {}).get("arguments"), str)
                for c in calls):
            fixed = []
            for j, call in enumerate(calls):
                function = call.get("function") if isinstance(call, dict) else None
                if isinstance(function, dict) and "arguments" in function:
                    param = f"messages[{i}].tool_calls[{j}].function.arguments"
                    call = {**call, "function": {
                        **function, "arguments": _as_object(function["arguments"], param)}}
                fixed.append(call)
            message = {**message, "tool_calls": fixed}
        out.append(message)
    return out
