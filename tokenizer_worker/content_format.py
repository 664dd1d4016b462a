"""Does a chat template read message content as a string or as a list of parts?

Many real templates only handle ``content`` as a string (``message['content'] | trim``) and
would render a list of parts as its Python repr. Like vLLM's content-format detection, we
look at the template's syntax tree: if some ``{% for %}`` loop iterates over a message's
``content`` (``message['content']``, ``message.content``, or a variable named ``content``,
e.g. a macro argument), the template takes parts ("openai" format); otherwise list content
is flattened to its text parts joined by "\\n" before rendering ("string" format).
"""

from __future__ import annotations

from typing import Any, Literal

import jinja2
import jinja2.nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment

ContentFormat = Literal["string", "openai"]


def _iterates_content(node: jinja2.nodes.Node) -> bool:
    while isinstance(node, jinja2.nodes.Filter):  # e.g. `message.content | list`
        node = node.node
    if isinstance(node, jinja2.nodes.Getitem):
        return isinstance(node.arg, jinja2.nodes.Const) and node.arg.value == "content"
    if isinstance(node, jinja2.nodes.Getattr):
        return node.attr == "content"
    if isinstance(node, jinja2.nodes.Name):
        return node.name == "content"
    return False


def detect_content_format(source: str) -> ContentFormat:
    try:
        tree = ImmutableSandboxedEnvironment(extensions=["jinja2.ext.loopcontrols"]).parse(source)
    except jinja2.TemplateError:
        return "string"  # unparsable templates fail later, with their own error
    for loop in tree.find_all(jinja2.nodes.For):
        if _iterates_content(loop.iter):
            return "openai"
    return "string"


def flatten_content(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Messages with list content turned into one string (text parts joined by "\\n")."""
    out = []
    for m in messages:
        content = m.get("content")
        if isinstance(content, list):
            m = {**m, "content": "\n".join(p.get("text") or "" for p in content
                                           if isinstance(p, dict) and p.get("type") == "text")}
        out.append(m)
    return out
