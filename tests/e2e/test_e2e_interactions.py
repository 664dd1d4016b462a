"""Feature-interaction matrix and combination fuzz (issue 18), through real processes.

Every feature is tested alone elsewhere; here they meet. A *cell* is one request built
from a row of factor values (engine features: server config, prefix-cache hit, n, stream;
request features: sampling, penalties, logit_bias, min_tokens, stops, logprobs, echo,
prompt_logprobs, constraints, tools, reasoning, parallel_tool_calls, a LoRA adapter
(every server but ``pd``, which refuses LoRA, serves one: ``ADAPTER``)), sent beside two
ordinary *bystander* requests. Each cell is checked against its *reference*: the same
request, one choice at a time, alone on the ``base`` server (default engine, cache miss,
not streamed). Tokens, text, tool calls, finish reasons and usage must be equal; logprobs
bitwise equal (the deterministic mode, on by default), except on the ``tp2`` server,
within ``CROSS_TP_ATOL`` of the single-rank reference (``logprob_atol``); a stream's concatenation is compared with
the whole reference; constrained output must parse and validate; each feature's own
promise is checked on the cell's output (``feature_problems``); bystanders must equal
their solo references; no step may fail (``aborts.error``) and every KV block must be free
afterwards. The engine feature itself must have been in play: a prefix hit reported in
usage, a preemption counted, a prompt longer than the chunk budget.

Rows come from a pairwise covering array (``tests/support/pairwise.py``): every pair of factor
values meets in at least one cell. ``--full`` (or ``CANDOR_MATRIX_FULL=1``) runs every
allowed pair in a cell of its own instead. Cells are grouped by server so each server
starts once; ``base`` stays up for the references.

Known failures (``KNOWN``, issue 18's item numbers) are kept out of the general cells
and each gets a dedicated cell marked ``xfail(strict=True)``: when a fix lands, that cell
passes, the strict xfail fails loudly, and the entry is deleted here so the pair returns
to the covering array.

The ``spec`` server (speculative decoding, n-gram), the ``draft`` server (a draft model:
the target itself) and the ``eagle3`` server (a tiny random EAGLE-3 head) run the
``base`` rows, so their answers are checked bitwise against base's own references.

The ``store`` server (DP=2 round robin with a shared KV store) runs the ``dp2`` rows
(``MIRRORED``) rather than joining the covering array, which would change every server's
cells; its hit cells wait for the warm-up's blocks to reach the store (written behind).

Run-ahead has no switch in Candor (always on); the ``sync`` server turns it off through a
test-side hook in the scheduler process (``tests/support/no_run_ahead_site``).

Images have a matrix of their own on a LLaVA checkpoint (``tests/support/vision_zoo.py``;
the tiny text model cannot take images): ``VL_FACTORS`` crosses the number of images
(0, 1, 2) with the engine features that meet them (chunked prefill splitting an image's
span, preemption recomputing it, tensor parallelism, prefill/decode handoff, speculative
decoding, a prefix hit) and the request features that read the prompt (n, stream, seeded
sampling, a penalty, min_tokens, logprobs, prompt logprobs). Each ``vl_cell`` is checked
as a cell is, against its reference alone on its family's ``base`` server, beside a text
and an image bystander. Two servers of it serve the tiny Gemma 3 image model
(``tests/support/gemma3_vision_zoo.py``, ``VL_FAMILY``), whose images are computed whole
(chunked prefill stops before them) and whose prefix hits never end inside one; their
references come from a Gemma 3 ``base`` of their own. Three serve the tiny Qwen2-VL
(``tests/support/qwen2_vl_zoo.py``: M-RoPE positions, images split over chunks,
recomputed after preemption, decoded on another replica), against a Qwen2-VL ``base``.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import uuid
import zlib
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import jsonschema
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.support import model_zoo
from tests.support.metrics_text import scrape
from tests.support.pairwise import complete, covering_array, every_pair
from tests.support.polling import wait_until
from tests.support.server import CandorServer

MODEL = "tiny-llama"
FULL_ENV = os.environ.get("CANDOR_MATRIX_FULL") == "1"  # as ``pytest --full``
# Logprobs are bitwise equal whatever the batch, cache, chunking, preemption or replica
# (the deterministic mode, on by default). Across tensor-parallel sizes they are not: the
# row-parallel layers split each dot product at the rank boundary.
CROSS_TP_ATOL = 1e-4
CLIENT_TIMEOUT_S = 180.0
# a PEFT adapter of the tiny model (tests/support/lora_zoo.py), served by every server that can
# (``pd`` refuses LoRA): an adapter cell asks for it by name, and its rows must be as
# batch-invariant as the base model's
ADAPTER = "tiny-lora"
NO_LORA_SERVERS = ("pd",)
FUZZ_EXAMPLES = int(os.environ.get("CANDOR_MATRIX_FUZZ_EXAMPLES", "24"))

# ------------------------------------------------------------------ the servers
COMMON_FLAGS = ("--served-model-name", MODEL, "--max-model-len", "1024",
                # every matrix server can split reasoning; a request turns it off with
                # chat_template_kwargs.thinking: false (the tiny template ignores the key)
                "--reasoning-parser", "deepseek_r1")
NO_RUN_AHEAD_SITE = Path(__file__).parents[1] / "support" / "no_run_ahead_site"
# name -> extra flags; "sync" also gets the no-run-ahead hook. "base" is the reference.
SERVERS: dict[str, tuple[str, ...]] = {
    "base": (),
    "chunked": ("--max-num-batched-tokens", "16"),
    "sync": (),
    "tp2": ("--tensor-parallel-size", "2"),
    "dp2": ("--data-parallel-size", "2"),
    # disaggregated: replica 0 prefills, the KV moves to replica 1, which decodes; long
    # prompts in 64-token chunks, whose KV streams ahead of the first token
    "pd": ("--prefill-replicas", "1", "--decode-replicas", "1", "--max-num-batched-tokens",
           "64"),
    # a KV store shared by two replicas taking turns: a hit cell lands on the replica
    # that did not compute its warm-up, so its prefix hit comes through the store
    "store": ("--data-parallel-size", "2", "--data-parallel-routing", "round_robin",
              "--kv-store-size", "0.05"),
    # last: the combination fuzz reuses it (preemption, prefix hits and run-ahead at once;
    # priority scheduling on, so the fuzz's non-zero `priority` is served, not refused)
    "preempt": ("--num-kv-blocks", "40", "--scheduling-policy", "priority"),
    # speculative decoding (n-gram drafts, verified by the model): base's rows, whose
    # answers it must not change (tokens and logprobs bitwise)
    "spec": ("--speculative-config", json.dumps({
        "method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1,
        "prompt_lookup_max": 3})),
    # speculative decoding with a draft model, the target itself (DRAFT_IS_TARGET: its
    # directory once known): its cache mirrors base's blocks through hits, n, adapters
    "draft": ("--speculative-config", json.dumps({
        "model": "{DRAFT_IS_TARGET}", "num_speculative_tokens": 3})),
    # speculative decoding with a tiny random EAGLE-3 head (EAGLE3_HEAD: built for the
    # model once known): the target keeps its aux hidden states, the head's cache mirrors
    # base's blocks; few drafts kept, none may change an answer
    "eagle3": ("--speculative-config", json.dumps({
        "method": "eagle3", "model": "{EAGLE3_HEAD}", "num_speculative_tokens": 3})),
}


def no_run_ahead_env() -> dict[str, str]:
    inherited = os.environ.get("PYTHONPATH")
    return {"PYTHONPATH": os.pathsep.join(p for p in (str(NO_RUN_AHEAD_SITE), inherited) if p)}


# ------------------------------------------------------------------ request material
SYSTEM = ("You are the ship's log of an old lighthouse on a rocky northern coast. Record "
          "the weather, the passing boats, the state of the lamp and the keeper's mood in "
          "short plain sentences. Keep every entry under fifty words, name the hour, and "
          "never invent ships that were not seen from the gallery. When asked about the "
          "storm, describe the wind, the waves and the sky in that order.")
QUESTION = ("The old lighthouse keeper watched the storm roll in from the sea. What did he "
            "see, and what did he do next?")
MESSAGES = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": QUESTION}]
PROMPT = SYSTEM + "\n\nLog entry, nine in the evening: " + QUESTION + " The keeper"
THINKING_OFF = {"thinking": False}

JSON_SCHEMA = {"type": "object", "properties": {
    "ok": {"type": "boolean"}, "n": {"type": "integer", "minimum": 0, "maximum": 99},
    "tag": {"enum": ["red", "green", "blue"]}},
    "required": ["ok", "n", "tag"], "additionalProperties": False}
REGEX = r"[a-z]+( [a-z]+)*"
CHOICES = ["yes", "no", "maybe later"]
WEATHER = {"type": "object", "properties": {
    "city": {"type": "string", "enum": ["Paris", "Rome"]},
    "days": {"type": "integer", "minimum": 1, "maximum": 9},
    "metric": {"type": "boolean"}},
    "required": ["city", "days", "metric"], "additionalProperties": False}
TIME = {"type": "object", "properties": {"zone": {"type": "string", "enum": ["UTC", "CET"]}},
        "required": ["zone"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "parameters": TIME}}]
TOOL_SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}
# tool_choice auto reads calls out of free text; random weights never write one, so a
# regex spells two Hermes calls out (the parser, not the grammar, is under test)
HERMES_TWO_CALLS = (r'Sure\.<tool_call>\{"name": "get_weather", "arguments": '
                    r'\{"city": "(Paris|Rome)", "days": [1-9], "metric": (true|false)\}\}'
                    r'</tool_call><tool_call>\{"name": "get_time", "arguments": '
                    r'\{"zone": "(UTC|CET)"\}\}</tool_call>')

EOS_IDS = (1, 4)  # <|end_of_text|>, <|eot_id|>
MIN_TOKENS = 6
# min_tokens only binds if the sequence wants to end earlier: end tokens are pushed up
MIN_TOKENS_BIAS = {str(t): 100.0 for t in EOS_IDS}
# presence/frequency penalties count generated tokens, and greedy random-weight text
# seldom repeats one: a push on one token makes it repeat, so the penalty has work to do
REPEAT_BIAS = {"568": 4.0}
BANNED, BOOSTED = 887, 1022
LOGIT_BIAS = {str(BANNED): -100.0, str(BOOSTED): 3.0}
MAX_TOKENS = {"none": 48, "json_schema": 48, "regex": 48, "choice": 8, "tools_required": 64,
              "tools_named": 48, "tools_auto": 96}

# ------------------------------------------------------------------ the factors
# servers that run another server's cells instead of joining the covering array (which
# would then change for every server): store runs dp2's rows
MIRRORED = {"store": "dp2", "spec": "base", "draft": "base", "eagle3": "base"}
FACTORS: dict[str, list[Any]] = {
    "server": [name for name in SERVERS if name not in MIRRORED],
    "cache": ["miss", "hit"],
    "n": [1, 2],
    "stream": [False, True],
    "endpoint": ["chat", "completions"],
    "sampling": ["greedy", "seeded"],
    "penalty": ["none", "presence", "frequency", "repetition"],
    "logit_bias": [False, True],
    "min_tokens": [False, True],
    "stop": ["none", "string", "string_at_end", "token_id"],
    "logprobs": ["none", "logprobs", "top_logprobs", "echo", "prompt_logprobs"],
    "constraint": ["none", "json_schema", "regex", "choice", "tools_required", "tools_named",
                   "tools_auto"],
    "reasoning": [False, True],
    "parallel_tool_calls": [None, False],
    "adapter": [False, True],
}
TOOL_CONSTRAINTS = ("tools_required", "tools_named", "tools_auto")


def valid(row: Mapping[str, Any]) -> bool:
    """Combinations the API defines (a partial row: only the factors present)."""
    def has(name, *values):
        return name in row and row[name] in values
    completions = has("endpoint", "completions")
    if completions and (has("constraint", *TOOL_CONSTRAINTS) or has("reasoning", True)
                        or has("parallel_tool_calls", False)):
        return False
    if has("logprobs", "echo") and has("endpoint", "chat"):
        return False  # chat's echo is another extension (the last assistant message)
    if has("logprobs", "prompt_logprobs") and has("stream", True):
        return False  # documented 400 (as vLLM)
    if has("parallel_tool_calls", False) and has(
            "constraint", "none", "json_schema", "regex", "choice"):
        return False
    if has("adapter", True) and has("server", *NO_LORA_SERVERS):
        return False
    if has("adapter", True) and has("server", "store") and has("cache", "hit"):
        return False  # adapters never share the store (ids are per replica): no hit there
    return True


Combo = tuple[tuple[str, tuple[Any, ...]], ...]  # factor -> the values that make it


def holds(combo: Combo, row: Mapping[str, Any]) -> bool:
    return all(k in row and row[k] in values for k, values in combo)


FORCED_GRAMMARS = ("json_schema", "choice", "tools_required", "tools_named", "tools_auto")
# grammars that spell several tokens of fixed text (keys, a tool name, the calls' regex):
# on the ``spec`` server some of them are drafted as the grammar's forced tokens and kept
SPELLED_GRAMMARS = ("json_schema", "tools_required", "tools_named", "tools_auto")
# combinations that no engine can serve as asked (CONFLICTS), also open bugs (KNOWN)
GRAMMAR_ENDS_BEFORE_MIN_TOKENS: Combo = (("min_tokens", (True,)), ("constraint", ("choice",)))
# min_tokens masks stop_token_ids, and the stop id (taken from what the request writes)
# may be the one token the grammar allows
GRAMMAR_NEEDS_MASKED_STOP_ID: Combo = (("min_tokens", (True,)), ("stop", ("token_id",)),
                                       ("constraint", FORCED_GRAMMARS))


@dataclass(frozen=True)
class Conflict:
    """Two features that cannot both hold: by the policy table (DESIGN.md, "a feature
    combination the engine cannot honour") the request is refused with a 400 naming one
    of ``fields`` (a prefix of the param) where that is known up front, or that request
    alone ends with an error in OpenAI's shape; or it is answered and every check but
    ``waived`` holds. Never its batch."""

    combo: Combo
    fields: tuple[str, ...]
    waived: str = ""


CONFLICTS: tuple[Conflict, ...] = (
    Conflict(GRAMMAR_ENDS_BEFORE_MIN_TOKENS, ("min_tokens", "guided_choice"),
             waived="min_tokens"),
    Conflict(GRAMMAR_NEEDS_MASKED_STOP_ID,
             ("min_tokens", "stop_token_ids", "response_format", "guided_", "tool"),
             waived="min_tokens"),
)


def refusal_problem(reply: Reply, conflict: Conflict) -> str | None:
    """None where ``reply`` refuses a conflicting combination as the policy allows."""
    err = reply.error.get("error") if isinstance(reply.error, dict) else None
    if not isinstance(err, dict) or set(err) != {"message", "type", "param", "code"}:
        return f"status {reply.status}, not an error in OpenAI's shape: {reply.error}"
    if reply.status == 400 and not str(err["param"]).startswith(conflict.fields):
        return f"a 400 naming {err['param']!r}, not one of {conflict.fields}"
    return None


@dataclass(frozen=True)
class Known:
    """A failure on today's main: issue 18's ``item`` (None: found by this matrix, not
    in the issue yet). ``combo`` (factor -> the values that trigger it) makes it happen.
    Without ``check``, rows holding the combo are kept out of the covering array; with
    it, only that named check is skipped in the other cells (a feature broken alone).
    Either way one dedicated cell (each factor at its first listed value) runs the combo
    and is expected to fail."""

    item: int | None
    combo: Combo
    what: str
    check: str | None = None

    def matches(self, row: Mapping[str, Any]) -> bool:
        return holds(self.combo, row)

    @property
    def reason(self) -> str:
        where = f"issue 18 item {self.item}" if self.item else "NEW (interaction matrix)"
        return f"{where}: {self.what}"


# none open today: a failure the matrix finds goes here, with its item and combo
KNOWN: tuple[Known, ...] = ()

GATED_CHECKS = frozenset(k.check for k in KNOWN if k.check)


def allowed(row: Mapping[str, Any]) -> bool:
    return valid(row) and not any(k.check is None and k.matches(row) for k in KNOWN)


@dataclass(frozen=True)
class Cell:
    """One row of factor values (read as attributes: ``cell.stream``) and the named
    checks it skips (those of open bugs, except in the bug's own dedicated cell)."""

    row: dict[str, Any]
    checks_off: frozenset[str] = GATED_CHECKS

    def __getattr__(self, name: str) -> Any:
        try:
            return self.row[name]
        except KeyError:
            raise AttributeError(name) from None

    @property
    def id(self) -> str:
        first = {name: values[0] for name, values in FACTORS.items()}
        parts = [str(self.row["server"])]
        for name, value in self.row.items():
            if name != "server" and value != first[name]:
                parts.append(name if value is True else f"{name}={value}")
        return "-".join(parts)


def _cells(full: bool) -> list:
    make = every_pair if full else covering_array
    rows = make(FACTORS, allowed)
    rows += [_mirrored(r, name) for name, like in MIRRORED.items() for r in rows
             if r["server"] == like]
    params = [pytest.param(Cell(r), id=Cell(r).id) for r in rows]
    for known in KNOWN:
        cell = Cell(_completed({k: values[0] for k, values in known.combo}),
                    GATED_CHECKS - {known.check})
        params.append(pytest.param(cell, id=f"known{known.item or '-new'}-{cell.id}", marks=[
            pytest.mark.xfail(strict=True, reason=known.reason)]))
    order = list(SERVERS)  # grouped by server (a stable sort): each starts once
    params.sort(key=lambda p: order.index(p.values[0].row["server"]))
    return params


def _mirrored(row: dict[str, Any], server: str) -> dict[str, Any]:
    """``row`` on ``server``; a row it cannot serve under the adapter runs on the base
    model there (an adapter never reads the store, and the store's hit cells are its
    point)."""
    out = {**row, "server": server}
    if not allowed(out):
        out["adapter"] = False
    assert allowed(out), out
    return out


def _completed(partial: dict[str, Any]) -> dict[str, Any]:
    """``partial`` with every other factor at its first valid value."""
    row = complete(FACTORS, valid, partial)
    assert row is not None, partial
    return row


# ------------------------------------------------------------------ request bodies
def constraint_fields(constraint: str) -> dict[str, Any]:
    return {
        "none": {},
        "json_schema": {"response_format": {"type": "json_schema", "json_schema": {
            "name": "entry", "schema": JSON_SCHEMA, "strict": True}}},
        "regex": {"guided_regex": REGEX},
        "choice": {"guided_choice": CHOICES},
        "tools_required": {"tools": TOOLS, "tool_choice": "required"},
        "tools_named": {"tools": TOOLS, "tool_choice": {
            "type": "function", "function": {"name": "get_weather"}}},
        "tools_auto": {"tools": TOOLS, "tool_choice": "auto", "guided_regex": HERMES_TWO_CALLS},
    }[constraint]


def build_body(cell: Cell) -> dict[str, Any]:
    """The cell's request without ``stop`` / ``cache_salt`` (set per send)."""
    chat = cell.endpoint == "chat"
    body: dict[str, Any] = {"model": ADAPTER if cell.adapter else MODEL,
                            "max_tokens": MAX_TOKENS[cell.constraint], "return_token_ids": True}
    if chat:
        body["messages"] = MESSAGES
        body["chat_template_kwargs"] = {} if cell.reasoning else dict(THINKING_OFF)
    else:
        body["prompt"] = PROMPT
    if cell.sampling == "greedy":
        body["temperature"] = 0.0
    else:
        body.update(temperature=1.0, seed=zlib.crc32(cell.id.encode()) % 100_000)
    bias: dict[str, float] = {}
    if cell.penalty == "presence":
        body["presence_penalty"] = 1.5
        bias |= REPEAT_BIAS
    elif cell.penalty == "frequency":
        body["frequency_penalty"] = 1.5
        bias |= REPEAT_BIAS
    elif cell.penalty == "repetition":
        body["repetition_penalty"] = 1.8
    if cell.logit_bias:
        bias |= LOGIT_BIAS
    if cell.min_tokens:
        body["min_tokens"] = MIN_TOKENS
        bias |= MIN_TOKENS_BIAS
    if bias:
        body["logit_bias"] = bias
    if cell.logprobs == "logprobs":
        body.update({"logprobs": True} if chat else {"logprobs": 1})
    elif cell.logprobs == "top_logprobs":
        body.update({"logprobs": True, "top_logprobs": 3} if chat else {"logprobs": 3})
    elif cell.logprobs == "echo":
        body.update(echo=True, logprobs=1)
    elif cell.logprobs == "prompt_logprobs":
        body["prompt_logprobs"] = 2
    body.update(constraint_fields(cell.constraint))
    if cell.parallel_tool_calls is False:
        body["parallel_tool_calls"] = False
    if cell.n > 1:
        body["n"] = cell.n
    if cell.stream:
        body.update(stream=True, stream_options={"include_usage": True})
    return body


def path_of(body: Mapping[str, Any]) -> str:
    return "/v1/chat/completions" if "messages" in body else "/v1/completions"


def single_choice(body: Mapping[str, Any], i: int) -> dict[str, Any]:
    """The reference for choice ``i``: n=1 (choice i samples with seed + i), whole."""
    out = {k: v for k, v in body.items() if k not in ("n", "stream", "stream_options")}
    if "seed" in body:
        out["seed"] = body["seed"] + i
    return out


# ------------------------------------------------------------------ replies
@dataclass
class Choice:
    text: str = ""
    reasoning: str = ""
    calls: list[list[str]] = field(default_factory=list)  # [name, arguments]
    finish: str | None = None
    token_ids: list[int] = field(default_factory=list)
    # chat: (token, logprob, ((alt, logprob), ...)); completions: (token, logprob|None,
    # sorted top items | None)
    logprobs: list[tuple] = field(default_factory=list)
    offsets: list[int] = field(default_factory=list)
    prompt_logprobs: list | None = None


@dataclass
class Reply:
    status: int
    choices: list[Choice] = field(default_factory=list)
    usage: dict | None = None
    error: Any = None  # the error body, or a stream's error frame
    prompt_logprobs: list | None = None  # chat: top level
    speculative: dict | None = None  # candor.speculative: the body's, or a stream's last frame's

    @property
    def ok(self) -> bool:
        return self.status == 200 and self.error is None

    def choice_prompt_logprobs(self, i: int):
        return self.prompt_logprobs if self.prompt_logprobs is not None else \
            self.choices[i].prompt_logprobs


def _chat_logprobs(entries) -> list[tuple]:
    return [(e["token"], e["logprob"], tuple((t["token"], t["logprob"])
                                             for t in e.get("top_logprobs") or []))
            for e in entries or []]


def _completion_logprobs(lp) -> tuple[list[tuple], list[int]]:
    tops = [tuple(sorted(d.items())) if d is not None else None for d in lp["top_logprobs"]]
    return list(zip(lp["tokens"], lp["token_logprobs"], tops)), list(lp["text_offset"])


def parse_whole(status: int, body: dict) -> Reply:
    if status != 200:
        return Reply(status, error=body)
    reply = Reply(status, usage=body.get("usage"), prompt_logprobs=body.get("prompt_logprobs"),
                  speculative=(body.get("candor") or {}).get("speculative"))
    for c in sorted(body["choices"], key=lambda c: c["index"]):
        ch = Choice(finish=c["finish_reason"], token_ids=c.get("token_ids") or [])
        if "message" in c:
            m = c["message"]
            ch.text, ch.reasoning = m.get("content") or "", m.get("reasoning_content") or ""
            ch.calls = [[t["function"]["name"], t["function"]["arguments"]]
                        for t in m.get("tool_calls") or []]
            if c.get("logprobs"):
                ch.logprobs = _chat_logprobs(c["logprobs"]["content"])
        else:
            ch.text = c["text"]
            if c.get("logprobs"):
                ch.logprobs, ch.offsets = _completion_logprobs(c["logprobs"])
            ch.prompt_logprobs = c.get("prompt_logprobs")
        reply.choices.append(ch)
    return reply


def parse_stream(status: int, frames: list[Any]) -> Reply:
    if status != 200:
        return Reply(status, error=frames)
    reply = Reply(status)
    by_index: dict[int, Choice] = {}
    for frame in frames:
        if "error" in frame:
            reply.error = frame
            continue
        if frame.get("usage"):
            reply.usage = frame["usage"]
        if "speculative" in (frame.get("candor") or {}):
            reply.speculative = frame["candor"]["speculative"]
        for c in frame.get("choices") or []:
            ch = by_index.setdefault(c["index"], Choice())
            ch.finish = c.get("finish_reason") or ch.finish
            ch.token_ids += c.get("token_ids") or []
            if "delta" in c:
                d = c["delta"]
                ch.text += d.get("content") or ""
                ch.reasoning += d.get("reasoning_content") or ""
                for t in d.get("tool_calls") or []:
                    if t["index"] == len(ch.calls):  # a call's first delta names it
                        ch.calls.append([t["function"]["name"], ""])
                    ch.calls[t["index"]][1] += t["function"].get("arguments") or ""
                if c.get("logprobs"):
                    ch.logprobs += _chat_logprobs(c["logprobs"]["content"])
            else:
                ch.text += c["text"]
                if c.get("logprobs"):
                    lps, offsets = _completion_logprobs(c["logprobs"])
                    ch.logprobs += lps
                    ch.offsets += offsets
    reply.choices = [by_index[i] for i in sorted(by_index)]
    return reply


async def send(http: aiohttp.ClientSession, srv: CandorServer, body: dict,
               salt: str | None = None) -> Reply:
    body = {**body, "cache_salt": salt or uuid.uuid4().hex}
    async with http.post(srv.base_url + path_of(body), json=body) as resp:
        status, payload = resp.status, await resp.read()
    if not body.get("stream") or status != 200:
        try:
            return parse_whole(status, json.loads(payload))
        except ValueError:
            return Reply(status, error=payload.decode("utf-8", "replace"))
    lines = [line for line in payload.decode().split("\n") if line.startswith("data: ")]
    done = bool(lines) and lines[-1] == "data: [DONE]"
    reply = parse_stream(status, [json.loads(line[len("data: "):]) for line in lines
                                  if line != "data: [DONE]"])
    if not done:
        reply.error = reply.error or "the stream did not end with data: [DONE]"
    return reply


# ------------------------------------------------------------------ comparisons
def logprob_atol(server: str) -> float:
    """How far a logprob on ``server`` may be from its reference on ``base``."""
    return CROSS_TP_ATOL if server == "tp2" else 0.0


def _close(a, b, atol: float) -> bool:
    if a is None or b is None:
        return a is b
    return abs(a - b) <= atol


def _logprob_diff(got: list[tuple], want: list[tuple], atol: float) -> str | None:
    if len(got) != len(want):
        return f"{len(got)} logprob entries, want {len(want)}"
    for k, (g, w) in enumerate(zip(got, want)):
        if g[0] != w[0] or not _close(g[1], w[1], atol):
            return f"logprobs[{k}]: {g[:2]} want {w[:2]}"
        gt, wt = g[2] or (), w[2] or ()
        if [t for t, _ in gt] != [t for t, _ in wt] or not all(
                _close(a, b, atol) for (_, a), (_, b) in zip(gt, wt)):
            return f"top_logprobs[{k}]: {gt} want {wt}"
    return None


def _prompt_logprob_diff(got, want, atol: float) -> str | None:
    if (got is None) != (want is None):
        return f"prompt_logprobs {'missing' if got is None else 'unexpected'}"
    if got is None:
        return None
    if len(got) != len(want):
        return f"{len(got)} prompt_logprobs entries, want {len(want)}"
    for k, (g, w) in enumerate(zip(got, want)):
        if (g is None) != (w is None) or (g is not None and (
                sorted(g) != sorted(w) or not all(
                    _close(g[t]["logprob"], w[t]["logprob"], atol) for t in g))):
            return f"prompt_logprobs[{k}]: {g} want {w}"
    return None


def choice_diff(got: Choice, want: Choice, offsets: bool, atol: float) -> str | None:
    """What differs between a cell's choice and its reference, or None."""
    for name in ("token_ids", "text", "reasoning", "calls", "finish"):
        g, w = getattr(got, name), getattr(want, name)
        if g != w:
            return f"{name}: {g!r}\n   reference: {w!r}"
    if (lp := _logprob_diff(got.logprobs, want.logprobs, atol)) is not None:
        return lp
    if offsets and got.offsets != want.offsets:
        return f"text_offset: {got.offsets}\n   reference: {want.offsets}"
    return None


def reply_diffs(got: Reply, refs: list[Reply], offsets: bool, atol: float) -> list[str]:
    if len(got.choices) != len(refs):
        return [f"{len(got.choices)} choices, want {len(refs)}"]
    out = []
    for i, (ch, ref) in enumerate(zip(got.choices, refs)):
        if (d := choice_diff(ch, ref.choices[0], offsets, atol)) is not None:
            out.append(f"choice {i}: {d}")
        if (d := _prompt_logprob_diff(got.choice_prompt_logprobs(i),
                                      ref.choice_prompt_logprobs(0), atol)) is not None:
            out.append(f"choice {i}: {d}")
    want_completion = sum(r.usage["completion_tokens"] for r in refs)
    if got.usage is None:
        out.append("no usage")
    elif (got.usage["prompt_tokens"], got.usage["completion_tokens"]) != (
            refs[0].usage["prompt_tokens"], want_completion):
        out.append(f"usage {got.usage}, reference prompt {refs[0].usage['prompt_tokens']} "
                   f"completion {want_completion}")
    return out


# ------------------------------------------------------------------ each feature's promise
def _parses(args: str) -> bool:
    try:
        return isinstance(json.loads(args), dict)
    except ValueError:
        return False


def feature_problems(cell: Cell, body: dict, reply: Reply, stop: StopPlan,
                     waived: str = "") -> list[str]:
    """What the cell's output breaks of each feature's own promise (the reference is the
    same request, so a feature broken alone passes the comparison: these catch it)."""
    problems = []
    prompt_tokens = reply.usage["prompt_tokens"] if reply.usage else None
    for i, ch in enumerate(reply.choices):
        def bad(msg: str) -> None:
            problems.append(f"choice {i}: {msg}")
        answer = ch.text[len(PROMPT):] if cell.logprobs == "echo" else ch.text
        # the generated text as the stop saw it (tool calls are not visible as text)
        raw = None if cell.constraint in TOOL_CONSTRAINTS else ch.reasoning + answer
        cut = stop.cut[i]
        # constraints: the answer validates unless a stop cut it or reasoning never ended
        answer_done = not cut and ch.finish != "length" and not cell.reasoning
        if cell.constraint == "json_schema" and answer_done:
            try:
                jsonschema.validate(json.loads(answer), JSON_SCHEMA)
            except (ValueError, jsonschema.ValidationError) as err:
                bad(f"json_schema output does not validate: {answer!r} ({err})")
        elif cell.constraint == "regex" and answer_done and not re.fullmatch(REGEX, answer):
            bad(f"guided_regex output does not match: {answer!r}")
        elif cell.constraint == "choice" and answer_done and answer not in CHOICES:
            bad(f"guided_choice output is not a choice: {answer!r}")
        elif cell.constraint in TOOL_CONSTRAINTS and answer_done:
            if not ch.calls or ch.finish != "tool_calls":
                bad(f"no tool calls ({ch.finish}): content {ch.text!r}")
            for name, args in ch.calls:
                try:
                    jsonschema.validate(json.loads(args), TOOL_SCHEMAS[name])
                except (KeyError, ValueError, jsonschema.ValidationError) as err:
                    bad(f"tool call {name}({args}) does not validate: {err}")
            if cell.constraint == "tools_named" and [c[0] for c in ch.calls] != ["get_weather"]:
                bad(f"named tool_choice gave calls {ch.calls}")
            if cell.constraint == "tools_auto":
                want = ["get_weather"] if cell.parallel_tool_calls is False else [
                    "get_weather", "get_time"]
                if [c[0] for c in ch.calls] != want or ch.text != "Sure.":
                    bad(f"auto tool calls {ch.calls} content {ch.text!r}, want {want}")
        # finish_reason tool_calls means every call was written to its end; a reply that a
        # stop or max_tokens ended inside a call finishes what ended it (README's policy)
        for name, args in ch.calls if ch.finish == "tool_calls" else ():
            if not _parses(args):
                bad(f"finish_reason tool_calls, yet {name} has arguments that do not parse: "
                    f"{args!r}")
        if cell.parallel_tool_calls is False and len(ch.calls) > 1:
            bad(f"parallel_tool_calls false gave {len(ch.calls)} calls")
        if cell.reasoning and cell.endpoint == "chat" and ch.text and not ch.reasoning:
            bad(f"reasoning parser on, yet no reasoning_content: {ch.text!r}")
        if not cell.reasoning and ch.reasoning:
            bad(f"reasoning off, yet reasoning_content {ch.reasoning!r}")
        if cell.min_tokens and waived != "min_tokens" and len(ch.token_ids) < MIN_TOKENS:
            bad(f"{len(ch.token_ids)} tokens, min_tokens {MIN_TOKENS}")
        if cell.logit_bias and BANNED in ch.token_ids:
            bad(f"token {BANNED} has logit_bias -100, yet was generated")
        stop_text = body.get("stop")
        if cut and stop_text and raw is not None and stop_text in raw:
            bad(f"stop string {stop_text!r} is in the output {raw!r}")
        if stop.held[i] and raw is not None and stop_text not in raw:
            bad(f"stop string {stop_text!r} ends within min_tokens, yet it cut {raw!r}")
        # a stop after the last call's end leaves the calls whole: tool_calls (checked above)
        if cut and ch.finish not in ("stop", "tool_calls"):
            bad(f"the stop cut the text, yet finish_reason is {ch.finish!r}")
        stop_ids = body.get("stop_token_ids") or []
        if stop_ids and stop_ids[0] in ch.token_ids[:-1]:
            bad(f"generation went on past stop token {stop_ids[0]}")
        if stop_ids and cell.min_tokens and stop_ids[0] in ch.token_ids[:MIN_TOKENS]:
            bad(f"stop token {stop_ids[0]} within min_tokens")
        if cell.logprobs in ("logprobs", "top_logprobs", "echo"):
            echoed = prompt_tokens if cell.logprobs == "echo" and prompt_tokens else 0
            if len(ch.logprobs) != len(ch.token_ids) + echoed:
                bad(f"{len(ch.logprobs)} logprob entries for {len(ch.token_ids)} tokens"
                    + (f" + {echoed} echoed" if echoed else ""))
            if any(lp is not None and lp > 0 for _, lp, _ in ch.logprobs):
                bad("a logprob above 0")
            if cell.logprobs == "top_logprobs" and cell.endpoint == "chat" and any(
                    len(top) != 3 for _, _, top in ch.logprobs):
                bad("top_logprobs 3 not honoured")
        if cell.logprobs == "echo":
            if not ch.text.startswith(PROMPT):
                bad(f"echo: the text does not start with the prompt: {ch.text[:80]!r}")
            # a last token with no text in the reply (an end token) sits at its end
            if "text_offsets" not in cell.checks_off and ch.offsets and (
                    ch.offsets != sorted(ch.offsets) or ch.offsets[-1] > len(ch.text)):
                bad(f"echo: text_offset {ch.offsets} outside the {len(ch.text)}-char text")
        if cell.logprobs == "prompt_logprobs":
            plp = reply.choice_prompt_logprobs(i)
            if plp is None or len(plp) != prompt_tokens or plp[0] is not None:
                bad(f"prompt_logprobs: {None if plp is None else len(plp)} entries for "
                    f"{prompt_tokens} prompt tokens")
    return problems


# ------------------------------------------------------------------ stops from a probe
@dataclass
class StopPlan:
    """The cell's stop, picked from what the unstopped request generates (so it really
    cuts), and per choice what the stop must do: end the text (``cut``), or stay in it
    because it ends within the first ``min_tokens`` tokens (``held``)."""

    fields: dict[str, Any] = field(default_factory=dict)
    cut: list[bool] = field(default_factory=list)
    held: list[bool] = field(default_factory=list)


def _first_end(texts: list[str], stop: str) -> int | None:
    """The token at which ``stop`` first occurs in full in the concatenated texts."""
    joined = ""
    for k, text in enumerate(texts):
        joined += text
        if stop in joined:
            return k
    return None


def choose_stop(kind: str, probe: Choice, min_tokens: bool) -> dict[str, Any]:
    """``string``: a token's text from the middle; ``string_at_end``: the last token's
    text, max_tokens ending there (the stop ends on the last allowed token); ``token_id``:
    a token id from the middle. With min_tokens, from the first min_tokens tokens
    (a stop there must not count)."""
    texts = [t for t, _, _ in probe.logprobs]
    ids = probe.token_ids
    window = range(0, min(MIN_TOKENS, len(ids))) if min_tokens else range(len(ids))
    if kind == "token_id":
        ks = [k for k in window if ids[k] not in ids[:k] and ids[k] not in EOS_IDS]
        return {"stop_token_ids": [ids[ks[len(ks) // 2]]]} if ks else {}

    def usable(k: int, shortest: int) -> bool:  # plain text, first seen at token k
        t = texts[k].strip()
        return (texts[k].isascii() and t.isalnum() and len(t) >= shortest
                and _first_end(texts, texts[k]) == k)
    ks = [k for k in window if usable(k, 2)] or [k for k in window if usable(k, 1)]
    if not ks:
        return {}
    if kind == "string" or min_tokens:
        return {"stop": texts[ks[len(ks) // 2]]}
    return {"stop": texts[ks[-1]], "max_tokens": ks[-1] + 1}


def probe_body(body: dict, i: int, cell: Cell) -> dict:
    """Choice ``i``'s request without its stop, whole, with per-token texts; without
    min_tokens (and its end-token push) too: up to min_tokens the tokens are the same."""
    out = single_choice(body, i)
    for key in ("echo", "prompt_logprobs", "top_logprobs", "stop", "stop_token_ids"):
        out.pop(key, None)
    out["logprobs"] = True if "messages" in body else 1
    if cell.min_tokens:
        out.pop("min_tokens")
        bias = {k: v for k, v in out["logit_bias"].items() if k not in MIN_TOKENS_BIAS}
        out.pop("logit_bias")
        if bias:
            out["logit_bias"] = bias
    return out


async def plan_stop(http: aiohttp.ClientSession, base: CandorServer, cell: Cell,
                    body: dict) -> StopPlan:
    distinct = cell.n if cell.sampling == "seeded" else 1
    probes = [await send(http, base, probe_body(body, i, cell)) for i in range(distinct)]
    for probe in probes:
        assert probe.ok, f"stop probe failed on base: {probe.status} {probe.error}"
    probes += probes * (cell.n - distinct)
    plan = StopPlan(choose_stop(cell.stop, probes[0].choices[0], cell.min_tokens))
    assert plan.fields, f"no usable {cell.stop} in {probes[0].choices[0].logprobs}"
    limit = plan.fields.get("max_tokens", body["max_tokens"])
    for probe in probes:
        ch = probe.choices[0]
        if "stop" in plan.fields:
            at = _first_end([t for t, _, _ in ch.logprobs], plan.fields["stop"])
        else:
            stop_id = plan.fields["stop_token_ids"][0]
            at = ch.token_ids.index(stop_id) if stop_id in ch.token_ids else None
        found = at is not None and at < limit
        # with min_tokens the sequence ends right at min_tokens (end tokens pushed)
        plan.cut.append(found and not cell.min_tokens)
        plan.held.append(found and cell.min_tokens and "stop" in plan.fields
                         and at < MIN_TOKENS)
    return plan


# ------------------------------------------------------------------ servers
class ServerPool:
    """``base`` for the whole module, plus one other config at a time (cells come
    grouped by server, so each starts once)."""

    def __init__(self, model_dir: Path, log_dir: Path, adapter_dir: Path) -> None:
        self.model_dir, self.log_dir = model_dir, log_dir
        self.lora_flags = ("--enable-lora", "--lora-modules", f"{ADAPTER}={adapter_dir}")
        self.base = self._start("base")
        self.current: tuple[str, CandorServer] | None = None

    def _start(self, name: str) -> CandorServer:
        env = no_run_ahead_env() if name == "sync" else None
        log = self.log_dir / f"{name}.log"
        lora = () if name in NO_LORA_SERVERS else self.lora_flags
        flags = [f.replace("{DRAFT_IS_TARGET}", str(self.model_dir)) for f in SERVERS[name]]
        if name == "eagle3":
            head = model_zoo.build_eagle3(self.log_dir / "eagle3-head", self.model_dir)
            flags = [f.replace("{EAGLE3_HEAD}", str(head)) for f in flags]
        srv = CandorServer(self.model_dir, *COMMON_FLAGS, *lora, *flags, env=env)
        return srv.start(timeout=300, log_path=log)

    def get(self, name: str) -> CandorServer:
        if name == "base":
            return self.base
        if self.current is None or self.current[0] != name:
            self.close_current()
            self.current = (name, self._start(name))
        return self.current[1]

    def log(self, name: str) -> str:
        return (self.log_dir / f"{name}.log").read_text()

    def close_current(self) -> None:
        if self.current is not None:
            name, srv = self.current
            self.current = None
            assert srv.stop() == 0, f"the {name} server did not stop cleanly"

    def close(self) -> None:
        self.close_current()
        assert self.base.stop() == 0


@pytest.fixture(scope="module")
def pool(tiny_model_dir, tmp_path_factory):
    from tests.support import lora_zoo
    adapter = lora_zoo.build_adapter(tiny_model_dir, tmp_path_factory.mktemp("lora") / ADAPTER,
                                     rank=8, alpha=16, seed=29)
    servers = ServerPool(tiny_model_dir, tmp_path_factory.mktemp("interaction-logs"), adapter)
    yield servers
    servers.close()


# ------------------------------------------------------------------ bystanders
BYSTANDERS = [
    {"model": MODEL, "prompt": "A quiet village sat at the edge of a great forest, where the "
     "children gathered every evening to hear the miller's stories about", "max_tokens": 40,
     "temperature": 0.0, "return_token_ids": True},
    {"model": MODEL, "messages": [{"role": "user", "content": "Name three birds of the "
                                                              "northern coast and their songs."}],
     "max_tokens": 40, "temperature": 0.0, "return_token_ids": True,
     "chat_template_kwargs": THINKING_OFF},
]
BLOCK = 16  # the KV block size (tokens)


def kv_filling_bystanders(cell: Cell, prompt_tokens: int) -> list[dict]:
    """On the tight-KV server: two long bystanders whose prompts (token ids) leave about
    two blocks free once the cell's prompt is in, so the blocks run out within a few
    tokens, while the cell, the last one admitted, runs: it is the one preempted (and if
    it came too late, the bystanders, which outgrow the cache alone, preempt each other)."""
    kv_blocks = int(SERVERS["preempt"][SERVERS["preempt"].index("--num-kv-blocks") + 1])
    cell_blocks = -(-prompt_tokens // BLOCK) + cell.n - 1  # choices share the prompt
    each = max(1, (kv_blocks - 2 - cell_blocks) // 2) * BLOCK
    grow = kv_blocks * BLOCK // 2  # two of these alone need more than the whole cache
    return [{"model": MODEL, "prompt": [6 + (37 * i + 101 * k) % 2000 for i in range(each)],
             "max_tokens": grow, "temperature": 0.0, "return_token_ids": True}
            for k in range(2)]


def client_session() -> aiohttp.ClientSession:
    return aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=CLIENT_TIMEOUT_S))


class Bystanders:
    """Ordinary requests sent beside a cell, and their solo references on base (each
    body computed once)."""

    def __init__(self, base: CandorServer) -> None:
        self.base = base
        self.refs: dict[str, Reply] = {}

    def bodies(self, cell: Cell | None, prompt_tokens: int) -> list[dict]:
        if cell is not None and cell.server == "preempt":
            return kv_filling_bystanders(cell, prompt_tokens)
        return BYSTANDERS

    async def references(self, http: aiohttp.ClientSession, bodies: list[dict]) -> list[Reply]:
        out = []
        for body in bodies:
            key = json.dumps(body, sort_keys=True)
            if key not in self.refs:
                ref = await send(http, self.base, body)
                assert ref.ok, f"a bystander failed alone on base: {ref.status} {ref.error}"
                self.refs[key] = ref
            out.append(self.refs[key])
        return out


@pytest.fixture(scope="module")
def bystanders(pool) -> Bystanders:
    return Bystanders(pool.base)


def bystander_problems(got: list[Reply], refs: list[Reply], atol: float) -> list[str]:
    out = []
    for k, (reply, ref) in enumerate(zip(got, refs)):
        if not reply.ok:
            out.append(f"bystander {k}: status {reply.status} {reply.error}")
        elif (d := choice_diff(reply.choices[0], ref.choices[0], False, atol)) is not None:
            out.append(f"bystander {k}: {d}")
    return out


# ------------------------------------------------------------------ one cell
@dataclass
class Outcome:
    problems: list[str]
    body: dict


async def run_cell(cell: Cell, pool: ServerPool, target: CandorServer,
                   bystanders: Bystanders) -> Outcome:
    body = build_body(cell)
    problems: list[str] = []
    conflict = next((c for c in CONFLICTS if holds(c.combo, cell.row)), None)

    def failure(what: str, reply: Reply) -> list[str]:
        """A reply that failed: a problem, unless the cell's conflict allows it."""
        if conflict is not None and refusal_problem(reply, conflict) is None:
            return []
        return [f"{what}: status {reply.status}: {reply.error}"]

    async with client_session() as http:
        stop = StopPlan(cut=[False] * cell.n, held=[False] * cell.n)
        if cell.stop != "none":
            stop = await plan_stop(http, pool.base, cell, body)
            body.update(stop.fields)
        refs = [await send(http, pool.base, single_choice(body, i)) for i in range(cell.n)]
        refs_ok = all(ref.ok for ref in refs)
        for i, ref in enumerate(refs):
            if not ref.ok:  # it fails alone; the cell still shows what it does to others
                problems += failure(f"reference {i} (alone on base)", ref)
                continue
            cached = ref.usage["prompt_tokens_details"]["cached_tokens"]
            assert cached == 0, f"reference {i} took a prefix hit of {cached} tokens"
        # text_offset is compared unless item 14 is still open for this kind of reply
        offsets = "text_offsets" not in cell.checks_off or not (
            cell.logprobs == "echo" or cell.stream)
        salt = uuid.uuid4().hex
        written = await asyncio.to_thread(store_written, target) \
            if cell.server == "store" else 0.0
        if cell.cache == "hit":  # the same request first, alone: its blocks get cached
            warm = await send(http, target, body, salt)
            if not warm.ok:
                problems += failure("cache warm-up", warm)
            elif refs_ok:
                problems += [f"cache warm-up: {d}"
                             for d in reply_diffs(warm, refs, offsets, logprob_atol(cell.server))]
            # its blocks reach the store write-behind (prompt logprobs: never cached)
            if cell.server == "store" and warm.ok and cell.logprobs not in (
                    "echo", "prompt_logprobs"):
                await asyncio.to_thread(store_written, target, written)
        prompt_tokens = refs[0].usage["prompt_tokens"] if refs[0].ok else 256
        others = bystanders.bodies(cell, prompt_tokens)
        other_refs = await bystanders.references(http, others)
        before = await asyncio.to_thread(target.engine_stats)
        moved = await asyncio.to_thread(kv_moved, target) if cell.server == "pd" else 0.0
        # bystanders first: the cell arrives last, so it is the one preempted
        tasks = [asyncio.create_task(send(http, target, b)) for b in others]
        tasks.append(asyncio.create_task(send(http, target, body, salt)))
        *other_replies, reply = await asyncio.gather(*tasks)
    after = await asyncio.to_thread(target.wait_all_blocks_free, 60)
    own_failures = 0  # sequences of the cell's own that a conflict may end with an error
    if not reply.ok:
        problems += failure("the cell", reply)
        own_failures = cell.n if conflict is not None else 0
    else:
        if refs_ok:
            problems += reply_diffs(reply, refs, offsets, logprob_atol(cell.server))
        problems += feature_problems(cell, body, reply, stop,
                                     conflict.waived if conflict is not None else "")
        cached = (reply.usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
        # prompt logprobs (echo's too) need every prompt position: never a hit
        whole_prompt = cell.logprobs in ("echo", "prompt_logprobs")
        if cell.cache == "hit" and not whole_prompt and not cached:
            problems.append("engine feature not in play: no prefix-cache hit reported")
        if whole_prompt and cached:
            problems.append(f"{cell.logprobs} took a prefix hit of {cached} tokens")
        if cell.server == "chunked" and reply.usage["prompt_tokens"] <= 16:
            problems.append("engine feature not in play: the prompt fits one chunk")
        # a grammar that spells keys or literal text forces tokens: once the answer got
        # there (past an unbounded <think> block, before a stop string), they were
        # drafted and kept
        if cell.server == "spec" and cell.constraint in SPELLED_GRAMMARS and any(
                ch.calls or ch.text.lstrip().startswith("{") for ch in reply.choices) and not (
                reply.speculative and reply.speculative["accepted"] > 0):
            problems.append("engine feature not in play: the grammar's forced tokens were "
                            f"not drafted and kept (candor.speculative: {reply.speculative})")
    problems += bystander_problems(other_replies, other_refs, logprob_atol(cell.server))
    failed = after["aborts"]["error"] - before["aborts"]["error"]
    if failed > own_failures:
        problems.append(f"{failed} request(s) ended by a failed step, the cell's own: "
                        f"{own_failures}")
    if cell.server == "preempt" and after["preemptions"] == before["preemptions"]:
        problems.append("engine feature not in play: nothing was preempted")
    if cell.server == "pd" and await asyncio.to_thread(kv_moved, target) == moved:
        problems.append("engine feature not in play: no prompt KV moved to the decode replica")
    return Outcome(problems, body)


def store_written(srv: CandorServer, past: float | None = None) -> float:
    """Blocks written into the KV store so far; with ``past``, once more than that."""
    def written() -> float:
        return scrape(srv).total("candor_kv_store_written_blocks_total")
    if past is None:
        return written()
    return wait_until(written, "the warm-up's blocks in the KV store",
                      until=lambda n: n > past, timeout=30)


def kv_moved(srv: CandorServer) -> float:
    """Prompt KV bytes decode replicas received so far (disaggregation)."""
    return scrape(srv).total("candor_kv_transfer_bytes_total", direction="received")


# ------------------------------------------------------------------ the tests
def test_covering_array_covers_every_allowed_pair():
    from tests.support.pairwise import allowed_pairs
    names = list(FACTORS)
    rows = covering_array(FACTORS, allowed)
    assert rows == covering_array(FACTORS, allowed), "not deterministic"
    assert all(allowed(r) for r in rows)
    seen = set()
    for r in rows:
        idx = [FACTORS[n].index(r[n]) for n in names]
        seen |= {(i, idx[i], j, idx[j]) for i in range(len(names))
                 for j in range(i + 1, len(names))}
    missing = set(allowed_pairs(FACTORS, allowed)) - seen
    assert not missing, sorted(missing)[:10]
    full = every_pair(FACTORS, allowed)
    assert len(rows) < len(full) / 4, (len(rows), len(full))
    for known in KNOWN:
        assert not any(known.check is None and known.matches(r) for r in rows), known
    cells = [p.values[0] for p in _cells(False)]
    for server in MIRRORED:  # the mirror's own engine feature: hits through the store
        assert any(c.server == server and c.cache == "hit" and c.logprobs not in (
            "echo", "prompt_logprobs") for c in cells), f"{server}: no cell takes a hit"
    assert {c.server for c in cells if c.adapter} == set(SERVERS) - set(NO_LORA_SERVERS)


def test_conflict_refusals_follow_the_policy():
    """A conflicting combination may be refused (a 400 naming one of its fields, or an
    error for that request alone, in OpenAI's shape); anything else is a problem."""
    conflict = CONFLICTS[0]

    def error(status: int, param: str | None) -> Reply:
        return Reply(status, error={"error": {"message": "m", "type": "t", "param": param,
                                              "code": "c"}})
    assert refusal_problem(error(400, "min_tokens"), conflict) is None
    assert refusal_problem(error(400, "guided_choice"), conflict) is None
    assert refusal_problem(error(500, None), conflict) is None  # that request alone
    assert refusal_problem(error(400, "temperature"), conflict) is not None
    assert refusal_problem(Reply(500, error="Internal Server Error"), conflict) is not None
    assert refusal_problem(Reply(200, error={"detail": "x"}), conflict) is not None


def test_request_features_are_engaged(pool):
    """Each request feature changes the base request's output: a cell that holds it
    exercises it (a penalty that never binds could break on a cache hit unseen)."""
    plain = Cell(_completed({}))

    async def tokens(cell: Cell) -> list[int]:
        async with client_session() as http:
            r = await send(http, pool.base, build_body(cell))
        assert r.ok, r.error
        return r.choices[0].token_ids
    for endpoint in ("chat", "completions"):
        base = Cell({**plain.row, "endpoint": endpoint})
        want = asyncio.run(tokens(base))
        for name, value in [("penalty", "presence"), ("penalty", "frequency"),
                            ("penalty", "repetition"), ("logit_bias", True),
                            ("min_tokens", True), ("sampling", "seeded"), ("adapter", True)]:
            got = asyncio.run(tokens(Cell({**base.row, name: value})))
            assert got != want, f"{endpoint}: {name}={value} does not change the output"


def pytest_generate_tests(metafunc):
    full = metafunc.config.getoption("--full") or FULL_ENV
    if "cell" in metafunc.fixturenames:
        metafunc.parametrize("cell", _cells(full))
    if "vl_cell" in metafunc.fixturenames:
        metafunc.parametrize("vl_cell", _vl_cells(full))


def topology_problem(name: str, srv: CandorServer, log: str) -> str | None:
    """Why the server is not running its engine feature, or None."""
    status, health = srv.health()
    roles = [r.split("[")[0] for roles in health.get("nodes", {}).values() for r in roles]
    counts = {role: roles.count(role) for role in ("gpu_worker", "scheduler")}
    want = {"tp2": {"gpu_worker": 2, "scheduler": 1},
            "dp2": {"gpu_worker": 2, "scheduler": 2},
            "pd": {"gpu_worker": 2, "scheduler": 2},
            "store": {"gpu_worker": 2, "scheduler": 2}}.get(name, {"gpu_worker": 1,
                                                                "scheduler": 1})
    if status != 200 or counts != want:
        return f"{name}: /health {status}, processes {counts}, want {want}"
    if name in ("spec", "draft", "eagle3") and "spec_drafts" not in srv.engine_stats():
        return "speculative decoding is not on in the scheduler"
    if name == "sync" and "run-ahead off" not in log:
        return "the no-run-ahead hook did not load in the scheduler"
    return None


def test_interaction_cell(cell: Cell, pool, bystanders):
    target = pool.get(cell.server)
    assert (why := topology_problem(cell.server, target, pool.log(cell.server))) is None, why
    outcome = asyncio.run(run_cell(cell, pool, target, bystanders))
    assert not outcome.problems, "\n".join(
        [f"cell {cell.id}", f"body {json.dumps(outcome.body)}", *outcome.problems])


# ------------------------------------------------------------------ combination fuzz
@st.composite
def fuzz_requests(draw) -> dict[str, Any]:
    """A valid request drawing many fields at once (values the API accepts)."""
    chat = draw(st.booleans())
    body: dict[str, Any] = {"model": MODEL, "return_token_ids": True,
                            "max_tokens": draw(st.integers(1, 32))}
    if chat:
        body["messages"] = MESSAGES
        body["chat_template_kwargs"] = draw(st.sampled_from([{}, THINKING_OFF]))
    else:
        body["prompt"] = draw(st.sampled_from([PROMPT, PROMPT[:60], "x"]))
    if draw(st.booleans()):
        body["temperature"] = draw(st.sampled_from([0.0, 0.005, 0.7, 1.0, 1.8]))
    for name, strategy in [
            ("seed", st.integers(0, 2**31)),
            ("top_p", st.sampled_from([0.05, 0.5, 0.95, 1.0])),
            ("top_k", st.sampled_from([-1, 1, 5, 50])),
            ("min_p", st.sampled_from([0.0, 0.05, 0.5])),
            ("presence_penalty", st.sampled_from([-2.0, -0.5, 0.5, 2.0])),
            ("frequency_penalty", st.sampled_from([-2.0, 0.5, 2.0])),
            ("repetition_penalty", st.sampled_from([0.5, 1.0, 1.3, 2.0])),
            ("logit_bias", st.dictionaries(st.integers(0, 2047).map(str),
                                           st.sampled_from([-100.0, -5.0, 5.0, 100.0]),
                                           max_size=4)),
            ("min_tokens", st.integers(0, 12)),
            ("stop", st.lists(st.sampled_from(["e", " the", "\n", "a", "ing", "</", "x"]),
                              max_size=3)),
            ("stop_token_ids", st.lists(st.integers(0, 2047), max_size=3)),
            ("n", st.integers(1, 3)),
            ("cache_salt", st.sampled_from(["shared-a", "shared-b"])),
            ("priority", st.sampled_from([-5, 0, 3])),
            ("include_stop_str_in_output", st.booleans()),
            ("skip_special_tokens", st.booleans()),
            ("ignore_eos", st.booleans())]:
        if draw(st.booleans()):
            body[name] = draw(strategy)
    mode = draw(st.sampled_from(["none", "prompt_logprobs", "logprobs"]
                                + ([] if chat else ["echo"])))
    if mode == "prompt_logprobs":
        body["prompt_logprobs"] = draw(st.integers(0, 3))
    elif mode == "logprobs":
        body.update({"logprobs": True, "top_logprobs": draw(st.integers(0, 3))} if chat
                    else {"logprobs": draw(st.integers(0, 3))})
    elif mode == "echo":
        body.update(echo=True, logprobs=draw(st.integers(0, 2)))
    kinds = ["none", "json_schema", "regex", "choice", "json_object"]
    if chat:
        kinds += list(TOOL_CONSTRAINTS)
    constraint = draw(st.sampled_from(kinds))
    if constraint != "none":
        body.pop("ignore_eos", None)  # documented 400 with a constraint
    if constraint in ("json_schema", "json_object"):
        body["response_format"] = {"type": "json_object"} if constraint == "json_object" else {
            "type": "json_schema", "json_schema": {"name": "e", "schema": JSON_SCHEMA}}
    elif constraint == "regex":
        body["guided_regex"] = draw(st.sampled_from([REGEX, "[0-9]{2,5}", "(ab)+c?"]))
    elif constraint == "choice":
        body["guided_choice"] = draw(st.sampled_from([CHOICES, ["a"], ["long answer here"]]))
    elif constraint in TOOL_CONSTRAINTS:
        body.update(constraint_fields(constraint))
        if draw(st.booleans()):
            body["parallel_tool_calls"] = False
    if draw(st.booleans()) and "prompt_logprobs" not in body:
        body.update(stream=True, stream_options={"include_usage": draw(st.booleans())})
    return body


def _fuzz_settings(fn):
    return settings(max_examples=FUZZ_EXAMPLES, deadline=None,
                    database=None, derandomize=True,
                    suppress_health_check=list(HealthCheck))(fn)


@pytest.fixture(scope="module")
def fuzz_target(pool):
    """The last server of the matrix (the tight-KV one): preemption, prefix hits and
    run-ahead are all in play."""
    return pool.get(list(SERVERS)[-1])


@_fuzz_settings
@given(body=fuzz_requests())
def test_combination_fuzz(body, fuzz_target, bystanders):
    """Valid combinations of many fields beside ordinary traffic: never a 5xx (nor an
    error frame in a stream) but the policy's own (a constraint that must end before
    min_tokens ends that request alone), bystanders whole, no failed step, every KV
    block free."""
    async def once():
        async with client_session() as http:
            refs = await bystanders.references(http, BYSTANDERS)
            tasks = [asyncio.create_task(send(http, fuzz_target, b)) for b in BYSTANDERS]
            tasks.append(asyncio.create_task(send(http, fuzz_target, body, body.get(
                "cache_salt"))))
            return refs, await asyncio.gather(*tasks)
    before = fuzz_target.engine_stats()
    refs, (*others, reply) = asyncio.run(once())
    after = fuzz_target.wait_all_blocks_free(60)
    problems = []
    err = reply.error.get("error") if isinstance(reply.error, dict) else None
    conflict = isinstance(err, dict) and err.get("code") == "constraint_conflict"
    if (reply.status >= 500 or (reply.status == 200 and reply.error is not None)) and not conflict:
        problems.append(f"status {reply.status}: {reply.error}")
    if reply.status >= 400 and reply.status < 500 or conflict:
        if not err or set(err) != {"message", "type", "param", "code"}:
            problems.append(f"a {reply.status} not in OpenAI's error shape: {reply.error}")
    problems += bystander_problems(others, refs, logprob_atol(list(SERVERS)[-1]))
    if after["aborts"]["error"] != before["aborts"]["error"]:
        problems.append("a step failed")
    assert not problems, "\n".join([f"body {json.dumps(body)}", *problems])


# ------------------------------------------------------------------ images (a LLaVA server)
VL_MODEL = "tiny-vl"  # (either family's checkpoint is served under it)
VL_PREEMPT_BLOCKS = 24
VL_SERVERS: dict[str, tuple[str, ...]] = {
    "base": (),
    "chunked": ("--max-num-batched-tokens", "16"),  # every image span (16 tokens) is split
    "preempt": ("--num-kv-blocks", str(VL_PREEMPT_BLOCKS)),
    "tp2": ("--tensor-parallel-size", "2"),
    "pd": ("--prefill-replicas", "1", "--decode-replicas", "1", "--max-num-batched-tokens", "64"),
    "spec": ("--speculative-config", json.dumps({
        "method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1,
        "prompt_lookup_max": 3})),
    # Gemma 3: a chunk boundary would fall inside images (4 tokens each) at 16
    "gemma3-chunked": ("--max-num-batched-tokens", "16"),
    "gemma3-preempt": ("--num-kv-blocks", str(VL_PREEMPT_BLOCKS)),
    # Qwen2-VL: images of 2x3 tokens split over 16-token chunks at M-RoPE positions; a
    # preempted image recomputed at the same positions; the decode replica's M-RoPE delta
    "qwen2vl-chunked": ("--max-num-batched-tokens", "16"),
    "qwen2vl-preempt": ("--num-kv-blocks", str(VL_PREEMPT_BLOCKS)),
    "qwen2vl-pd": ("--prefill-replicas", "1", "--decode-replicas", "1",
                   "--max-num-batched-tokens", "64"),
}
VL_FAMILY = {"gemma3-chunked": "gemma3", "gemma3-preempt": "gemma3",  # else llava
             "qwen2vl-chunked": "qwen2_vl", "qwen2vl-preempt": "qwen2_vl", "qwen2vl-pd": "qwen2_vl"}
VL_FACTORS: dict[str, list[Any]] = {
    "server": list(VL_SERVERS),
    "images": [1, 2, 0],
    "cache": ["miss", "hit"],
    "n": [1, 2],
    "stream": [False, True],
    "sampling": ["greedy", "seeded"],
    "penalty": ["none", "repetition"],
    "min_tokens": [False, True],
    "logprobs": ["none", "top_logprobs", "prompt_logprobs"],
}


def vl_valid(row: Mapping[str, Any]) -> bool:
    return not (row.get("logprobs") == "prompt_logprobs" and row.get("stream") is True)


def _vl_image(seed: int) -> str:
    import base64
    import io

    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(seed)
    img = Image.fromarray(rng.integers(0, 256, (30 + seed % 7, 40, 3), dtype=np.uint8), "RGB")
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def _vl_messages(images: int, seed: int = 0, text: str = QUESTION) -> list[dict]:
    parts: list[dict] = [{"type": "text", "text": text}]
    parts += [{"type": "image_url", "image_url": {"url": _vl_image(seed + k)}} for k in range(images)]
    return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": parts}]


@dataclass(frozen=True)
class VlCell:
    row: dict[str, Any]

    def __getattr__(self, name: str) -> Any:
        try:
            return self.row[name]
        except KeyError:
            raise AttributeError(name) from None

    @property
    def id(self) -> str:
        first = {name: values[0] for name, values in VL_FACTORS.items()}
        return "-".join(["vl", str(self.row["server"])] + [
            name if value is True else f"{name}={value}" for name, value in self.row.items()
            if name != "server" and value != first[name]])


def _vl_cells(full: bool) -> list:
    rows = (every_pair if full else covering_array)(VL_FACTORS, vl_valid)
    order = list(VL_SERVERS)
    rows.sort(key=lambda r: order.index(r["server"]))
    return [pytest.param(VlCell(r), id=VlCell(r).id) for r in rows]


def vl_body(cell: VlCell) -> dict[str, Any]:
    body: dict[str, Any] = {"model": VL_MODEL, "messages": _vl_messages(cell.images),
                            "max_tokens": 24, "ignore_eos": True, "return_token_ids": True}
    if cell.sampling == "greedy":
        body["temperature"] = 0.0
    else:
        body.update(temperature=1.0, seed=zlib.crc32(cell.id.encode()) % 100_000)
    if cell.penalty == "repetition":
        body["repetition_penalty"] = 1.8
    if cell.min_tokens:
        body["min_tokens"] = MIN_TOKENS
    if cell.logprobs == "top_logprobs":
        body.update(logprobs=True, top_logprobs=3)
    elif cell.logprobs == "prompt_logprobs":
        body["prompt_logprobs"] = 2
    if cell.n > 1:
        body["n"] = cell.n
    if cell.stream:
        body.update(stream=True, stream_options={"include_usage": True})
    return body


VL_BYSTANDERS = [
    {"model": VL_MODEL, "messages": _vl_messages(1, seed=50, text="Describe the colours."),
     "max_tokens": 30, "temperature": 0.0, "return_token_ids": True},
    {"model": VL_MODEL, "messages": [{"role": "user", "content": "Name three birds."}],
     "max_tokens": 30, "temperature": 0.0, "return_token_ids": True},
]


def vl_bystanders(cell: VlCell, prompt_tokens: int) -> list[dict]:
    """As ``kv_filling_bystanders`` on the LLaVA preempt server (the cell, admitted last,
    is the one preempted: its image's span is recomputed); the ordinary two elsewhere."""
    if not cell.server.endswith("preempt"):
        return VL_BYSTANDERS
    cell_blocks = -(-prompt_tokens // BLOCK) + cell.n - 1
    each = max(1, (VL_PREEMPT_BLOCKS - 2 - cell_blocks) // 2) * BLOCK
    grow = VL_PREEMPT_BLOCKS * BLOCK // 2
    return [{"model": VL_MODEL, "prompt": [6 + (37 * i + 101 * k) % 2000 for i in range(each)],
             "max_tokens": grow, "temperature": 0.0, "return_token_ids": True}
            for k in range(2)]


class VlPool:
    """Each family's ``base`` (started at its family's first cell), plus one other config
    at a time."""

    def __init__(self, log_dir: Path) -> None:
        self.log_dir = log_dir
        self.dirs: dict[str, Path] = {}
        self.bases: dict[str, CandorServer] = {}
        self.current: tuple[str, CandorServer] | None = None
        self.refs: dict[tuple[str, str], Reply] = {}

    def model_dir(self, family: str) -> Path:
        if family not in self.dirs:
            if family == "gemma3":
                from tests.support.gemma3_vision_zoo import build_gemma3_vision as build
            elif family == "qwen2_vl":
                from tests.support.qwen2_vl_zoo import build_qwen2_vl as build
            else:
                from tests.support.vision_zoo import build_llava as build
            self.dirs[family] = build(self.log_dir / f"model-{family}")
        return self.dirs[family]

    def _start(self, name: str, family: str) -> CandorServer:
        srv = CandorServer(self.model_dir(family), "--served-model-name", VL_MODEL,
                           *VL_SERVERS.get(name, ()))
        return srv.start(timeout=300, log_path=self.log_dir / f"vl-{name}.log")

    def base_of(self, family: str) -> CandorServer:
        if family not in self.bases:
            self.bases[family] = self._start("base" if family == "llava" else f"{family}-base",
                                             family)
        return self.bases[family]

    def get(self, name: str) -> CandorServer:
        if name == "base":
            return self.base_of("llava")
        if self.current is None or self.current[0] != name:
            if self.current is not None:
                assert self.current[1].stop() == 0
            self.current = None
            self.current = (name, self._start(name, VL_FAMILY.get(name, "llava")))
        return self.current[1]

    async def reference(self, http: aiohttp.ClientSession, body: dict, family: str = "llava") -> Reply:
        key = (family, json.dumps(body, sort_keys=True))
        if key not in self.refs:
            self.refs[key] = await send(http, self.base_of(family), body)
        return self.refs[key]

    def close(self) -> None:
        if self.current is not None:
            assert self.current[1].stop() == 0
        for base in self.bases.values():
            assert base.stop() == 0


@pytest.fixture(scope="module")
def vl_pool(tmp_path_factory):
    pool = VlPool(tmp_path_factory.mktemp("vl"))
    yield pool
    pool.close()


async def run_vl_cell(cell: VlCell, pool: VlPool, target: CandorServer) -> list[str]:
    body = vl_body(cell)
    problems: list[str] = []
    atol = logprob_atol(cell.server)
    family = VL_FAMILY.get(cell.server, "llava")
    async with client_session() as http:
        refs = [await pool.reference(http, single_choice(body, i), family) for i in range(cell.n)]
        if not all(r.ok for r in refs):
            return [f"reference alone on base: {[(r.status, r.error) for r in refs]}"]
        salt = uuid.uuid4().hex
        if cell.cache == "hit":
            warm = await send(http, target, body, salt)
            problems += ([f"cache warm-up: {warm.status} {warm.error}"] if not warm.ok
                         else [f"cache warm-up: {d}" for d in reply_diffs(warm, refs, False, atol)])
        others = vl_bystanders(cell, refs[0].usage["prompt_tokens"])
        other_refs = [await pool.reference(http, b, family) for b in others]
        before = await asyncio.to_thread(target.engine_stats)
        tasks = [asyncio.create_task(send(http, target, b)) for b in others]
        tasks.append(asyncio.create_task(send(http, target, body, salt)))
        *other_replies, reply = await asyncio.gather(*tasks)
    after = await asyncio.to_thread(target.wait_all_blocks_free, 60)
    if not reply.ok:
        problems.append(f"the cell: status {reply.status}: {reply.error}")
    else:
        problems += reply_diffs(reply, refs, False, atol)
        cached = (reply.usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
        if cell.cache == "hit" and cell.logprobs != "prompt_logprobs" and not cached:
            problems.append("engine feature not in play: no prefix-cache hit reported")
    problems += bystander_problems(other_replies, other_refs, atol)
    if after["aborts"]["error"] != before["aborts"]["error"]:
        problems.append("a step failed")
    if cell.server.endswith("preempt") and after["preemptions"] == before["preemptions"]:
        problems.append("engine feature not in play: nothing was preempted")
    return problems


def test_image_cells_cover_every_pair():
    rows = covering_array(VL_FACTORS, vl_valid)
    from tests.support.pairwise import allowed_pairs
    names = list(VL_FACTORS)
    seen = {(i, VL_FACTORS[names[i]].index(r[names[i]]), j, VL_FACTORS[names[j]].index(r[names[j]]))
            for r in rows for i in range(len(names)) for j in range(i + 1, len(names))}
    assert not set(allowed_pairs(VL_FACTORS, vl_valid)) - seen
    assert {r["images"] for r in rows} == {0, 1, 2}


def test_image_interaction_cell(vl_cell: VlCell, vl_pool):
    target = vl_pool.get(vl_cell.server)
    problems = asyncio.run(run_vl_cell(vl_cell, vl_pool, target))
    assert not problems, "\n".join([f"cell {vl_cell.id}", *problems])
