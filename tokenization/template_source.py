"""Where a server-wide chat template comes from: ``--chat-template`` is a file path or the
template itself (vLLM's rule: an existing file is read; otherwise a value that contains
template syntax is used inline). Checked once before any process starts."""

from __future__ import annotations

from pathlib import Path

from tokenization.chat_template import ChatTemplate, ChatTemplateError

__all__ = ["load_server_template"]

_TEMPLATE_CHARS = ("{{", "{%", "{#", "\n")


def load_server_template(value: str, max_bytes: int) -> ChatTemplate:
    """The compiled template, or ChatTemplateError in one line saying what is wrong."""
    path = Path(value).expanduser()
    try:
        is_file = path.is_file()
    except OSError:  # a long inline template is not a valid file name
        is_file = False
    if is_file:
        size = path.stat().st_size
        if size > max_bytes:
            raise ChatTemplateError(f"--chat-template {path} is {size} bytes, more than "
                                    f"limits.max_template_bytes ({max_bytes})")
        try:
            source = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as err:
            raise ChatTemplateError(f"--chat-template {path} cannot be read: {err}") from None
        origin = f"server-flag:{path.name}"
    elif any(mark in value for mark in _TEMPLATE_CHARS):
        source, origin = value, "server-flag:inline"
        size = len(source.encode("utf-8"))
        if size > max_bytes:
            raise ChatTemplateError(f"--chat-template (inline) is {size} bytes, more than "
                                    f"limits.max_template_bytes ({max_bytes})")
    else:
        raise ChatTemplateError(f"--chat-template {value!r} is neither an existing file nor a "
                                "template (no '{{' or '{%' in it)")
    return ChatTemplate(source, origin=origin)
