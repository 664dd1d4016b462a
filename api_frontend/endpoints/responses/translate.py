"""A ``/v1/responses`` request as the chat request the existing pipeline runs.

The conversation (the previous response's input items and output, then this request's
``input``) becomes chat ``messages`` (``instructions`` first, as a system message, never
carried over from the previous response); function tools, ``tool_choice`` and
``text.format`` become their chat twins; the other chat fields pass through under the
same names (``fields.PASSTHROUGH``, derived from the chat table). Template rendering,
tool-call parsing, grammars, the reasoning parser and the ``candor`` report are then
chat's own. What the chat pipeline checks it reports under chat's names;
``responses_name`` turns those back into this request's fields.
"""

from __future__ import annotations

import re
import uuid
from dataclasses import dataclass, field
from collections.abc import Collection
from typing import Any

import msgspec

from api_frontend.endpoints.responses.fields import PASSTHROUGH
from api_frontend.errors import ApiError, from_decode_error
from api_frontend.image_names import ImageNames
from cluster.topology import RequestLimits
from protocol.openai_api import ChatCompletionRequest, FieldNote
from protocol.responses_api import (ITEM_TYPES, FunctionCallItem, FunctionCallOutputItem,
                                    InputImage, Item, MessageItem, ReasoningItem, Refusal,
                                    ResponsesRequest, StoredResponse, TextFormatJsonObject,
                                    TextFormatJsonSchema)

TEXT_PARTS = ("input_text", "output_text", "refusal")
IMAGE_PARTS = (*TEXT_PARTS, "input_image")  # a model that takes images
OUTPUT_IMAGE_PARTS = ("input_text", "input_image")  # a function call's output, likewise
METADATA_MAX_KEYS, METADATA_KEY_CHARS, METADATA_VALUE_CHARS = 16, 64, 512  # OpenAI's bounds
_ID_PREFIX = {"message": "msg", "function_call": "fc", "function_call_output": "fco",
              "reasoning": "rs"}


def item_id(kind: str) -> str:
    return f"{_ID_PREFIX[kind]}_{uuid.uuid4().hex}"


@dataclass
class ChatPlan:
    """The chat request to run, the fields it was built from (chat's names, for its
    report's defaults), the whole conversation as items, and notes for the report."""

    chat: ChatCompletionRequest
    chat_keys: list[str]
    items: list[Item]
    notes: list[FieldNote] = field(default_factory=list)
    images: ImageNames = field(default_factory=ImageNames)  # chat's image paths -> input's


def _error(message: str, param: str, code: str = "invalid_value") -> ApiError:
    return ApiError(400, message, param, code)


def _convert(obj: dict[str, Any], kind: type, where: str):
    try:
        return msgspec.convert(obj, kind)
    except msgspec.ValidationError as err:
        inner = from_decode_error(err)
        param = f"{where}.{inner.param}" if inner.param else where
        raise _error(f"`{where}`: {err}", param) from None


def _check_parts(parts: Any, allowed: tuple[str, ...], where: str) -> None:
    if not isinstance(parts, list):
        return
    for j, part in enumerate(parts):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in allowed:
            model = "model" if "input_image" in allowed else "text-only model"
            raise _error(f"content part type {kind!r} is not supported by this {model} "
                         f"(only {', '.join(allowed)} parts are)",
                         f"{where}[{j}].type", "unsupported_content")
        if kind == "input_image" and not isinstance(part.get("image_url"), str):
            why = ("a file_id names OpenAI's Files API, which this deployment does not serve"
                   if part.get("file_id") is not None else "it has no image_url")
            raise _error(f"an input_image needs `image_url` (a data: URL, or an http(s) URL "
                         f"on a host this deployment allows): {why}",
                         f"{where}[{j}].image_url", "invalid_value")


def input_items(raw: str | list[dict[str, Any]], limits: RequestLimits,
                vision: bool = False) -> list[Item]:
    """``input`` as typed items with ids (a string is one user message); a 400 naming
    ``input[i]...`` for an item Candor cannot take (``vision``: the model takes images,
    so ``input_image`` parts are taken)."""
    if isinstance(raw, str):
        return [MessageItem(role="user", content=raw, id=item_id("message"))]
    if not raw:
        raise _error("`input` must not be empty", "input")
    if len(raw) > limits.max_messages:
        raise _error(f"`input` has {len(raw)} items; this deployment allows at most "
                     f"{limits.max_messages} (max_messages)", "input", "limit_exceeded")
    out: list[Item] = []
    for i, obj in enumerate(raw):
        where = f"input[{i}]"
        kind = obj.get("type", "message")
        cls = ITEM_TYPES.get(kind) if isinstance(kind, str) else None
        if cls is None:
            raise _error(f"input item type {kind!r} is not supported (Candor takes "
                         f"{', '.join(ITEM_TYPES)} items; built-in tool calls and "
                         "item_reference are not served)", f"{where}.type",
                         "unsupported_field")
        if kind == "message":
            _check_parts(obj.get("content"), IMAGE_PARTS if vision else TEXT_PARTS,
                         f"{where}.content")
        elif kind == "function_call_output":
            _check_parts(obj.get("output"), OUTPUT_IMAGE_PARTS if vision else ("input_text",),
                         f"{where}.output")
        item = _convert({**obj, "type": kind}, cls, where)
        if item.id is None:
            item.id = item_id(kind)
        out.append(item)
    return out


def _part(p) -> dict[str, Any]:
    if isinstance(p, InputImage):
        return {"type": "image_url", "image_url": {"url": p.image_url}}
    return {"type": "text", "text": p.refusal if isinstance(p, Refusal) else p.text}


def _text(content: str | list) -> str | list[dict[str, Any]]:
    if isinstance(content, str):
        return content
    return [_part(p) for p in content]


def _tool_output(output: str | list) -> str | list[dict[str, Any]]:
    """A function call's output as a chat tool message's content: text parts joined into
    one string; with images, chat's parts in order (as a chat tool message with images)."""
    if isinstance(output, str):
        return output
    if any(isinstance(p, InputImage) for p in output):
        return _text(output)
    return "".join(p.text for p in output)


def _image_paths(items: list[Item], skipped: int) -> list[str]:
    """``input[i].content[j]`` (``input[i].output[j]``: a function call's output) of each
    input_image of this request's own items (the last ones; ``skipped``: the previous
    response's, which come first), in order."""
    out = []
    for i, item in enumerate(items[skipped:]):
        if isinstance(item, MessageItem) and isinstance(item.content, list):
            out += [f"input[{i}].content[{j}]" for j, p in enumerate(item.content)
                    if isinstance(p, InputImage)]
        elif isinstance(item, FunctionCallOutputItem) and isinstance(item.output, list):
            out += [f"input[{i}].output[{j}]" for j, p in enumerate(item.output)
                    if isinstance(p, InputImage)]
    return out


def chat_messages(instructions: str | None, items: list[Item]) -> list[dict[str, Any]]:
    """The conversation as chat messages. A reasoning item opens an assistant turn (its
    text as ``reasoning_content``, which templates that keep reasoning render); the
    assistant text and function calls after it, and consecutive calls, join that turn."""
    out: list[dict[str, Any]] = []
    if instructions is not None:
        out.append({"role": "system", "content": instructions})
    for item in items:
        last = out[-1] if out and out[-1]["role"] == "assistant" else None
        if isinstance(item, ReasoningItem):
            thought = [p.text for p in item.content] or [p.text for p in item.summary]
            out.append({"role": "assistant", "content": "",
                        "reasoning_content": "".join(thought)})
        elif isinstance(item, FunctionCallOutputItem):
            out.append({"role": "tool", "tool_call_id": item.call_id,
                        "content": _tool_output(item.output)})
        elif isinstance(item, FunctionCallItem):
            call = {"id": item.call_id, "type": "function",
                    "function": {"name": item.name, "arguments": item.arguments}}
            if last is not None:
                last.setdefault("tool_calls", []).append(call)
            else:
                out.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif (item.role == "assistant" and last is not None and "reasoning_content" in last
              and not last["content"] and "tool_calls" not in last):
            last["content"] = _text(item.content)  # the answer after its reasoning
        else:
            out.append({"role": item.role, "content": _text(item.content)})
    return out


def chat_tools(tools: list[Any] | None) -> list[dict[str, Any]] | None:
    """Responses' flat function tools as chat tools; a built-in tool is a 400 naming it."""
    if tools is None:
        return None
    out = []
    for i, tool in enumerate(tools):
        kind = tool.get("type")
        if kind != "function":
            raise _error(f"`tools[{i}].type` is {kind!r}: Candor serves function tools only "
                         "(built-in tools such as web_search, file_search, computer use, "
                         "code_interpreter, image_generation, mcp or custom tools are not "
                         "available)", f"tools[{i}].type", "unsupported_field")
        out.append({"type": "function", "function": {
            k: tool[k] for k in ("name", "description", "parameters", "strict") if k in tool}})
    return out


def chat_tool_choice(choice: str | dict[str, Any] | None) -> str | dict[str, Any] | None:
    if choice is None or isinstance(choice, str):
        return choice
    kind = choice.get("type")
    if kind == "function":
        if "name" not in choice:
            raise _error("`tool_choice.name` is required", "tool_choice.name")
        return {"type": "function", "function": {"name": choice["name"]}}
    raise _error(f"`tool_choice.type` {kind!r} is not supported (Candor takes 'none', 'auto', "
                 "'required' or {'type': 'function', 'name': ...}; allowed_tools and "
                 "built-in tool choices are not available)", "tool_choice.type",
                 "unsupported_field")


def _forces_calls(choice: Any) -> bool:
    return choice == "required" or isinstance(choice, dict)


def _response_format(req: ResponsesRequest, notes: list[FieldNote]) -> dict | None:
    fmt = req.text.format if req.text is not None else None
    if isinstance(fmt, TextFormatJsonSchema):
        rf = {"type": "json_schema", "json_schema": {"name": fmt.name, "schema": fmt.schema}}
    elif isinstance(fmt, TextFormatJsonObject):
        rf = {"type": "json_object"}
    else:
        return None
    if req.tools is not None and _forces_calls(req.tool_choice):
        # the reply is tool calls only (constrained): there is no text to format
        notes.append(FieldNote("text.format", "tool_choice forces tool calls, so this reply "
                               "has no text for the format to constrain"))
        return None
    return rf


def check_metadata(metadata: dict[str, str] | None) -> None:
    if metadata is None:
        return
    if len(metadata) > METADATA_MAX_KEYS:
        raise _error(f"`metadata` has {len(metadata)} keys; at most {METADATA_MAX_KEYS}",
                     "metadata", "limit_exceeded")
    for key, value in metadata.items():
        if len(key) > METADATA_KEY_CHARS or len(value) > METADATA_VALUE_CHARS:
            raise _error(f"`metadata` keys are at most {METADATA_KEY_CHARS} characters and "
                         f"values at most {METADATA_VALUE_CHARS}", f"metadata.{key[:64]}",
                         "limit_exceeded")


def check_unbuilt_values(req: ResponsesRequest) -> None:
    """Values of fields Candor has whose other values it does not build: 400 naming them."""
    for i, value in enumerate(req.include or []):
        raise _error(f"`include` value {value!r} is not supported: Candor returns no "
                     "logprobs, encrypted reasoning or built-in tool outputs on "
                     "/v1/responses (reasoning text comes back in the reasoning item's "
                     "`content`)", f"include[{i}]", "unsupported_field")
    if req.truncation == "auto":
        raise _error("`truncation: auto` (dropping the conversation's oldest items to fit the "
                     "context) is not implemented; a conversation that does not fit is a 400 "
                     "naming the token counts", "truncation", "unsupported_field")
    if req.stream_options is not None and not req.stream:
        raise _error("`stream_options` is only allowed when `stream` is true",
                     "stream_options")


def to_chat(req: ResponsesRequest, sent: Collection[str], previous: StoredResponse | None,
            limits: RequestLimits, vision: bool = False) -> ChatPlan:
    """``sent``: the fields the body had; ``previous``: the response it continues;
    ``vision``: the model takes images."""
    check_unbuilt_values(req)
    check_metadata(req.metadata)
    items = input_items(req.input, limits, vision)
    own = len(items)
    if previous is not None:
        items = previous.input_items + previous.response.output + items
        if len(items) > limits.max_messages:
            raise _error(f"the conversation has {len(items)} items with the previous "
                         f"response's; this deployment allows at most {limits.max_messages} "
                         "(max_messages)", "input", "limit_exceeded")
    notes: list[FieldNote] = []
    chat: dict[str, Any] = {"model": req.model,
                            "messages": chat_messages(req.instructions, items)}
    chat.update({name: getattr(req, name) for name in PASSTHROUGH if name in sent})
    if req.max_output_tokens is not None:
        chat["max_completion_tokens"] = req.max_output_tokens
    tools = chat_tools(req.tools)
    if tools is not None:
        chat["tools"] = tools
    choice = chat_tool_choice(req.tool_choice)
    if choice is not None:
        chat["tool_choice"] = choice
    rf = _response_format(req, notes)
    if rf is not None:
        chat["response_format"] = rf
    try:
        parsed = msgspec.convert(chat, ChatCompletionRequest)
    except msgspec.ValidationError as err:
        raise responses_name(from_decode_error(err)) from None
    mine = _image_paths(items, len(items) - own)
    # an image of the conversation before (already served once) is named by what brought it
    earlier = ["previous_response_id"] * (len(_image_paths(items, 0)) - len(mine))
    images = ImageNames.of(chat["messages"], earlier + mine, url_field=".image_url")
    return ChatPlan(parsed, list(chat), items, notes, images)


# chat's names for what this request calls otherwise (longest first)
_RENAMES = ((re.compile(r"^response_format\.json_schema\.schema"), "text.format.schema"),
            (re.compile(r"^response_format\.type"), "text.format.type"),
            (re.compile(r"^response_format"), "text.format"),
            (re.compile(r"^max_completion_tokens|^max_tokens"), "max_output_tokens"),
            (re.compile(r"^tools\[(\d+)\]\.function\."), r"tools[\1]."),
            (re.compile(r"^tools\[(\d+)\]\.function$"), r"tools[\1]"),
            (re.compile(r"^tool_choice\.function\.name"), "tool_choice.name"),
            (re.compile(r"^messages.*"), "input"))  # a message is not an item: the whole


def responses_name(err: ApiError, images: ImageNames | None = None) -> ApiError:
    """A chat-pipeline error under the names this request used (``param`` and the
    backquoted names in the message); about an image: its ``input[i].content[j]``."""
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
