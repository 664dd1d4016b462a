"""Settle ``api.tool_call_parser`` and ``api.reasoning_parser`` before any process
starts: a name is checked, "auto" becomes the parser the chat template's tags name (or
None when no single format is found), and ``*_source`` says which, for
/v1/capabilities and reports."""

from __future__ import annotations

import msgspec

from api_frontend import reasoning, tool_parsers
from cluster.topology import Topology


def _template_source(topology: Topology) -> tuple[str | None, str]:
    from tokenization.template_source import load_server_template
    from tokenization.tokenizer_files import CheckpointTokenizer
    api = topology.api
    if api.chat_template is not None:
        return (load_server_template(api.chat_template, api.limits.max_template_bytes).source,
                "the --chat-template")
    template = CheckpointTokenizer(topology.model.path).chat_template(True)
    return (template.source if template is not None else None), "the checkpoint's template"


def _resolve(topology: Topology, name: str | None, source: str | None, flag: str,
             known, detect) -> tuple[str | None, str | None]:
    if name is None or source is not None:
        return name, source
    if name != "auto":
        if name not in known:
            raise SystemExit(f"candor: unknown {flag} {name!r}; known: {sorted(known)}")
        return name, "flag"
    try:
        text, where = _template_source(topology)
    except Exception as err:  # noqa: BLE001 - the template check reports it properly
        text, where = None, f"no readable chat template ({err})"
    name = detect(text) if text else None
    return name, (f"detected from {where}" if name else
                  f"none: {where} names no single format (set {flag})")


def resolve_tool_parser(topology: Topology) -> Topology:
    api = topology.api
    tool, tool_source = _resolve(topology, api.tool_call_parser, api.tool_call_parser_source,
                                 "--tool-call-parser", tool_parsers.PARSERS,
                                 tool_parsers.detect)
    think, think_source = _resolve(topology, api.reasoning_parser, api.reasoning_parser_source,
                                   "--reasoning-parser", reasoning.PARSERS, reasoning.detect)
    api = msgspec.structs.replace(api, tool_call_parser=tool, tool_call_parser_source=tool_source,
                                  reasoning_parser=think, reasoning_parser_source=think_source)
    return msgspec.structs.replace(topology, api=api)
