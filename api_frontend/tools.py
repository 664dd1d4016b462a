"""``tools`` / ``tool_choice`` / ``parallel_tool_calls``: validation and what each asks for.

- none: the tools still reach the template (the model knows them), nothing is parsed.
- auto: unconstrained generation, read afterwards by the deployment's tool-call parser
  (a 400 where the deployment has none, rather than calls arriving as ``content``).
- required / named: constrained decoding, so the arguments parse and validate whenever
  the reply finishes ``tool_calls`` (a stop or max_tokens may end it inside a call: then
  it finishes ``stop``/``length``): named makes the reply that function's arguments
  object; required makes it a JSON list of ``{"name", "parameters"}`` (one element when
  ``parallel_tool_calls`` is false).
"""

from __future__ import annotations

import json
import re
from typing import Any

import msgspec

from api_frontend import reasoning, tool_parsers
from api_frontend.errors import ApiError
from api_frontend.tool_parsers import NamedCallParser, RequiredCallsParser, ToolParser
from cluster.topology import ApiSpec
from protocol import ipc
from protocol.ipc import GuidedSpec
from protocol.openai_api import ChatCompletionRequest

_NAME = re.compile(r"^[A-Za-z0-9_.\-]{1,64}$")


class ToolPlan(msgspec.Struct):
    tools: list[dict[str, Any]] | None
    mode: str  # none | auto | required | named
    function: str | None = None
    parallel: bool = True
    guided: GuidedSpec | None = None
    parser_name: str | None = None

    def parser(self) -> ToolParser | None:
        """A fresh parser for one choice (None: the text is plain content)."""
        if self.mode == "named":
            return NamedCallParser(self.function)
        names = [t["function"]["name"] for t in self.tools or ()]
        if self.mode == "required":
            return RequiredCallsParser(names)
        if self.mode == "auto":
            return tool_parsers.get(self.parser_name, names)
        return None


def _check_tools(tools: list[Any]) -> dict[str, dict]:
    if not tools:
        raise ApiError(400, "`tools` must not be empty; omit it to send no tools", "tools",
                       "invalid_value")
    schemas: dict[str, dict] = {}
    for i, tool in enumerate(tools):
        where = f"tools[{i}]"
        if not isinstance(tool, dict) or tool.get("type", "function") != "function":
            raise ApiError(400, f"`{where}.type` must be 'function'", f"{where}.type",
                           "invalid_value")
        fn = tool.get("function")
        if not isinstance(fn, dict):
            raise ApiError(400, f"`{where}.function` is required", f"{where}.function",
                           "invalid_value")
        name = fn.get("name")
        if not isinstance(name, str) or not _NAME.match(name):
            raise ApiError(400, f"`{where}.function.name` must be 1-64 letters, digits, "
                           "'_', '.' or '-'", f"{where}.function.name", "invalid_value")
        if name in schemas:
            raise ApiError(400, f"`{where}.function.name` {name!r} is given twice",
                           f"{where}.function.name", "invalid_value")
        params = fn.get("parameters", {"type": "object", "properties": {}})
        if not isinstance(params, dict):
            raise ApiError(400, f"`{where}.function.parameters` must be a JSON schema object",
                           f"{where}.function.parameters", "invalid_value")
        schemas[name] = params
    return schemas


def _choice(choice: Any, schemas: dict[str, dict]) -> tuple[str, str | None]:
    if choice is None or choice in ("none", "auto", "required"):
        return choice or "auto", None
    if isinstance(choice, dict) and choice.get("type", "function") == "function":
        fn = choice.get("function")
        name = fn.get("name") if isinstance(fn, dict) else None
        if not isinstance(name, str):
            raise ApiError(400, "`tool_choice.function.name` is required",
                           "tool_choice.function.name", "invalid_value")
        if name not in schemas:
            raise ApiError(400, f"`tool_choice` names {name!r}, which is not in `tools` "
                           f"({sorted(schemas)})", "tool_choice", "invalid_value")
        return "named", name
    raise ApiError(400, "`tool_choice` must be 'none', 'auto', 'required' or "
                   "{'type': 'function', 'function': {'name': ...}}", "tool_choice",
                   "invalid_value")


def _required_schema(schemas: dict[str, dict], parallel: bool) -> dict:
    calls = [{"type": "object", "properties": {"name": {"const": name}, "parameters": params},
              "required": ["name", "parameters"], "additionalProperties": False}
             for name, params in schemas.items()]
    schema: dict[str, Any] = {"type": "array", "minItems": 1,
                              "items": calls[0] if len(calls) == 1 else {"anyOf": calls}}
    if not parallel:
        schema["maxItems"] = 1
    return schema


def tool_plan(req: ChatCompletionRequest, api: ApiSpec) -> ToolPlan:
    if req.tools is None:
        if req.tool_choice not in (None, "none"):
            raise ApiError(400, "`tool_choice` needs `tools`", "tool_choice", "invalid_value")
        return ToolPlan(None, "none")
    schemas = _check_tools(req.tools)
    mode, function = _choice(req.tool_choice, schemas)
    parallel = req.parallel_tool_calls is not False
    plan = ToolPlan(list(req.tools), mode, function, parallel, parser_name=api.tool_call_parser)
    if mode == "auto" and api.tool_call_parser is None:
        raise ApiError(400, "this deployment has no tool-call parser, so `tool_choice: auto` "
                       "could only return calls as plain content; use tool_choice 'required' "
                       "or a named function (constrained decoding), or start the server with "
                       "--tool-call-parser NAME", "tool_choice", "unsupported_field")
    if mode == "named":
        field = "tool_choice"
        plan.guided = GuidedSpec("json_schema", json.dumps(schemas[function],
                                                           ensure_ascii=False), field)
    elif mode == "required":
        plan.guided = GuidedSpec("json_schema", json.dumps(
            _required_schema(schemas, parallel), ensure_ascii=False), "tools")
    return plan


class FirstCallCut:
    """``parallel_tool_calls: false`` under ``tool_choice: auto``: generation stops at the
    end of the first complete call. Each delta of a choice goes through ``cut``; the one
    that completes the first call comes back trimmed to the call's end and finished (the
    caller aborts the sequence), so no later call is generated or billed. With a reasoning
    parser only the answer after the reasoning is read: a call drafted inside ``<think>``
    is reasoning, and cuts nothing."""

    def __init__(self, plan: ToolPlan, reasoning_parser: str | None = None) -> None:
        self.plan = plan
        self.reasoning = reasoning.get(reasoning_parser) if reasoning_parser else None
        self.texts: dict[str, str] = {}

    @staticmethod
    def applies(plan: ToolPlan | None) -> bool:
        return plan is not None and plan.mode == "auto" and not plan.parallel

    def cut(self, delta: ipc.TextDelta) -> ipc.TextDelta | None:
        if delta.finish_reason is not None:
            return None
        before = self.texts.get(delta.rid, "")
        text = self.texts[delta.rid] = before + delta.text
        at = 0 if self.reasoning is None else self.reasoning.answer_start(text, False)
        if at is None:
            return None
        view = self.plan.parser().scan(text[at:], False)
        if not view.calls or not view.calls[0].done or view.calls[0].end is None:
            return None
        keep = max(0, at + view.calls[0].end - len(before))
        return msgspec.structs.replace(delta, text=delta.text[:keep], finish_reason="stop")
