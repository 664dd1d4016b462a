"""A ``/v1/messages`` request as the chat request the existing pipeline runs.

``system`` becomes the first message; a user turn's ``tool_result`` blocks become ``tool``
messages (in the order the blocks have them, text between them a user message); an
assistant turn's ``text`` is its content, its ``thinking`` its ``reasoning_content`` and
its ``tool_use`` blocks its ``tool_calls``. Tools, ``tool_choice``, ``stop_sequences``
and ``thinking`` (the chat template's thinking switch) become their chat twins. Template
rendering, tool-call parsing, grammars and the reasoning parser are then chat's own; what
the chat pipeline checks it reports under chat's names, and ``messages_name`` turns
those back into this request's fields.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any

import msgspec

from api_frontend import reasoning
from api_frontend.errors import ApiError, from_decode_error
from api_frontend.image_names import ImageNames
from cluster.topology import ApiSpec
from protocol.anthropic_api import (UNREADABLE, CountTokensRequest, ImageBlock, MessagesRequest,
                                    RedactedThinkingBlock, TextBlock, ThinkingBlock,
                                    ThinkingDisabled, ToolChoiceAny, ToolChoiceNone,
                                    ToolChoiceTool, ToolResultBlock, ToolUseBlock)
from protocol.openai_api import ChatCompletionRequest, FieldNote

CLIENT_TOOL_TYPES = (None, "custom")


@dataclass
class ChatPlan:
    """The chat request to run, the fields it was built from (chat's names, for its
    report's defaults), and notes for the report."""

    chat: ChatCompletionRequest
    chat_keys: list[str]
    notes: list[FieldNote] = field(default_factory=list)
    images: ImageNames = field(default_factory=ImageNames)  # chat's image paths -> blocks'


def _error(message: str, param: str, code: str = "invalid_value") -> ApiError:
    return ApiError(400, message, param, code)


def _text_parts(blocks: list[TextBlock]) -> list[dict[str, str]]:
    return [{"type": "text", "text": b.text} for b in blocks]


def _tool_result_content(block: ToolResultBlock, where: str, vision: bool,
                         images: list[str] | None) -> str | list[dict[str, Any]]:
    """A tool_result's content as the tool message's: its text blocks joined by newlines;
    on a model that takes images, its image blocks as chat's image parts in place (the
    text runs between them joined likewise), so the chat template renders each image
    where the result holds it."""
    if isinstance(block.content, str):
        return block.content
    parts: list[dict[str, Any]] = []
    texts: list[str] = []
    for j, part in enumerate(block.content):
        at = f"{where}.content[{j}]"
        if vision and part.get("type") == "image":
            if texts:
                parts.append({"type": "text", "text": "\n".join(texts)})
                texts = []
            parts.append(_image_part(part.get("source"), at))
            if images is not None:
                images.append(at)
            continue
        if part.get("type") != "text" or not isinstance(part.get("text"), str):
            why = (f"a tool_result holds text and image blocks, not {part.get('type')!r}"
                   if vision else
                   "only text blocks can be read in a tool_result by this text-only model")
            raise _error(f"`{at}`: {why}", f"{at}.type", "unsupported_content")
        texts.append(part["text"])
    if not parts:
        return "\n".join(texts)
    if texts:
        parts.append({"type": "text", "text": "\n".join(texts)})
    return parts


def _refuse_unreadable(block: Any, where: str) -> None:
    if isinstance(block, UNREADABLE):
        kind = type(block).__struct_config__.tag
        raise _error(f"content block type {kind!r} is not supported by this text-only model "
                     "(text, tool_use, tool_result and thinking blocks are)", f"{where}.type",
                     "unsupported_content")


def _image_part(source: Any, at: str) -> dict[str, Any]:
    """An image block's ``source`` as chat's ``image_url`` part: ``base64`` as a data: URL,
    ``url`` as itself (an http(s) URL, fetched if the deployment allows its host)."""
    source = source if isinstance(source, dict) else {}
    kind = source.get("type")
    if kind == "url":
        url = source.get("url")
        if not isinstance(url, str):
            raise _error("an image block's url source needs `url` (a string)",
                         f"{at}.source.url")
        return {"type": "image_url", "image_url": {"url": url}}
    media, data = source.get("media_type"), source.get("data")
    if kind != "base64" or not isinstance(media, str) or not isinstance(data, str):
        raise _error("an image block needs `source: {\"type\": \"base64\", \"media_type\": "
                     "\"image/png\", \"data\": ...}` or `source: {\"type\": \"url\", "
                     "\"url\": ...}`", f"{at}.source")
    return {"type": "image_url", "image_url": {"url": f"data:{media};base64,{data}"}}


def _user_turn(blocks: list, where: str, vision: bool = False,
               images: list[str] | None = None) -> list[dict[str, Any]]:
    """``images``: where each image block taken sits, appended in order."""
    out: list[dict[str, Any]] = []
    parts: list[dict[str, Any]] = []
    for j, block in enumerate(blocks):
        at = f"{where}[{j}]"
        if vision and isinstance(block, ImageBlock):
            parts.append(_image_part(block.source, at))
            if images is not None:
                images.append(at)
            continue
        _refuse_unreadable(block, at)
        if isinstance(block, TextBlock):
            parts.append({"type": "text", "text": block.text})
        elif isinstance(block, ToolResultBlock):
            if parts:
                out.append({"role": "user", "content": parts})
                parts = []
            out.append({"role": "tool", "tool_call_id": block.tool_use_id,
                        "content": _tool_result_content(block, at, vision, images)})
        else:
            kind = type(block).__struct_config__.tag
            raise _error(f"a user turn cannot hold a {kind!r} block (those are the "
                         "assistant's)", f"{at}.type")
    if parts or not out:
        out.append({"role": "user", "content": parts})
    return out


def _assistant_turn(blocks: list, where: str, notes: list[FieldNote]) -> dict[str, Any]:
    text, thought, calls = [], [], []
    for j, block in enumerate(blocks):
        at = f"{where}[{j}]"
        _refuse_unreadable(block, at)
        if isinstance(block, TextBlock):
            text.append(block.text)
        elif isinstance(block, ThinkingBlock):
            thought.append(block.thinking)
        elif isinstance(block, RedactedThinkingBlock):
            notes.append(FieldNote(f"{at}", "redacted_thinking is encrypted by another "
                                   "service; Candor cannot read it, so it is not in the prompt"))
        elif isinstance(block, ToolUseBlock):
            calls.append({"id": block.id, "type": "function", "function": {
                "name": block.name, "arguments": json.dumps(block.input)}})
        else:
            raise _error("an assistant turn cannot hold a 'tool_result' block (results go "
                         "in the next user turn)", f"{at}.type")
    message: dict[str, Any] = {"role": "assistant", "content": "".join(text) if text or
                               not calls else None}
    if thought:
        message["reasoning_content"] = "".join(thought)
    if calls:
        message["tool_calls"] = calls
    return message


def chat_messages(req: CountTokensRequest, notes: list[FieldNote], vision: bool = False,
                  images: list[str] | None = None) -> list[dict[str, Any]]:
    """``system`` then every turn, as chat messages (``vision``: the model takes images;
    ``images`` collects where each image block sits)."""
    if not req.messages:
        raise _error("`messages` must contain at least one message", "messages")
    out: list[dict[str, Any]] = []
    if isinstance(req.system, str):
        out.append({"role": "system", "content": req.system})
    elif req.system:
        out.append({"role": "system", "content": _text_parts(req.system)})
    for i, message in enumerate(req.messages):
        where = f"messages[{i}].content"
        content = message.content
        if isinstance(content, str):
            out.append({"role": message.role, "content": content})
        elif message.role == "user":
            out.extend(_user_turn(content, where, vision, images))
        else:
            out.append(_assistant_turn(content, where, notes))
    return out


def chat_tools(req: CountTokensRequest) -> list[dict[str, Any]] | None:
    """Client tools as chat function tools; a server tool is a 400 naming it."""
    if req.tools is None:
        return None
    out = []
    for i, tool in enumerate(req.tools):
        if tool.type not in CLIENT_TOOL_TYPES:
            raise _error(f"`tools[{i}].type` is {tool.type!r}: Candor serves client tools "
                         "only (Anthropic's server tools such as web search, bash, text "
                         "editor, computer use or code execution are not available)",
                         f"tools[{i}].type", "unsupported_field")
        if tool.input_schema is None:
            raise _error(f"`tools[{i}].input_schema` is required", f"tools[{i}].input_schema")
        function: dict[str, Any] = {"name": tool.name, "parameters": tool.input_schema}
        if tool.description is not None:
            function["description"] = tool.description
        out.append({"type": "function", "function": function})
    return out


def chat_tool_choice(req: CountTokensRequest, chat: dict[str, Any]) -> None:
    """auto / any / tool / none as chat's auto / required / named / none;
    ``disable_parallel_tool_use`` as ``parallel_tool_calls: false``."""
    choice = req.tool_choice
    if choice is None or (req.tools is None and isinstance(choice, ToolChoiceNone)):
        return
    if req.tools is None:
        raise _error("`tool_choice` needs `tools`", "tool_choice")
    if isinstance(choice, ToolChoiceTool):
        chat["tool_choice"] = {"type": "function", "function": {"name": choice.name}}
    else:
        chat["tool_choice"] = ("required" if isinstance(choice, ToolChoiceAny) else
                               type(choice).__struct_config__.tag)
    if getattr(choice, "disable_parallel_tool_use", False):
        chat["parallel_tool_calls"] = False


def thinking_kwargs(req: CountTokensRequest, api: ApiSpec,
                    notes: list[FieldNote]) -> dict[str, bool]:
    """``thinking`` as the chat template's thinking switch of the deployment's reasoning
    parser (absent: the template's own default, as on chat)."""
    if req.thinking is None:
        return {}
    if api.reasoning_parser is None:
        notes.append(FieldNote("thinking", "this deployment splits no reasoning (start it "
                               "with --reasoning-parser); the chat template's default applies"))
        return {}
    switch = reasoning.get(api.reasoning_parser).switch
    return {switch: not isinstance(req.thinking, ThinkingDisabled)}


def to_chat(req: CountTokensRequest, api: ApiSpec, vision: bool = False) -> ChatPlan:
    notes: list[FieldNote] = []
    images: list[str] = []
    chat: dict[str, Any] = {"model": req.model,
                            "messages": chat_messages(req, notes, vision, images)}
    tools = chat_tools(req)
    if tools is not None:
        chat["tools"] = tools
    chat_tool_choice(req, chat)
    kwargs = thinking_kwargs(req, api, notes)
    if kwargs:
        chat["chat_template_kwargs"] = kwargs
    if isinstance(req, MessagesRequest):
        chat["max_tokens"] = req.max_tokens
        chat["stream"] = req.stream
        for name in ("temperature", "top_p", "top_k"):
            if getattr(req, name) is not None:
                chat[name] = getattr(req, name)
        if req.stop_sequences is not None:
            chat["stop"] = req.stop_sequences
        fmt = req.output_config.format if req.output_config is not None else None
        if fmt is not None:
            chat["response_format"] = {"type": "json_schema",
                                       "json_schema": {"name": "output", "schema": fmt.schema}}
    if req.strict:
        chat["strict"] = True
    try:
        parsed = msgspec.convert(chat, ChatCompletionRequest)
    except msgspec.ValidationError as err:
        raise messages_name(from_decode_error(err)) from None
    return ChatPlan(parsed, list(chat), notes,
                    ImageNames.of(chat["messages"], images, url_field=".source.url"))


# chat's names for what this request calls otherwise (longest first)
_RENAMES = ((re.compile(r"^tools\[(\d+)\]\.function\.parameters"), r"tools[\1].input_schema"),
            (re.compile(r"^tools\[(\d+)\]\.function\."), r"tools[\1]."),
            (re.compile(r"^tools\[(\d+)\]\.function$"), r"tools[\1]"),
            (re.compile(r"^tool_choice\.function\.name"), "tool_choice.name"),
            (re.compile(r"^parallel_tool_calls"), "tool_choice.disable_parallel_tool_use"),
            (re.compile(r"^stop$"), "stop_sequences"),
            (re.compile(r"^response_format\.json_schema\.schema"), "output_config.format.schema"),
            (re.compile(r"^response_format.*"), "output_config.format"),
            (re.compile(r"^chat_template_kwargs.*"), "thinking"),
            (re.compile(r"^messages.*"), "messages"))  # a chat message is not a turn: the whole


def messages_name(err: ApiError, images: ImageNames | None = None) -> ApiError:
    """A chat-pipeline error under the names this request used (``param`` and the
    backquoted names in the message); about an image: its ``messages[i].content[j]``."""
    param = err.param
    if param is None or (images is not None and images.rename(err)):
        return err
    for pattern, repl in _RENAMES:
        renamed = pattern.sub(repl, param)
        if renamed != param:
            err.message = err.message.replace(f"`{param}`", f"`{renamed}`")
            err.param = renamed
            break
    return err
