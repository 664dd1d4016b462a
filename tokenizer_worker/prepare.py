"""GenerateReq -> TokenizedReq (or a RequestError): template, tokenize, budget."""

from __future__ import annotations

from protocol import ipc
from tokenizer_worker.budget import resolve_max_tokens
from tokenizer_worker.chat_template import ChatTemplateError
from tokenizer_worker.tokenizer_files import CheckpointTokenizer


class RequestPreparer:
    def __init__(self, tokenizer: CheckpointTokenizer, max_model_len: int) -> None:
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len

    def _error(self, req: ipc.GenerateReq, message: str, param: str | None,
               code: str) -> ipc.RequestError:
        return ipc.RequestError(req.rid, 400, message, param=param, code=code)

    def _prompt_ids(self, req: ipc.GenerateReq) -> list[int] | ipc.RequestError:
        tok = self.tokenizer
        if req.messages is not None:
            try:
                text, _template = tok.render_chat(
                    req.messages, tools=req.tools,
                    add_generation_prompt=req.add_generation_prompt,
                    continue_final_message=req.continue_final_message,
                    **req.chat_template_kwargs)
            except ChatTemplateError as err:
                return self._error(req, f"the chat template could not render these "
                                   f"messages: {err}", "messages", "chat_template_error")
            return tok.encode(text, add_special_tokens=False)
        if isinstance(req.prompt, str):
            return tok.encode(req.prompt, add_special_tokens=True)
        ids = list(req.prompt or [])
        bad = [i for i in ids if not 0 <= i < tok.vocab_size]
        if bad:
            return self._error(req, f"prompt token ids {bad[:5]} are outside the vocabulary "
                               f"(0..{tok.vocab_size - 1})", "prompt", "invalid_token_id")
        return ids

    def prepare(self, req: ipc.GenerateReq) -> ipc.TokenizedReq | ipc.RequestError:
        ids = self._prompt_ids(req)
        if isinstance(ids, ipc.RequestError):
            return ids
        if not ids:
            return self._error(req, "the prompt is empty after tokenization", "prompt",
                               "empty_prompt")
        bad_stop = [i for i in req.stop_token_ids if not 0 <= i < self.tokenizer.vocab_size]
        if bad_stop:
            return self._error(req, f"stop_token_ids {bad_stop[:5]} are outside the "
                               "vocabulary", "stop_token_ids", "invalid_token_id")
        max_tokens = resolve_max_tokens(req.rid, len(ids), req.max_tokens,
                                        req.max_tokens_field, self.max_model_len)
        if isinstance(max_tokens, ipc.RequestError):
            return max_tokens
        if req.min_tokens > max_tokens:
            return self._error(req, f"min_tokens ({req.min_tokens}) is larger than the "
                               f"{max_tokens} tokens this request may generate",
                               "min_tokens", "invalid_value")
        return ipc.TokenizedReq(
            rid=req.rid, reply_to=req.reply_to, prompt_token_ids=ids, max_tokens=max_tokens,
            sampling=req.sampling, detok=req.detok,
            eos_token_ids=self.tokenizer.eos_token_ids, stop_token_ids=req.stop_token_ids,
            ignore_eos=req.ignore_eos, min_tokens=req.min_tokens,
            arrival_time=req.arrival_time, priority=req.priority, cache_salt=req.cache_salt,
            probe=req.probe)
