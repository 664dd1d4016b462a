"""OpenAI request bodies -> GenerateReq: sampling, detokenization, prompts, tools and
constraints, after ``field_policy`` has decided each field's tier (the ``candor`` report,
strict mode, the 400 for unsupported fields) and ``limits`` its bounds.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import msgspec

from api_frontend import field_policy, limits, reasoning
from api_frontend.constraints import guided_spec
from api_frontend.errors import ApiError
from api_frontend.tools import ToolPlan, tool_plan
from cluster.topology import ApiSpec
from protocol import ipc
from protocol.openai_api import (INT64_MIN, TOKEN_ID_MAX, CandorReport, ChatCompletionRequest,
                                 CompletionRequest)


def _choice_seed(seed: int, i: int) -> int:
    """seed + i, wrapped into int64 so the sum still crosses the process boundary."""
    return (seed + i - INT64_MIN) % 2**64 + INT64_MIN


@dataclass
class Translated:
    """A request ready to submit: one GenerateReq per prompt, ``n`` choices per prompt,
    whether one computation serves a prompt's n choices (n > 1 at temperature 0), and the
    report so far. Choice ``p * n + i`` is the i-th sample of prompt p."""

    gens: list[ipc.GenerateReq]
    n: int
    compute_once: bool
    report: CandorReport
    choices: dict[str, list[int]] = field(default_factory=dict)  # rid -> its choice indexes
    tools: ToolPlan | None = None  # chat: how tool calls are read from the text
    reasoning: str | None = None  # chat: the reasoning parser that splits the text

    @property
    def gen(self) -> ipc.GenerateReq:
        return self.gens[0]

    @property
    def num_choices(self) -> int:
        return len(self.gens) * self.n

    def choice_reqs(self) -> list[ipc.GenerateReq]:
        """One GenerateReq per computed sequence (fills ``choices``); seeded choices get
        seed + index so the n samples differ yet stay reproducible."""
        self.choices = {}
        if self.num_choices == 1:
            self.choices[self.gen.rid] = [0]
            return [self.gen]
        out = []
        for p, gen in enumerate(self.gens):
            first = p * self.n
            if self.compute_once:
                req = msgspec.structs.replace(gen, rid=f"{gen.rid}-{first}")
                self.choices[req.rid] = list(range(first, first + self.n))
                out.append(req)
                continue
            for i in range(self.n):
                sampling = gen.sampling
                if sampling.seed is not None:
                    sampling = msgspec.structs.replace(sampling,
                                                       seed=_choice_seed(sampling.seed, i))
                req = msgspec.structs.replace(gen, rid=f"{gen.rid}-{first + i}",
                                              sampling=sampling)
                self.choices[req.rid] = [first + i]
                out.append(req)
        return out


def _check_stream_options(req: CompletionRequest | ChatCompletionRequest) -> None:
    if req.stream_options is not None and not req.stream:
        raise ApiError(400, "`stream_options` is only allowed when `stream` is true",
                       "stream_options", "invalid_value")


def _logit_bias(req: CompletionRequest | ChatCompletionRequest) -> list[tuple[int, float]]:
    out = []
    for key, bias in (req.logit_bias or {}).items():
        try:
            token_id = int(key)
        except ValueError:
            token_id = -1
        if not 0 <= token_id <= TOKEN_ID_MAX:
            raise ApiError(400, f"`logit_bias` keys must be token ids (0..{TOKEN_ID_MAX}), "
                           f"got {key[:40]!r}", "logit_bias", "invalid_value")
        if bias != 0.0:
            out.append((token_id, float(bias)))
    return out


def _logprobs(req: CompletionRequest | ChatCompletionRequest) -> tuple[int, int]:
    """(logprobs, prompt_logprobs) for the sampler: -1 = none, k = top-k alternatives.
    Completions' echo + logprobs and ``prompt_logprobs`` share one prompt computation
    at the larger k; the response trims each to its own."""
    prompt_k = -1 if req.prompt_logprobs is None else req.prompt_logprobs
    if isinstance(req, ChatCompletionRequest):
        if req.top_logprobs is not None and not req.logprobs:
            raise ApiError(400, "`top_logprobs` requires `logprobs: true`", "top_logprobs",
                           "invalid_value")
        return (req.top_logprobs or 0) if req.logprobs else -1, prompt_k
    k = -1 if req.logprobs is None else req.logprobs
    return k, max(prompt_k, k if req.echo and k >= 0 else -1)


def _checked(req: CompletionRequest | ChatCompletionRequest, raw_keys: list[str],
             api: ApiSpec) -> CandorReport:
    """The checks both endpoints start with (limits, ``priority`` only under priority
    scheduling, the field policy, prompt_logprobs without streaming: vLLM's
    ``prompt_logprobs`` comes only in a whole response); the report so far."""
    limits.check_fields(req, api.limits)
    if req.priority != 0 and not api.priority_scheduling:
        raise ApiError(400, "`priority` needs priority scheduling, which this deployment does "
                       "not run: waiting requests are served in arrival order (start the "
                       "server with --scheduling-policy priority to honour it)", "priority",
                       "unsupported_field")
    report = field_policy.report(raw_keys, req, api)
    if req.prompt_logprobs is not None and req.stream:
        raise ApiError(400, "`prompt_logprobs` is not available with `stream: true`",
                       "prompt_logprobs", "invalid_value")
    return report


def _sampling(req: CompletionRequest | ChatCompletionRequest,
              report: CandorReport) -> ipc.SamplingParams:
    """The request's sampling fields; one it omitted takes the deployment's default
    (``report.defaults``, from the checkpoint's generation_config.json) where there is
    one, else the API's."""
    logprobs, prompt_logprobs = _logprobs(req)
    d = {note.field: note.to for note in report.defaults}
    top_k = req.top_k if "top_k" not in d else d["top_k"]
    return ipc.SamplingParams(
        temperature=d.get("temperature", 1.0 if req.temperature is None else req.temperature),
        top_p=d.get("top_p", 1.0 if req.top_p is None else req.top_p),
        top_k=-1 if top_k in (None, 0) else top_k,
        seed=req.seed, presence_penalty=req.presence_penalty,
        frequency_penalty=req.frequency_penalty,
        repetition_penalty=d.get("repetition_penalty", req.repetition_penalty),
        min_p=d.get("min_p", req.min_p), logit_bias=_logit_bias(req), logprobs=logprobs,
        prompt_logprobs=prompt_logprobs)


def _detok(req: CompletionRequest | ChatCompletionRequest) -> ipc.DetokParams:
    stop = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
    return ipc.DetokParams(stop=stop, include_stop_str_in_output=req.include_stop_str_in_output,
                           skip_special_tokens=req.skip_special_tokens,
                           return_token_ids=req.return_token_ids,
                           min_tokens=req.min_tokens or 0)


def _common(req: CompletionRequest | ChatCompletionRequest, rid: str, reply_to: str,
            arrival: float, report: CandorReport) -> dict[str, Any]:
    _check_stream_options(req)
    strict = report.strict
    return dict(rid=rid, reply_to=reply_to, sampling=_sampling(req, report),
                detok=_detok(req),
                stop_token_ids=list(req.stop_token_ids or []), ignore_eos=req.ignore_eos,
                min_tokens=req.min_tokens, arrival_time=arrival, priority=req.priority,
                cache_salt=req.cache_salt, strict=strict)


def _translated(gens: list[ipc.GenerateReq], req, report: CandorReport) -> Translated:
    return Translated(gens, req.n, req.n > 1 and gens[0].sampling.temperature == 0, report)


def prompt_list(req: CompletionRequest) -> list[str | list[int]]:
    """``prompt`` as a list of prompts: a string, a list of token ids, a list of strings
    or a list of token-id lists (one kind, every prompt non-empty)."""
    prompt = req.prompt
    if isinstance(prompt, str) or not prompt or all(isinstance(p, int) for p in prompt):
        prompts = [prompt]
    else:
        if len({type(p) for p in prompt}) != 1:
            raise ApiError(400, "`prompt` must be a string, a list of token ids, a list of "
                           "strings or a list of token-id lists, not a mix", "prompt",
                           "invalid_value")
        prompts = list(prompt)
    for i, p in enumerate(prompts):
        if not p:
            where = "prompt" if len(prompts) == 1 else f"prompt[{i}]"
            raise ApiError(400, f"`{where}` must not be empty", where, "invalid_value")
    return prompts


# The legacy completions contract documents a default of 16 tokens; chat's default is
# "until the context is full", which is what None means downstream.
COMPLETIONS_DEFAULT_MAX_TOKENS = 16


def completion_to_generate(req: CompletionRequest, rid: str, reply_to: str, arrival: float,
                           raw_keys: list[str] = (), api: ApiSpec | None = None) -> Translated:
    api = api or ApiSpec()
    report = _checked(req, raw_keys, api)
    prompts = prompt_list(req)
    max_tokens = COMPLETIONS_DEFAULT_MAX_TOKENS if req.max_tokens is None else req.max_tokens
    common = _common(req, rid, reply_to, arrival, report)
    guided = _constraint(req, None, report)
    gens = [ipc.GenerateReq(prompt=p, max_tokens=max_tokens, echo_prompt=req.echo,
                            guided=guided, **common) for p in prompts]
    return _translated(gens, req, report)


def chat_to_generate(req: ChatCompletionRequest, rid: str, reply_to: str, arrival: float,
                     raw_keys: list[str] = (), api: ApiSpec | None = None) -> Translated:
    api = api or ApiSpec()
    report = _checked(req, raw_keys, api)
    if req.chat_template is not None and not api.allow_request_chat_template:
        raise ApiError(400, "`chat_template` in a request is disabled on this deployment "
                       "(start the server with --allow-request-chat-template)",
                       "chat_template", "unsupported_field")
    if not req.messages:
        raise ApiError(400, "`messages` must contain at least one message", "messages",
                       "invalid_value")
    if req.add_generation_prompt and req.continue_final_message:
        raise ApiError(400, "`add_generation_prompt` and `continue_final_message` cannot "
                       "both be true", "continue_final_message", "invalid_value")
    for i, message in enumerate(req.messages):
        if message.role in ("system", "developer", "user") and not (
                message.content or message.content == ""):
            raise ApiError(400, f"a {message.role} message needs `content` (a string or a "
                           "list of text parts)", f"messages[{i}].content", "invalid_value")
        if isinstance(message.content, list):
            for j, part in enumerate(message.content):
                if part.type != "text" or part.text is None:
                    raise ApiError(400, f"content part type {part.type!r} is not supported "
                                   "by this text-only model (only 'text' parts are)",
                                   f"messages[{i}].content[{j}].type", "unsupported_content")
    if req.max_completion_tokens is not None:
        max_tokens, field = req.max_completion_tokens, "max_completion_tokens"
    else:
        max_tokens, field = req.max_tokens, "max_tokens"
    messages = [msgspec.to_builtins(m) for m in req.messages]
    plan = tool_plan(req, api)
    guided = _constraint(req, plan, report)
    common = _common(req, rid, reply_to, arrival, report)
    parser = plan.parser()
    if parser is not None:
        report.tool_parser = parser.name
        if parser.special_markers and "skip_special_tokens" not in raw_keys:
            # the parser's tags are special tokens: they must reach the text to be read
            common["detok"] = msgspec.structs.replace(common["detok"], skip_special_tokens=False)
    gen = ipc.GenerateReq(
        messages=messages, tools=plan.tools, add_generation_prompt=req.add_generation_prompt,
        continue_final_message=req.continue_final_message,
        chat_template_kwargs=dict(req.chat_template_kwargs or {}),
        max_tokens=max_tokens, max_tokens_field=field, chat_template=req.chat_template,
        guided=guided, **common)
    out = _translated([gen], req, report)
    out.tools = plan
    if api.reasoning_parser is not None and reasoning.get(api.reasoning_parser).active(
            gen.chat_template_kwargs):
        out.reasoning = report.reasoning_parser = api.reasoning_parser
        if gen.guided is not None:  # the constraint applies to the answer after <think>
            gen.guided = msgspec.structs.replace(gen.guided, reasoning=api.reasoning_parser)
    return out


def _constraint(req: CompletionRequest | ChatCompletionRequest, plan: ToolPlan | None,
                report: CandorReport) -> ipc.GuidedSpec | None:
    """The one grammar this request decodes under (tool_choice required/named or an
    output format), recorded in the report."""
    guided = guided_spec(req)
    if plan is not None and plan.guided is not None:
        if guided is not None:
            raise ApiError(400, f"`{guided.field}` cannot be combined with tool_choice "
                           f"{plan.mode!r}, which already constrains the output", guided.field,
                           "invalid_value")
        guided = plan.guided
    if guided is not None and req.ignore_eos:
        raise ApiError(400, "`ignore_eos` cannot be combined with a constraint: a finished "
                       "grammar allows only the end-of-sequence token", "ignore_eos",
                       "invalid_value")
    if guided is not None:
        report.constraint = guided.field
    return guided
