"""Constrained decoding through the running server, with random weights: every output
matches its constraint (response_format json_schema / json_object, guided_json,
guided_regex, guided_choice, guided_grammar, structured_outputs), with n > 1, seeds,
logprobs, stop strings, streaming and preemption; what the engine cannot enforce is a
400 naming the field before anything is generated."""

from __future__ import annotations

import asyncio
import json
import re

import jsonschema
import openai
import pytest

from protocol.ipc import GuidedSpec
from tests.support.server import CandorServer

MODEL = "tiny-llama"
MESSAGES = [{"role": "user", "content": "Describe a person as JSON."}]
PERSON = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 10},
    "age": {"type": "integer", "minimum": 0, "maximum": 120},
    "role": {"enum": ["admin", "user", "guest"]},
    "tags": {"type": "array", "items": {"type": "string", "maxLength": 5}, "maxItems": 3},
    "active": {"type": "boolean"}},
    "required": ["name", "age", "role", "active"], "additionalProperties": False}
FORMAT = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON,
                                                 "strict": True}}


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0)


def _chat(client, **kwargs):
    return client.chat.completions.create(model=MODEL, messages=MESSAGES, **kwargs)


@pytest.mark.parametrize("seed", range(6))
def test_json_schema_always_validates(client, seed):
    r = _chat(client, response_format=FORMAT, max_tokens=400, seed=seed, n=2, logprobs=True)
    for choice in r.choices:
        assert choice.finish_reason == "stop"
        jsonschema.validate(json.loads(choice.message.content), PERSON)
        # one entry per token, the final end-of-sequence token included
        assert len(choice.logprobs.content) > 1
        assert all(e.logprob <= 0 for e in choice.logprobs.content)
    assert r.model_extra["candor"]["constraint"] == "response_format.json_schema.schema"


def test_seeded_constrained_output_is_reproducible(client):
    a = _chat(client, response_format=FORMAT, max_tokens=400, seed=11)
    b = _chat(client, response_format=FORMAT, max_tokens=400, seed=11)
    assert a.choices[0].message.content == b.choices[0].message.content


def test_streamed_json_schema_validates(client):
    text = "".join(c.choices[0].delta.content or "" for c in _chat(
        client, response_format=FORMAT, max_tokens=400, seed=3, stream=True) if c.choices)
    jsonschema.validate(json.loads(text), PERSON)


def test_json_object(client):
    r = _chat(client, response_format={"type": "json_object"}, max_tokens=600, seed=2,
              extra_body={"structured_outputs": None})
    if r.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(r.choices[0].message.content), dict)
    else:  # an unbounded object may run out of tokens; what there is still starts one
        assert r.choices[0].message.content.startswith("{")


@pytest.mark.parametrize("body,check", [
    ({"guided_json": json.dumps(PERSON)},
     lambda t: jsonschema.validate(json.loads(t), PERSON) is None),
    ({"guided_regex": r"(cat|dog)-[0-9]{3}"},
     lambda t: re.fullmatch(r"(cat|dog)-[0-9]{3}", t) is not None),
    ({"guided_choice": ["alpha", "beta", "gamma delta"]},
     lambda t: t in ("alpha", "beta", "gamma delta")),
    ({"guided_grammar": 'start: ("yes" | "no") " " /[0-9]{2}/'},
     lambda t: re.fullmatch(r"(yes|no) [0-9]{2}", t) is not None),
    ({"guided_grammar": 'root ::= "x" [a-c]+ "!"'},
     lambda t: re.fullmatch(r"x[a-c]+!", t) is not None),
    ({"structured_outputs": {"choice": ["on", "off"]}}, lambda t: t in ("on", "off")),
    ({"structured_outputs": {"regex": r"[A-Z]{4}"}},
     lambda t: re.fullmatch(r"[A-Z]{4}", t) is not None),
    ({"structured_outputs": {"json": PERSON}},
     lambda t: jsonschema.validate(json.loads(t), PERSON) is None),
])
@pytest.mark.parametrize("seed", range(3))
def test_each_guided_field_is_enforced(client, body, check, seed):
    r = _chat(client, max_tokens=400, seed=seed, extra_body=body)
    assert r.choices[0].finish_reason == "stop"
    assert check(r.choices[0].message.content), r.choices[0].message.content


def test_completions_honour_constraints(client):
    r = client.completions.create(model=MODEL, prompt="Pet:", max_tokens=50, seed=1, n=3,
                                  extra_body={"guided_regex": r"(cat|dog)-[0-9]{3}"})
    for choice in r.choices:
        assert re.fullmatch(r"(cat|dog)-[0-9]{3}", choice.text), choice.text


def test_stop_string_cuts_constrained_output(client):
    r = _chat(client, max_tokens=50, stop=["b"], extra_body={"guided_regex": "a{5}b{5}"})
    assert r.choices[0].message.content == "aaaaa" and r.choices[0].finish_reason == "stop"


def test_temperature_zero_and_logit_bias_cannot_break_the_constraint(client):
    """Greedy, and a bias that pushes every output towards one token: the mask wins."""
    r = _chat(client, max_tokens=30, temperature=0, n=2, logit_bias={"33": 100},
              extra_body={"guided_choice": ["left", "right"]})
    assert {c.message.content for c in r.choices} <= {"left", "right"}


@pytest.mark.parametrize("body,param,code", [
    ({"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "array", "uniqueItems": True}}}},
     "response_format.json_schema.schema", "unsupported_constraint"),
    ({"guided_json": {"type": "object", "properties": {"a": {"not": {"type": "string"}}}}},
     "guided_json", "unsupported_constraint"),
    ({"guided_regex": "(unclosed"}, "guided_regex", "unsupported_constraint"),
    ({"guided_grammar": "start: undefined_rule"}, "guided_grammar", "unsupported_constraint"),
    ({"guided_choice": []}, "guided_choice", "invalid_value"),
    ({"guided_regex": "a", "guided_choice": ["a"]}, "guided_choice", "invalid_value"),
    ({"structured_outputs": {"structural_tag": "x"}}, "structured_outputs.structural_tag",
     "unsupported_field"),
    ({"guided_json": {"type": "object"}, "guided_whitespace_pattern": " *"},
     "guided_whitespace_pattern", "unsupported_field"),
    ({"response_format": {"type": "xml"}}, "response_format.type", "invalid_value"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
     "response_format.json_schema.schema", "invalid_value"),
])
def test_unenforceable_constraints_are_400s_naming_the_field(client, body, param, code):
    with pytest.raises(openai.BadRequestError) as err:
        _chat(client, max_tokens=5, extra_body=body)
    assert (err.value.body["param"], err.value.body["code"]) == (param, code), err.value.body


@pytest.fixture(scope="module")
def tight_server(tiny_model_dir):
    """Too few KV blocks for four constrained requests at once: some are preempted."""
    srv = CandorServer(tiny_model_dir, "--served-model-name", MODEL, "--max-model-len", "1024",
                       "--num-kv-blocks", "14", "--max-num-seqs", "4",
                       "--max-num-batched-tokens", "64").start()
    yield srv
    assert srv.stop() == 0


BOOLS = {"type": "array", "items": {"type": "boolean"}, "minItems": 24, "maxItems": 24}


async def test_constraint_survives_preemption_with_the_same_tokens(tight_server):
    client = openai.AsyncOpenAI(base_url=tight_server.base_url + "/v1", api_key="unused",
                                max_retries=0)
    prompts = [f"Request {i}: " + "list some truth values please " * (3 + 2 * i)
               for i in range(4)]

    async def one(i):
        return await client.completions.create(model=MODEL, prompt=prompts[i], max_tokens=100,
                                               seed=i, extra_body={"guided_json": BOOLS})
    alone = [await one(i) for i in range(4)]
    together = await asyncio.gather(*[one(i) for i in range(4)])
    for a, b in zip(alone, together):
        jsonschema.validate(json.loads(b.choices[0].text), BOOLS)
        assert a.choices[0].text == b.choices[0].text
    tight_server.wait_all_blocks_free(what="a preemption (the KV cache was sized for one)",
                                      until=lambda s: s["preemptions"] > 0)


@pytest.mark.parametrize("seed", range(3))
def test_unlisted_keys_are_not_generated(client, seed):
    """A schema that does not forbid additional properties still gets only its own keys
    (as vLLM's default engine does); the output validates against the schema as sent."""
    open_schema = {"type": "object", "properties": {"ok": {"type": "boolean"}},
                   "required": ["ok"]}
    r = _chat(client, max_tokens=100, seed=seed, extra_body={"guided_json": open_schema})
    assert r.choices[0].finish_reason == "stop"
    assert set(json.loads(r.choices[0].message.content)) == {"ok"}


@pytest.mark.parametrize("parser", ["deepseek_r1", "qwen3"])
@pytest.mark.parametrize("kind,spec,good", [
    ("json_schema", json.dumps({"type": "object", "properties": {"a": {"type": "integer"}},
                                "required": ["a"]}), '{"a":12}'),
    ("choice", json.dumps(["yes", "no"]), "yes"),
    ("regex", "[0-9]{3}", "123"),
    ("grammar", 'start: "x" /[a-c]+/', "xab"),
])
def test_constraint_applies_after_the_reasoning_block(tiny_model_dir, parser, kind, spec, good):
    """With a reasoning parser, the <think> block is free (it may hold '<' and partial
    tags) and ends at the first </think>; the answer after it is constrained."""
    import llguidance

    from tokenization.grammar_vocab import build_tokenizer
    from tokenizer_worker.grammar import GrammarCompiler
    from tokenization.tokenizer_files import CheckpointTokenizer
    tok = CheckpointTokenizer(tiny_model_dir)
    compiler = GrammarCompiler(build_tokenizer(tok.backend.to_str(), tok.vocab_size,
                                               tok.eos_token_ids))
    grammar = compiler.compile(GuidedSpec(kind, spec, "f", parser))
    opening = "<think>" if parser == "qwen3" else ""

    def accepts(text: str) -> bool:
        matcher = llguidance.LLMatcher(compiler.tokenizer, grammar)
        return (matcher.consume_tokens(tok.encode(text, add_special_tokens=False))
                and matcher.is_accepting())
    assert accepts(f"{opening}a <b </thin x</think>\n\n{good}")
    assert not accepts(f"{opening}thinking</think>\n\nzzz")
    assert not accepts(f"{opening}never closed {good}")


def test_a_cached_rejection_names_each_callers_own_field(tiny_model_dir):
    """The compile cache is shared by every route: a schema refused for /v1/responses
    (`text.format.schema`) and then sent to chat as `guided_json` names `guided_json`
    (CI once saw the first caller's field in the second caller's error)."""
    from tokenization.grammar_vocab import build_tokenizer
    from tokenization.tokenizer_files import CheckpointTokenizer
    from tokenizer_worker.grammar import GrammarCompiler, GrammarError
    tok = CheckpointTokenizer(tiny_model_dir)
    compiler = GrammarCompiler(build_tokenizer(tok.backend.to_str(), tok.vocab_size,
                                               tok.eos_token_ids))
    schema = '{"type": "object", "properties": {"a": {"not": {"type": "string"}}}}'
    for field in ("text.format.schema", "guided_json", "text.format.schema"):
        with pytest.raises(GrammarError) as err:
            compiler.compile(GuidedSpec("json_schema", schema, field, None))
        assert err.value.param == field and str(err.value).startswith(f"`{field}`")


@pytest.mark.parametrize("kind, spec, longest", [
    ("choice", '["yes", "nope", "ü"]', 4),
    ("json_schema", '{"type": "boolean"}', 5),
    ("json_schema", '{"type": ["null", "boolean"]}', 5),
    ("json_schema", '{"enum": [true, null]}', 4),
    ("json_schema", '{"const": false}', 5),
    ("json_schema", '{"enum": ["a", "b"]}', None),  # a string's spellings are not counted
    ("json_schema", '{"type": "integer", "maximum": 9}', None),
    ("regex", "(yes|no)", None),
])
def test_longest_output_is_known_only_where_it_is_certain(kind, spec, longest):
    """What decides the up-front 400 for a constraint that must end before min_tokens:
    a bound only where every spelling is known, never a guess."""
    from tokenizer_worker.grammar import longest_output_bytes

    assert longest_output_bytes(GuidedSpec(kind, spec, "f")) == longest
    assert longest_output_bytes(GuidedSpec(kind, spec, "f", reasoning="qwen3")) is None
