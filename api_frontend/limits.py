"""Fan-out bounds of one request (``ApiSpec.limits``), checked before any work is done.

Each breach is a 400 whose ``param`` is the field and whose message names the limit, so a
client can tell a deployment's bound from a malformed value. The queue share keeps one
request from taking the engine's whole waiting queue: a request whose choices could never
fit in its share is refused outright (a retry would not help), not shed with a 503.
"""

from __future__ import annotations

from api_frontend.errors import ApiError
from cluster.topology import RequestLimits
from protocol.openai_api import ChatCompletionRequest, CompletionRequest


def _over(field: str, count: int, limit: int, what: str, limit_name: str) -> ApiError:
    return ApiError(400, f"`{field}` has {count} {what}; this deployment allows at most "
                    f"{limit} ({limit_name})", field, "limit_exceeded")


def check_fields(req: CompletionRequest | ChatCompletionRequest, limits: RequestLimits) -> None:
    """Every per-field bound; cheap (lengths only), so it runs before anything else."""
    if req.n > limits.max_n:
        raise ApiError(400, f"`n` is {req.n}; this deployment allows at most {limits.max_n} "
                       "choices per request (max_n)", "n", "limit_exceeded")
    stops = [req.stop] if isinstance(req.stop, str) else (req.stop or [])
    if len(stops) > limits.max_stop_strings:
        raise _over("stop", len(stops), limits.max_stop_strings, "stop strings",
                    "max_stop_strings")
    for i, stop in enumerate(stops):
        if len(stop) > limits.max_stop_string_chars:
            raise ApiError(400, f"stop string {i} has {len(stop)} characters; this "
                           f"deployment allows at most {limits.max_stop_string_chars} "
                           "(max_stop_string_chars)", "stop", "limit_exceeded")
    if req.stop_token_ids and len(req.stop_token_ids) > limits.max_stop_token_ids:
        raise _over("stop_token_ids", len(req.stop_token_ids), limits.max_stop_token_ids,
                    "ids", "max_stop_token_ids")
    if req.logit_bias and len(req.logit_bias) > limits.max_logit_bias:
        raise _over("logit_bias", len(req.logit_bias), limits.max_logit_bias, "entries",
                    "max_logit_bias")
    if isinstance(req, ChatCompletionRequest):
        if len(req.messages) > limits.max_messages:
            raise _over("messages", len(req.messages), limits.max_messages, "messages",
                        "max_messages")
        if req.tools is not None and len(req.tools) > limits.max_tools:
            raise _over("tools", len(req.tools), limits.max_tools, "tools", "max_tools")
        field, k = "top_logprobs", req.top_logprobs
    else:
        field, k = "logprobs", req.logprobs
        if isinstance(req.prompt, list) and req.prompt and not isinstance(req.prompt[0], int):
            if len(req.prompt) > limits.max_prompts:
                raise _over("prompt", len(req.prompt), limits.max_prompts, "prompts",
                            "max_prompts")
    for field, k in ((field, k), ("prompt_logprobs", req.prompt_logprobs)):
        if k is not None and k > limits.max_logprobs:
            raise ApiError(400, f"`{field}` is {k}; this deployment returns at most "
                           f"{limits.max_logprobs} alternatives per token (max_logprobs)",
                           field, "limit_exceeded")


def queue_share(limits: RequestLimits, max_waiting: int) -> int | None:
    """How many queued sequences one request may take (None: the queue is unbounded)."""
    if not max_waiting:
        return None
    return max(1, int(max_waiting * limits.max_request_share))


def check_share(sequences: int, limits: RequestLimits, max_waiting: int, field: str) -> None:
    """400 when a request's sequences (n x prompts) exceed its share of the waiting queue."""
    share = queue_share(limits, max_waiting)
    if share is not None and sequences > share:
        raise ApiError(400, f"this request asks for {sequences} sequences (n x prompts); one "
                       f"request may take at most {share} of the engine's waiting queue "
                       f"(max_request_share {limits.max_request_share:g} of {max_waiting})",
                       field, "limit_exceeded")
