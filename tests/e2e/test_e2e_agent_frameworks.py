"""Agent frameworks end to end against the running server (random weights).

LangChain's ``ChatOpenAI`` and pydantic-ai's ``Agent`` run in the test environment; instructor cannot share it (its
``jiter`` pin conflicts with the openai SDK the other tests use), so it runs as a separate
program in ``.venv-instructor``, which ``make test`` builds. Every structured answer must
validate against the client's pydantic model, which only constrained decoding can promise
with random weights.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
from pathlib import Path
from typing import Literal

import pytest
from pydantic import BaseModel, Field

REPO = Path(__file__).resolve().parents[2]
INSTRUCTOR_PYTHON = Path(os.environ.get("CANDOR_INSTRUCTOR_PYTHON",
                                        REPO / ".venv-instructor" / "bin" / "python"))


class GetWeather(BaseModel):
    """Weather in a city."""

    city: Literal["Paris", "Rome"]
    days: int = Field(ge=1, le=7)


class Person(BaseModel):
    name: str = Field(max_length=8)
    age: int = Field(ge=0, le=99)


def test_langchain_bind_tools_and_structured_output(server):
    """bind_tools with tool_choice required, with_structured_output by json_schema and by
    function calling (a named tool_choice)."""
    from langchain_openai import ChatOpenAI

    llm = ChatOpenAI(model="tiny-llama", base_url=server.base_url + "/v1", api_key="unused",
                     max_tokens=300, seed=1, max_retries=0)
    msg = llm.bind_tools([GetWeather], tool_choice="required").invoke("Weather in Paris?")
    assert msg.tool_calls and all(c["name"] == "GetWeather" for c in msg.tool_calls)
    for call in msg.tool_calls:
        GetWeather.model_validate(call["args"])
    for method in ("json_schema", "function_calling"):
        person = llm.with_structured_output(Person, method=method).invoke("Describe a person")
        assert isinstance(person, Person), method


def test_langchain_streams_tool_call_chunks(server):
    """Streamed tool-call chunks merge into the same validated call."""
    from langchain_openai import ChatOpenAI

    llm = ChatOpenAI(model="tiny-llama", base_url=server.base_url + "/v1", api_key="unused",
                     max_tokens=300, seed=4, max_retries=0)
    bound = llm.bind_tools([GetWeather], tool_choice="GetWeather")
    merged = None
    for chunk in bound.stream("Weather in Rome?"):
        merged = chunk if merged is None else merged + chunk
    assert len(merged.tool_calls) == 1 and merged.tool_calls[0]["name"] == "GetWeather"
    GetWeather.model_validate(merged.tool_calls[0]["args"])
    whole = bound.invoke("Weather in Rome?").tool_calls
    assert [(c["name"], c["args"]) for c in merged.tool_calls] == \
        [(c["name"], c["args"]) for c in whole]


def test_pydantic_ai_output_types(server):
    """pydantic-ai's default (tool) output, ``ToolOutput`` and ``NativeOutput`` (a
    json_schema response_format), whole and streamed, with no retries allowed."""
    from pydantic_ai import Agent, NativeOutput, ToolOutput
    from pydantic_ai.models.openai import OpenAIChatModel
    from pydantic_ai.providers.openai import OpenAIProvider

    model = OpenAIChatModel("tiny-llama", provider=OpenAIProvider(
        base_url=server.base_url + "/v1", api_key="unused"))
    settings = {"max_tokens": 200, "seed": 1}
    for output in (Person, ToolOutput(Person), NativeOutput(Person)):
        agent = Agent(model, output_type=output, retries=0, model_settings=settings)
        assert isinstance(agent.run_sync("Describe a person").output, Person), output

    async def streamed() -> Person:
        agent = Agent(model, output_type=Person, retries=0, model_settings=settings)
        async with agent.run_stream("Describe a person") as run:
            return await run.get_output()

    assert isinstance(asyncio.run(streamed()), Person)


def test_instructor_modes_validate(server):
    """instructor's TOOLS, TOOLS_STRICT and JSON_SCHEMA modes, and a streamed partial
    object, each return a validated ``Person`` with no retries."""
    if not INSTRUCTOR_PYTHON.exists():
        # `make test` names the venv it built, so there a missing one is a failure
        assert "CANDOR_INSTRUCTOR_PYTHON" not in os.environ, f"{INSTRUCTOR_PYTHON} missing"
        pytest.skip(f"{INSTRUCTOR_PYTHON} missing: `make test` builds it")
    client = REPO / "tests/support/clients/instructor_client.py"
    run = subprocess.run([str(INSTRUCTOR_PYTHON), str(client), server.base_url + "/v1", "tiny-llama"],
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    out = json.loads(run.stdout)
    for mode in ("tool_call", "tools_strict", "json_schema_mode", "partial_last"):
        Person.model_validate(out[mode])
    assert out["partial_count"] > 1, "the partial stream arrived in one piece"
