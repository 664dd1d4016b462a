"""Settle ``api.tool_call_parser`` before any process starts: a name is checked, "auto"
becomes the parser the chat template's tags name (or None when no single format is
found), and ``tool_call_parser_source`` says which, for /v1/capabilities and reports."""

from __future__ import annotations

import msgspec

from api_frontend import tool_parsers
from protocol.topology import Topology


def _template_source(topology: Topology) -> tuple[str | None, str]:
    from tokenizer_worker.template_source import load_server_template
    from tokenizer_worker.tokenizer_files import CheckpointTokenizer
    api = topology.api
    if api.chat_template is not None:
        return (load_server_template(api.chat_template, api.limits.max_template_bytes).source,
                "the --chat-template")
    template = CheckpointTokenizer(topology.model.path).chat_template(True)
    return (template.source if template is not None else None), "the checkpoint's template"


def resolve_tool_parser(topology: Topology) -> Topology:
    api = topology.api
    name = api.tool_call_parser
    if name is None or api.tool_call_parser_source is not None:
        return topology
    if name != "auto":
        if name not in tool_parsers.PARSERS:
            raise SystemExit(f"candor: unknown --tool-call-parser {name!r}; known: "
                             f"{sorted(tool_parsers.PARSERS)}")
        source = "flag"
    else:
        try:
            text, where = _template_source(topology)
        except Exception as err:  # noqa: BLE001 - the template check reports it properly
            text, where = None, f"no readable chat template ({err})"
        name = tool_parsers.detect(text) if text else None
        source = (f"detected from {where}" if name else
                  f"none: {where} names no single tool-call format (set --tool-call-parser)")
    api = msgspec.structs.replace(api, tool_call_parser=name, tool_call_parser_source=source)
    return msgspec.structs.replace(topology, api=api)
