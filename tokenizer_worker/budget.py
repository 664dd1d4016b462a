"""Context-budget checks: the policy table's answer is a 400 with the accounting, never
a silent clamp. ``max_tokens`` omitted means "the rest of the context"."""

from __future__ import annotations

from protocol.ipc import RequestError


def resolve_max_tokens(rid: str, prompt_tokens: int, requested: int | None, field: str,
                       max_model_len: int) -> int | RequestError:
    if prompt_tokens >= max_model_len:
        return RequestError(
            rid, 400,
            f"This model's maximum context length is {max_model_len} tokens, and the "
            f"prompt has {prompt_tokens} tokens, which leaves no room to generate. "
            "Shorten the prompt.",
            param="messages" if field == "max_completion_tokens" else "prompt",
            code="context_length_exceeded")
    if requested is None:
        return max_model_len - prompt_tokens
    if prompt_tokens + requested > max_model_len:
        return RequestError(
            rid, 400,
            f"This model's maximum context length is {max_model_len} tokens. You asked "
            f"for {prompt_tokens + requested} tokens: {prompt_tokens} in the prompt and "
            f"{requested} in `{field}`. Lower `{field}` to at most "
            f"{max_model_len - prompt_tokens}, or shorten the prompt.",
            param=field, code="context_length_exceeded")
    return requested
