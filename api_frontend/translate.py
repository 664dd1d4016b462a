"""The generation pipeline's translation, shared by chat and completions: sampling,
detokenization, scheduling and the one constraint of a request -> the parts of its
GenerateReq, after its endpoint's field table has decided each field's tier (the
``candor`` report, strict mode, the 400 for unsupported fields) and ``limits`` its bounds.
Each endpoint adds its own part (``endpoints/chat/translate.py``: messages and tools;
``endpoints/completions/translate.py``: prompts and echo).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import msgspec

from api_frontend import limits
from api_frontend.constraints import guided_spec
from api_frontend.errors import ApiError
from api_frontend.field_policy import FieldTable
from api_frontend.tools import ToolPlan
from cluster.topology import ApiSpec
from protocol import ipc
from protocol.openai_api import (INT64_MIN, TOKEN_ID_MAX, CandorReport, ChatCompletionRequest,
                                 CompletionRequest)


# an endpoint's reading of its logprobs fields: (logprobs, prompt_logprobs) for the sampler,
# -1 = none, k = top-k alternatives (a 400 for a combination it does not take)
LogprobsK = Callable[[Any], tuple[int, int]]


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


def checked(req: CompletionRequest | ChatCompletionRequest, raw_keys: list[str],
            api: ApiSpec, table: FieldTable) -> CandorReport:
    """The checks both endpoints start with (limits, ``priority`` only under priority
    scheduling, the field policy, prompt_logprobs without streaming: vLLM's
    ``prompt_logprobs`` comes only in a whole response); the report so far."""
    limits.check_fields(req, api.limits)
    if req.priority != 0 and not api.priority_scheduling:
        raise ApiError(400, "`priority` needs priority scheduling, which this deployment does "
                       "not run: waiting requests are served in arrival order (start the "
                       "server with --scheduling-policy priority to honour it)", "priority",
                       "unsupported_field")
    report = table.report(raw_keys, req, api)
    if req.prompt_logprobs is not None and req.stream:
        raise ApiError(400, "`prompt_logprobs` is not available with `stream: true`",
                       "prompt_logprobs", "invalid_value")
    return report


def _sampling(req: CompletionRequest | ChatCompletionRequest, report: CandorReport,
              logprobs_k: LogprobsK) -> ipc.SamplingParams:
    """The request's sampling fields; one it omitted takes the deployment's default
    (``report.defaults``, from the checkpoint's generation_config.json) where there is
    one, else the API's."""
    logprobs, prompt_logprobs = logprobs_k(req)
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


def common(req: CompletionRequest | ChatCompletionRequest, rid: str, reply_to: str,
           arrival: float, report: CandorReport, logprobs_k: LogprobsK) -> dict[str, Any]:
    """The GenerateReq fields both endpoints fill alike."""
    _check_stream_options(req)
    strict = report.strict
    return dict(rid=rid, reply_to=reply_to, sampling=_sampling(req, report, logprobs_k),
                detok=_detok(req),
                stop_token_ids=list(req.stop_token_ids or []), ignore_eos=req.ignore_eos,
                min_tokens=req.min_tokens, arrival_time=arrival, priority=req.priority,
                cache_salt=req.cache_salt, strict=strict)


def translated(gens: list[ipc.GenerateReq], req, report: CandorReport) -> Translated:
    return Translated(gens, req.n, req.n > 1 and gens[0].sampling.temperature == 0, report)


def constraint(req: CompletionRequest | ChatCompletionRequest, plan: ToolPlan | None,
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
