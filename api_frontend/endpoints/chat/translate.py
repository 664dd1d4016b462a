"""A /v1/chat/completions body -> its GenerateReq: the generation pipeline's part
(``api_frontend.translate``) plus messages, the chat template's switches, tools and the
reasoning parser."""

from __future__ import annotations

import msgspec

from api_frontend import local_media, reasoning
from api_frontend.endpoints.chat.fields import TABLE
from api_frontend.errors import ApiError
from api_frontend.media_fetch import is_remote, refusal, shown
from api_frontend.tools import tool_plan
from api_frontend.translate import Translated, checked, common, constraint, translated
from cluster.topology import ApiSpec, RequestLimits
from protocol import ipc
from protocol.openai_api import ChatCompletionRequest


def logprobs_k(req: ChatCompletionRequest) -> tuple[int, int]:
    """(logprobs, prompt_logprobs): ``top_logprobs`` alternatives when ``logprobs`` is
    true, and only then."""
    prompt_k = -1 if req.prompt_logprobs is None else req.prompt_logprobs
    if req.top_logprobs is not None and not req.logprobs:
        raise ApiError(400, "`top_logprobs` requires `logprobs: true`", "top_logprobs",
                       "invalid_value")
    return (req.top_logprobs or 0) if req.logprobs else -1, prompt_k


def _check_image_url(image_url: object, param: str, limits: RequestLimits) -> None:
    """The URL's shape only (DESIGN: images are decoded in the tokenizer worker): an object
    with a string ``url``: a data: URL, an http(s) URL on a host of the operator's
    allow-list (``--allowed-media-domains``) or a file:// URL when local files are on
    (``--allowed-local-media-path``); the frontend reads the last two before submitting
    (``media_fetch``)."""
    url = image_url.get("url") if isinstance(image_url, dict) else None
    if not isinstance(url, str):
        raise ApiError(400, "an image_url part needs `image_url: {\"url\": ...}`", param,
                       "invalid_value")
    if is_remote(url) or local_media.is_local(url):
        remote = is_remote(url)
        why = (refusal(url, limits.allowed_media_domains) if remote
               else local_media.refusal(url, limits.allowed_local_media_path))
        if why is not None:
            raise ApiError(400, f"the image URL {shown(url)} is not "
                           f"{'fetched' if remote else 'read'}: {why}",
                           f"{param}.url", "unsupported_image_url")
        return
    if not url.startswith("data:"):
        raise ApiError(400, "an image URL must be a data: URL (data:image/png;base64,...), "
                       "an http(s) URL on a host this deployment allows "
                       "(--allowed-media-domains) or a file:// URL under its "
                       "--allowed-local-media-path", f"{param}.url", "invalid_value")


def _check_content(req: ChatCompletionRequest, api: ApiSpec, vision: bool) -> None:
    """Each message's parts: text always; ``image_url`` (a data: URL) when the model takes
    images, at most ``limits.max_images_per_prompt`` of them; anything else a 400 naming
    the part."""
    images = 0
    for i, message in enumerate(req.messages):
        if message.role in ("system", "developer", "user") and not (
                message.content or message.content == ""):
            raise ApiError(400, f"a {message.role} message needs `content` (a string or a "
                           "list of text parts)", f"messages[{i}].content", "invalid_value")
        if not isinstance(message.content, list):
            continue
        for j, part in enumerate(message.content):
            if part.type == "image_url":
                _check_image_url(part.image_url, f"messages[{i}].content[{j}].image_url",
                                 api.limits)
                if vision:
                    images += 1
                    limit = api.limits.max_images_per_prompt
                    if images > limit:
                        raise ApiError(400, f"`messages` holds more than {limit} images; this "
                                       f"deployment takes at most {limit} per prompt "
                                       "(--limit-mm-per-prompt, max_images_per_prompt)",
                                       f"messages[{i}].content[{j}]", "limit_exceeded")
                    continue
            if part.type != "text" or part.text is None:
                served = "'text' and 'image_url'" if vision else "'text'"
                raise ApiError(400, f"content part type {part.type!r} is not supported by "
                               f"this {'model' if vision else 'text-only model'} (only {served} "
                               "parts are)", f"messages[{i}].content[{j}].type",
                               "unsupported_content")


def chat_to_generate(req: ChatCompletionRequest, rid: str, reply_to: str, arrival: float,
                     raw_keys: list[str] = (), api: ApiSpec | None = None, *,
                     vision: bool = False) -> Translated:
    """``vision``: the served model takes images (``image_url`` parts pass on to the
    tokenizer worker, which decodes them)."""
    api = api or ApiSpec()
    report = checked(req, raw_keys, api, TABLE)
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
    _check_content(req, api, vision)
    if req.max_completion_tokens is not None:
        max_tokens, field = req.max_completion_tokens, "max_completion_tokens"
    else:
        max_tokens, field = req.max_tokens, "max_tokens"
    messages = [msgspec.to_builtins(m) for m in req.messages]
    plan = tool_plan(req, api)
    guided = constraint(req, plan, report)
    fields = common(req, rid, reply_to, arrival, report, logprobs_k)
    parser = plan.parser()
    if parser is not None:
        report.tool_parser = parser.name
        if parser.special_markers and "skip_special_tokens" not in raw_keys:
            # the parser's tags are special tokens: they must reach the text to be read
            fields["detok"] = msgspec.structs.replace(fields["detok"], skip_special_tokens=False)
    gen = ipc.GenerateReq(
        messages=messages, tools=plan.tools, add_generation_prompt=req.add_generation_prompt,
        continue_final_message=req.continue_final_message,
        chat_template_kwargs=dict(req.chat_template_kwargs or {}),
        max_tokens=max_tokens, max_tokens_field=field, chat_template=req.chat_template,
        guided=guided, **fields)
    out = translated([gen], req, report)
    out.tools = plan
    if api.reasoning_parser is not None and reasoning.get(api.reasoning_parser).active(
            gen.chat_template_kwargs):
        out.reasoning = report.reasoning_parser = api.reasoning_parser
        if gen.guided is not None:  # the constraint applies to the answer after <think>
            gen.guided = msgspec.structs.replace(gen.guided, reasoning=api.reasoning_parser)
    return out
