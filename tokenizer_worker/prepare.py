"""GenerateReq -> TokenizedReq + RequestInfo (or a RequestError): template, tokenize, budget.

Everything the worker decides on the client's behalf (which template, a clamp, a template
kwarg the template never reads) is recorded as an ``Adjustment`` in the RequestInfo that
goes back to the frontend; in strict mode each of those is a 400 instead.
"""

from __future__ import annotations

import json
from collections import OrderedDict
from pathlib import Path

import msgspec

from cluster.topology import ApiSpec
from protocol import ipc
from tokenization.chat_template import ChatTemplate, ChatTemplateError
from tokenization.grammar_vocab import build_tokenizer
from tokenization.template_source import load_server_template
from tokenization.tokenizer_files import CheckpointTokenizer
from tokenizer_worker.budget import resolve_max_tokens
from tokenizer_worker.content_format import detect_content_format, flatten_content
from tokenizer_worker.deadline import time_limit
from tokenizer_worker.grammar import GrammarCompiler, GrammarError, longest_output_bytes
from tokenizer_worker.images import ImageError, ImageLimits
from tokenizer_worker.length_bound import TokenLengthBound, utf8_len
from tokenizer_worker.score_prompt import PAIR_PROMPTS
from tokenizer_worker.text_offsets import token_starts
from tokenizer_worker.tool_arguments import (ArgumentsError, arguments_as_objects,
                                              detect_arguments_format)
from tokenizer_worker.vision import VisionPrompt, image_parts

_REQUEST_TEMPLATE_CACHE = 32
# /tokenize counts documents longer than the context (lm-eval's rolling windows), up to this
# many contexts' worth; past it the text is refused before it is tokenized.
TOKENIZE_CONTEXTS = 16
# Names the renderer binds itself; a chat_template_kwargs entry may not override them.
# ``documents`` has no top-level field here, so the kwarg is passed through as the argument.
_RESERVED_KWARGS = {
    "messages": "messages", "tools": "tools", "add_generation_prompt": "add_generation_prompt",
    "continue_final_message": "continue_final_message", "chat_template": "chat_template",
    "special_tokens": None, "max_output_bytes": None,
}


def _read_json_object(path: Path) -> dict:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


class _Rejected(Exception):
    def __init__(self, error: ipc.RequestError) -> None:
        super().__init__(error.message)
        self.error = error


class _Prompt(msgspec.Struct):
    ids: list[int]
    text: str | None
    template: ipc.TemplateInfo | None
    adjustments: list[ipc.Adjustment]
    images: list[ipc.ImageInput] = []  # pixels and placeholder spans, in prompt order


class RequestPreparer:
    def __init__(self, tokenizer: CheckpointTokenizer, max_model_len: int,
                 api: ApiSpec | None = None, model_vocab_size: int | None = None,
                 pair_format: str | None = None, vision: VisionPrompt | None = None) -> None:
        self.tokenizer = tokenizer
        # a decoder reranker's pair prompt (score_prompt.PAIR_PROMPTS; None: the tokenizer
        # pairs the two texts, as a cross-encoder's does)
        self.pair_prompt = PAIR_PROMPTS[pair_format] if pair_format is not None else None
        # a model that takes images: its HF preprocessing and placeholder expansion
        self.vision = vision
        self.max_model_len = max_model_len
        self.api = api or ApiSpec()
        # ids must exist both in the tokenizer and in the model's embedding
        self.vocab_size = min(tokenizer.vocab_size, model_vocab_size or tokenizer.vocab_size)
        self.bound = TokenLengthBound(tokenizer.backend)
        self.server_template: ChatTemplate | None = None
        if self.api.chat_template:
            self.server_template = load_server_template(self.api.chat_template,
                                                        self.api.limits.max_template_bytes)
        # UTF-8 bytes of the text the last request rendered or tokenized, so the caller can
        # hand memory back to the OS after a big one.
        self.last_text_bytes = 0
        self._request_templates: OrderedDict[str, ChatTemplate] = OrderedDict()
        self._formats: OrderedDict[str, tuple[str, str]] = OrderedDict()
        self._model_vocab = model_vocab_size or tokenizer.vocab_size
        self._grammars: GrammarCompiler | None = None  # built at the first constrained request

    # ------------------------------------------------------------------ helpers

    def _fail(self, req: ipc.GenerateReq | ipc.PoolReq, message: str, param: str | None,
              code: str) -> None:
        raise _Rejected(ipc.RequestError(req.rid, 400, message, param=param, code=code))

    def _template(self, req: ipc.GenerateReq) -> tuple[ChatTemplate | None, str]:
        """Request template > server flag > checkpoint (HF's tool_use / default choice)."""
        if req.chat_template is not None:
            template = self._request_templates.get(req.chat_template)
            size = utf8_len(req.chat_template)
            if template is None and size > self.api.limits.max_template_bytes:
                self._fail(req, f"chat_template is {size} bytes; this deployment accepts at most "
                           f"{self.api.limits.max_template_bytes} (limits.max_template_bytes)",
                           "chat_template", "chat_template_too_large")
            if template is None:
                try:
                    template = ChatTemplate(req.chat_template, origin="request")
                except ChatTemplateError as err:
                    self._fail(req, str(err), "chat_template", "chat_template_error")
                self._request_templates[req.chat_template] = template
                if len(self._request_templates) > _REQUEST_TEMPLATE_CACHE:
                    self._request_templates.popitem(last=False)
            return template, "request"
        if self.server_template is not None:
            return self.server_template, "server-flag"
        return self.tokenizer.chat_template(req.tools is not None), "checkpoint"

    def _formats_of(self, template: ChatTemplate) -> tuple[str, str]:
        """(content format, tool-call arguments format) the template reads, from its
        syntax tree; remembered for as many templates as the request-template cache."""
        formats = self._formats.get(template.sha256)
        if formats is None:
            formats = self._formats[template.sha256] = (
                detect_content_format(template.source), detect_arguments_format(template.source))
            if len(self._formats) > 2 * _REQUEST_TEMPLATE_CACHE:
                self._formats.popitem(last=False)
        return formats

    def _images(self, req: ipc.GenerateReq, messages: list[dict]) -> tuple[list[dict], list]:
        """The messages with image parts as the template's, and the decoded images; a bad
        image (or any image, for a model that takes none) is a 400 naming its part."""
        if self.vision is None:
            for i, message in enumerate(messages):
                content = message.get("content")
                for j, part in enumerate(content if isinstance(content, list) else []):
                    if isinstance(part, dict) and part.get("type") == "image_url":
                        self._fail(req, "this model takes no images", f"messages[{i}].content[{j}]",
                                   "unsupported_content")
            return messages, []
        limits = self.api.limits
        try:
            return image_parts(messages, ImageLimits(limits.max_image_bytes, limits.max_image_pixels))
        except ImageError as err:
            self._fail(req, str(err), err.param, err.code)

    def _name_dropped_image(self, req: ipc.GenerateReq, messages: list[dict],
                            render) -> None:
        """A 400 naming the first image part the chat template leaves out of the prompt
        (one a template cannot place, as an image in a tool message where its template
        renders tool content as text). Found by rendering each image alone beside the
        text: the error path only. Nothing found: the count check in ``_expand`` says it."""
        token = self.vision.image_token
        at = [(i, j) for i, m in enumerate(messages)
              for j, p in enumerate(m["content"] if isinstance(m.get("content"), list) else [])
              if isinstance(p, dict) and p.get("type") == "image"]

        def keeping(keep: tuple[int, int] | None) -> list[dict]:
            return [{**m, "content": [p for j, p in enumerate(m["content"])
                                      if (i, j) == keep or not (isinstance(p, dict)
                                                                and p.get("type") == "image")]}
                    if isinstance(m.get("content"), list) else m
                    for i, m in enumerate(messages)]

        spelled = render(keeping(None)).count(token)  # the text's own, if any
        for i, j in at:
            if render(keeping((i, j))).count(token) == spelled:
                where = f"messages[{i}].content[{j}]"
                role = messages[i].get("role")
                self._fail(req, f"{where}: the chat template does not place this image in the "
                           f"prompt (an image in a {role!r} message), so the model cannot see "
                           f"it; send it in a message the template renders images in",
                           where, "unsupported_content")

    def _expand(self, req: ipc.GenerateReq, ids: list[int], images: list,
                field: str) -> tuple[list[int], list[ipc.ImageInput]]:
        """Each image's placeholder repeated once per embedding it becomes, and its pixels;
        a placeholder the prompt spells without an image is refused."""
        if self.vision is None:
            return ids, []
        try:
            return self.vision.expand(ids, images)
        except ImageError as err:
            self._fail(req, str(err), field if err.param == "messages" else err.param, err.code)

    def _prompt_token_room(self, req: ipc.GenerateReq, tokenize_only: bool) -> int:
        """The most prompt tokens this request could have and still pass the budget check."""
        if tokenize_only:
            return TOKENIZE_CONTEXTS * self.max_model_len
        requested = req.max_tokens
        if (requested is None or requested >= self.max_model_len
                or (self.api.max_tokens_policy == "clamp" and not req.strict)):
            # a max_tokens that alone fills the context is the error to name: the budget
            # check after tokenizing reports it with both counts
            return self.max_model_len - 1
        return self.max_model_len - max(1, requested)

    def _too_long(self, req: ipc.GenerateReq, text_bytes: int, room: int,
                  tokenize_only: bool) -> None:
        field = "messages" if req.messages is not None else "prompt"
        what = "the rendered chat" if req.messages is not None else "the prompt"
        floor = self.bound.min_tokens(text_bytes)
        longest = self.bound.longest_token_bytes
        if tokenize_only:
            limit = (f"/tokenize counts at most {room} tokens ({TOKENIZE_CONTEXTS} times the "
                     f"context of {self.max_model_len})")
        elif req.max_tokens is not None and room != self.max_model_len - 1:
            limit = (f"This model's maximum context length is {self.max_model_len} tokens and "
                     f"`{req.max_tokens_field}` asks for {req.max_tokens}, which leaves "
                     f"{max(room, 0)} for the prompt")
        else:
            limit = (f"This model's maximum context length is {self.max_model_len} tokens, "
                     "which must leave room to generate")
        self._fail(req, f"{limit}; {what} has at least {floor} tokens ({text_bytes} bytes, and "
                   f"no token covers more than {longest} bytes). Shorten `{field}`.",
                   field, "context_length_exceeded")

    def _render(self, req: ipc.GenerateReq, tokenize_only: bool = False,
                add_special_tokens: bool | None = None) -> _Prompt:
        tok = self.tokenizer
        adjustments: list[ipc.Adjustment] = []
        room = self._prompt_token_room(req, tokenize_only)
        max_bytes = self.bound.max_bytes(room)
        if req.messages is not None:
            try:
                template, source = self._template(req)
            except ChatTemplateError as err:
                self._fail(req, str(err), "messages", "chat_template_error")
            if template is None:
                self._fail(req, "this model has no chat template; start the server with "
                           "--chat-template", "messages", "no_chat_template")
            kwargs = dict(req.chat_template_kwargs)
            for key in sorted(kwargs.keys() & _RESERVED_KWARGS.keys()):
                top = _RESERVED_KWARGS[key]
                self._fail(req, f"chat_template_kwargs.{key} is set by the server"
                           + (f"; use the top-level `{top}` field instead" if top else
                              " and may not be overridden"),
                           f"chat_template_kwargs.{key}", "invalid_value")
            unknown = sorted(k for k in kwargs if k not in template.declared_variables)
            if unknown:
                declared = sorted(template.declared_variables - {"messages", "tools", "documents",
                                                                 "add_generation_prompt"})
                reason = (f"the chat template does not read {unknown}; it declares "
                          f"{declared}")
                if req.strict:
                    self._fail(req, f"chat_template_kwargs: {reason} (strict mode)",
                               "chat_template_kwargs", "ignored_field")
                adjustments += [ipc.Adjustment(f"chat_template_kwargs.{k}", "ignored", reason)
                                for k in unknown]
                for k in unknown:
                    kwargs.pop(k)
            messages, images = self._images(req, req.messages)
            content_format, arguments_format = self._formats_of(template)
            documents = kwargs.pop("documents", None)

            def render(messages: list[dict]) -> str:
                if content_format == "string":
                    messages = flatten_content(messages)
                if arguments_format == "object":
                    try:
                        messages = arguments_as_objects(messages)
                    except ArgumentsError as err:
                        self._fail(req, str(err), err.param, "invalid_value")
                try:
                    with time_limit(self.api.limits.template_render_timeout_s):
                        return tok.render_chat(
                            messages, tools=req.tools, documents=documents,
                            add_generation_prompt=req.add_generation_prompt,
                            continue_final_message=req.continue_final_message,
                            chat_template=template, max_output_bytes=max_bytes, **kwargs)[0]
                except ChatTemplateError as err:
                    self._template_failed(req, source, err, room)

            text = render(messages)
            self.last_text_bytes = utf8_len(text)
            info = ipc.TemplateInfo(source, template.origin, template.sha256)
            special = False if add_special_tokens is None else add_special_tokens
            expanded = text
            if self.vision is not None:  # (Gemma 3 expands its image markers in the text)
                try:
                    expanded = self.vision.expand_text(text, images)
                except ImageError as err:
                    self._fail(req, str(err), "messages", err.code)
            ids = tok.encode(expanded, add_special_tokens=special)
            if images and ids.count(self.vision.image_token_id) < len(images):
                self._name_dropped_image(req, messages, render)
            ids, inputs = self._expand(req, ids, images, "messages")
            return _Prompt(ids, text, info, adjustments, inputs)
        if isinstance(req.prompt, str):
            size = self.last_text_bytes = utf8_len(req.prompt)
            if max_bytes is not None and size > max_bytes:
                self._too_long(req, size, room, tokenize_only)
            special = True if add_special_tokens is None else add_special_tokens
            ids, _ = self._expand(req, tok.encode(req.prompt, add_special_tokens=special), [],
                                  "prompt")
            return _Prompt(ids, req.prompt, None, [])
        ids = list(req.prompt or [])
        bad = [i for i in ids if not 0 <= i < self.vocab_size]
        if bad:
            self._fail(req, f"prompt token ids {bad[:5]} are outside the vocabulary "
                       f"(0..{self.vocab_size - 1})", "prompt", "invalid_token_id")
        ids, _ = self._expand(req, ids, [], "prompt")
        return _Prompt(ids, None, None, [])

    def _template_failed(self, req: ipc.GenerateReq, source: str, err: ChatTemplateError,
                         room: int) -> None:
        param = "chat_template" if source == "request" else "messages"
        owner = {"request": "the request's chat_template",
                 "server-flag": "the server's chat template (--chat-template)",
                 "checkpoint": "the model's chat template"}.get(source, "the chat template")
        if err.limit == "time":
            self._fail(req, f"{owner} took longer than "
                       f"{self.api.limits.template_render_timeout_s:g}s to render "
                       "(limits.template_render_timeout_s)", param, "chat_template_timeout")
        if err.limit == "value":
            self._fail(req, f"{owner} was stopped: {err}", param, "chat_template_too_large")
        if err.limit == "output":
            self._fail(req, f"{owner} rendered more text than fits the context: past "
                       f"{self.bound.max_bytes(room)} bytes the prompt has more than {room} "
                       f"tokens (no token covers more than {self.bound.longest_token_bytes} "
                       "bytes)", param, "context_length_exceeded")
        self._fail(req, f"the chat template could not render these messages: {err}",
                   "messages", "chat_template_error")

    def _max_tokens(self, req: ipc.GenerateReq, n_prompt: int,
                    adjustments: list[ipc.Adjustment]) -> int:
        requested = req.max_tokens
        room = self.max_model_len - n_prompt
        if (self.api.max_tokens_policy == "clamp" and not req.strict and requested is not None
                and room > 0 and requested > room):
            adjustments.append(ipc.Adjustment(
                req.max_tokens_field, "clamped",
                f"prompt ({n_prompt} tokens) + {req.max_tokens_field} exceeds the context of "
                f"{self.max_model_len} tokens (server --max-tokens-policy clamp)",
                from_=requested, to=room))
            return room
        out = resolve_max_tokens(req.rid, n_prompt, requested, req.max_tokens_field,
                                 self.max_model_len)
        if isinstance(out, ipc.RequestError):
            raise _Rejected(out)
        return out

    def _check_ids(self, req: ipc.GenerateReq) -> None:
        bad_stop = [i for i in req.stop_token_ids if not 0 <= i < self.vocab_size]
        if bad_stop:
            self._fail(req, f"stop_token_ids {bad_stop[:5]} are outside the vocabulary",
                       "stop_token_ids", "invalid_token_id")
        bad_bias = [i for i, _ in req.sampling.logit_bias if not 0 <= i < self.vocab_size]
        if bad_bias:
            self._fail(req, f"logit_bias token ids {bad_bias[:5]} are outside the vocabulary "
                       f"(0..{self.vocab_size - 1})", "logit_bias", "invalid_token_id")

    def _check_constraint_fits(self, req: ipc.GenerateReq) -> None:
        """A constraint whose every output ends before min_tokens tokens can never be met
        with the end held back until then: a 400 naming both, before any work (where that
        is not known up front, the request fails alone when it happens)."""
        if req.guided is None or req.min_tokens == 0:
            return
        longest = longest_output_bytes(req.guided)
        if longest is not None and longest < req.min_tokens:
            self._fail(req, f"`{req.guided.field}` allows at most {longest} bytes of output, so "
                       f"the sequence must end within {longest} tokens, but min_tokens "
                       f"({req.min_tokens}) holds the end back until {req.min_tokens} tokens: "
                       "both cannot hold; lower min_tokens or widen the constraint",
                       "min_tokens", "constraint_conflict")

    def _grammar(self, req: ipc.GenerateReq) -> str | None:
        if req.guided is None:
            return None
        if self._grammars is None:
            self._grammars = GrammarCompiler(build_tokenizer(
                self.tokenizer.backend.to_str(), self._model_vocab, self.tokenizer.eos_token_ids))
        try:
            return self._grammars.compile(req.guided)
        except GrammarError as err:
            self._fail(req, str(err), err.param, "unsupported_constraint")

    # ------------------------------------------------------------------ entry points

    def prepare(self, req: ipc.GenerateReq
                ) -> tuple[ipc.TokenizedReq, ipc.RequestInfo] | ipc.RequestError:
        try:
            return self._prepare(req)
        except _Rejected as rej:
            return rej.error

    def _prepare(self, req: ipc.GenerateReq) -> tuple[ipc.TokenizedReq, ipc.RequestInfo]:
        prompt = self._render(req)
        ids = prompt.ids
        if not ids:
            self._fail(req, "the prompt is empty after tokenization", "prompt", "empty_prompt")
        self._check_ids(req)
        max_tokens = self._max_tokens(req, len(ids), prompt.adjustments)
        if req.min_tokens > max_tokens:
            self._fail(req, f"min_tokens ({req.min_tokens}) is larger than the {max_tokens} "
                       "tokens this request may generate", "min_tokens", "invalid_value")
        self._check_constraint_fits(req)
        eos = self.tokenizer.eos_token_ids
        suppress = list(dict.fromkeys((([] if req.ignore_eos else eos) + req.stop_token_ids)))
        sampling = msgspec.structs.replace(
            req.sampling, num_prompt_tokens=len(ids), min_tokens=req.min_tokens,
            min_tokens_stop_ids=suppress if req.min_tokens > 0 else [],
            grammar=self._grammar(req))
        tokenized = ipc.TokenizedReq(
            rid=req.rid, reply_to=req.reply_to, prompt_token_ids=ids, max_tokens=max_tokens,
            sampling=sampling, detok=req.detok, eos_token_ids=eos,
            stop_token_ids=req.stop_token_ids, ignore_eos=req.ignore_eos,
            arrival_time=req.arrival_time, priority=req.priority,
            cache_salt=req.cache_salt, probe=req.probe, lora=req.lora,
            decode_replica=req.decode_replica, images=prompt.images)
        prompt_text = offsets = None
        if req.echo_prompt:
            prompt_text = (prompt.text if prompt.text is not None
                           else self.tokenizer.decode(ids, skip_special_tokens=False))
            if req.sampling.prompt_logprobs >= 0:  # text_offset of each echoed token
                offsets = token_starts(self.tokenizer.backend, ids, prompt_text)
        info = ipc.RequestInfo(req.rid, len(ids), prompt.template, prompt.adjustments,
                               prompt_text, offsets)
        return tokenized, info

    def prepare_pooling(self, req: ipc.PoolReq
                        ) -> tuple[ipc.TokenizedReq, ipc.RequestInfo] | ipc.RequestError:
        """One embedding input: tokenized as the checkpoint's tokenizer does by default
        (its special tokens added, as sentence-transformers does), at most the whole
        context (nothing is generated after it); never truncated. Errors name ``input``
        (the frontend names the index)."""
        pooling = req.pooling
        try:
            if req.pair is not None:
                ids, second = self._pair_ids(req)
                pooling = msgspec.structs.replace(pooling, second_segment=second)
            else:
                ids = self._pooling_ids(req)
        except _Rejected as rej:
            return rej.error
        tokenized = ipc.TokenizedReq(
            rid=req.rid, reply_to=req.reply_to, prompt_token_ids=ids, max_tokens=1,
            sampling=ipc.SamplingParams(), detok=ipc.DetokParams(),
            arrival_time=req.arrival_time, priority=req.priority, pooling=pooling,
            probe=req.probe)
        return tokenized, ipc.RequestInfo(req.rid, len(ids))

    def _pair_ids(self, req: ipc.PoolReq) -> tuple[list[int], int | None]:
        """A text pair as the checkpoint's tokenizer pairs them (BERT: [CLS] a [SEP] b
        [SEP]), and where its token type 1 starts (None: the tokenizer gives none, as
        RoBERTa's); a decoder reranker's pair written into its prompt, a whole chat turn
        tokenized without added special tokens (``score_prompt``). Never truncated: too
        long is a 400."""
        if self.pair_prompt is not None:
            enc = self.tokenizer.backend.encode(self.pair_prompt(req.input, req.pair),
                                                add_special_tokens=False)
        else:
            enc = self.tokenizer.backend.encode(req.input, req.pair,
                                                add_special_tokens=req.add_special_tokens)
        ids, types = list(enc.ids), list(enc.type_ids)
        if len(ids) > self.max_model_len:
            self._fail(req, f"the pair has {len(ids)} tokens; this model's maximum context "
                       f"length is {self.max_model_len} tokens. Shorten it.", "input",
                       "context_length_exceeded")
        return ids, types.index(1) if 1 in types else None

    def _pooling_ids(self, req: ipc.PoolReq) -> list[int]:
        limit = self.max_model_len
        if isinstance(req.input, str):
            size = self.last_text_bytes = utf8_len(req.input)
            max_bytes = self.bound.max_bytes(limit)
            if max_bytes is not None and size > max_bytes:
                self._fail(req, f"the input has at least {self.bound.min_tokens(size)} tokens "
                           f"({size} bytes); this model's maximum context length is {limit} "
                           "tokens. Shorten it.", "input", "context_length_exceeded")
            ids = self.tokenizer.encode(req.input, add_special_tokens=req.add_special_tokens)
        else:
            ids = list(req.input)
            bad = [i for i in ids if not 0 <= i < self.vocab_size]
            if bad:
                self._fail(req, f"token ids {bad[:5]} are outside the vocabulary "
                           f"(0..{self.vocab_size - 1})", "input", "invalid_token_id")
        if not ids:
            self._fail(req, "the input is empty after tokenization", "input", "empty_input")
        if len(ids) > limit:
            self._fail(req, f"the input has {len(ids)} tokens; this model's maximum context "
                       f"length is {limit} tokens. Shorten it.", "input",
                       "context_length_exceeded")
        return ids

    def tokenizer_info(self) -> ipc.TokenizerInfo:
        tok = self.tokenizer
        config = _read_json_object(tok.directory / "tokenizer_config.json")
        plain = {k: v for k, v in config.items()
                 if isinstance(v, (str, int, float, bool)) and k != "chat_template"}
        try:
            template = self.server_template or tok.chat_template(False)
        except ChatTemplateError:  # several checkpoint templates, none the default
            template = None
        return ipc.TokenizerInfo(
            tokenizer_class=str(config.get("tokenizer_class") or "PreTrainedTokenizerFast"),
            model_max_length=self.max_model_len, vocab_size=tok.vocab_size,
            special_tokens=dict(tok.special_tokens_map), eos_token_ids=list(tok.eos_token_ids),
            chat_template=template.source if template is not None else None, config=plain)

    def render(self, req: ipc.RenderReq) -> ipc.RenderResult | ipc.RequestError:
        """Template + tokenize (or decode) without scheduling anything."""
        try:
            if req.tokenizer_info:
                return ipc.RenderResult(req.rid, "", [], tokenizer_info=self.tokenizer_info())
            if req.token_ids is not None:
                bad = [i for i in req.token_ids if not 0 <= i < self.vocab_size]
                if bad:
                    return ipc.RequestError(req.rid, 400, f"token ids {bad[:5]} are outside the "
                                            f"vocabulary (0..{self.vocab_size - 1})", param="tokens",
                                            code="invalid_token_id")
                text = self.tokenizer.decode(req.token_ids, skip_special_tokens=False)
                self.last_text_bytes = utf8_len(text)
                return ipc.RenderResult(req.rid, text, list(req.token_ids))
            assert req.gen is not None
            prompt = self._render(req.gen, req.tokenize_only, req.add_special_tokens)
            text = (prompt.text if prompt.text is not None
                    else self.tokenizer.decode(prompt.ids, skip_special_tokens=False))
            strs = ([self.tokenizer.backend.id_to_token(i) or "" for i in prompt.ids]
                    if req.with_token_strs else None)
            return ipc.RenderResult(req.rid, text, prompt.ids, strs, prompt.template,
                                    prompt.adjustments)
        except _Rejected as rej:
            return rej.error
