"""The fields chat and completions share: what the generation pipeline (``translate``)
reads for both (sampling, stops, detokenization, constraints, scheduling), and the vLLM /
SGLang fields both name without implementing. Each endpoint's table adds its own rows
(``endpoints/chat/fields.py``, ``endpoints/completions/fields.py``); the prose of every row
is in docs/fields/generation.yaml."""

from __future__ import annotations

from api_frontend.field_policy import UNKNOWN, Foreign, Row

GENERATION_ROWS: tuple[Row, ...] = (
    Row(("model",), "honoured"),
    Row(("max_tokens",), "honoured", clamps=True),
    Row(("temperature",), "honoured"),
    Row(("top_p",), "honoured"),
    Row(("n",), "honoured"),
    Row(("stream", "stream_options"), "honoured"),
    Row(("stop",), "honoured"),
    Row(("seed",), "honoured"),
    Row(("presence_penalty", "frequency_penalty"), "honoured"),
    Row(("logit_bias",), "honoured"),
    Row(("prompt_logprobs",), "extension"),
    Row(("user",), "ignored",
        reason="accepted for compatibility; Candor does not use it (no per-user policy)"),
    Row((UNKNOWN,), "ignored", reason="not a field Candor knows"),
    Row(("guided_json", "guided_regex", "guided_choice", "guided_grammar",
         "structured_outputs"), "extension"),
    Row(("top_k",), "extension"),
    Row(("min_p",), "extension"),
    Row(("repetition_penalty",), "extension"),
    Row(("min_tokens",), "extension"),
    Row(("ignore_eos", "stop_token_ids"), "extension"),
    Row(("include_stop_str_in_output",), "extension"),
    Row(("return_token_ids", "skip_special_tokens"), "extension"),
    Row(("priority",), "extension", only_with="priority_scheduling"),
    Row(("cache_salt",), "extension"),
    Row(("strict",), "extension"),
)

_NO_GUIDED = "use guided_json / guided_regex / guided_grammar or response_format"
_NO_BEAM = "beam search is not implemented"
_BEAM_ONLY = "only applies to beam search, which Candor rejects"
_NO_LORA = ("name the LoRA adapter in `model` (vLLM's way; /v1/models lists the served "
            "adapters, POST /v1/load_lora_adapter adds one)")
_NO_PROCESSORS = "custom logits processors are not implemented"
FOREIGN: tuple[Foreign, ...] = (
    Foreign("regex", "rejected", _NO_GUIDED + " (SGLang `regex`)"),
    Foreign("ebnf", "rejected", _NO_GUIDED + " (SGLang `ebnf`)"),
    Foreign("json_schema", "rejected", _NO_GUIDED + " (SGLang `json_schema`)"),
    Foreign("guided_decoding_backend", "ignored", "Candor has one grammar engine "
            "(llguidance); the constraint itself is honoured"),
    Foreign("guided_whitespace_pattern", "rejected", "JSON output is always compact (no "
            "whitespace between tokens)"),
    Foreign("use_beam_search", "rejected", _NO_BEAM, (False,)),
    Foreign("best_of", "rejected", "best_of > 1 (sample several, return the best) is not "
            "implemented", (1,)),
    Foreign("length_penalty", "ignored", _BEAM_ONLY),
    Foreign("early_stopping", "ignored", _BEAM_ONLY),
    Foreign("lora_request", "rejected", _NO_LORA),
    Foreign("lora_path", "rejected", _NO_LORA),
    Foreign("spaces_between_special_tokens", "rejected",
            "only the default (true) detokenization is implemented", (True,)),
    Foreign("truncate_prompt_tokens", "rejected", "prompt truncation is not implemented"),
    Foreign("logits_processors", "rejected", _NO_PROCESSORS),
    Foreign("custom_logit_processor", "rejected", _NO_PROCESSORS),
    Foreign("bad_words", "rejected", "bad_words is not implemented", ([],)),
    Foreign("allowed_token_ids", "rejected", "allowed_token_ids is not implemented"),
    Foreign("vllm_xargs", "rejected", "vLLM's extra sampling arguments are not implemented"),
    Foreign("return_hidden_states", "rejected", "hidden states are not returned", (False,)),
    Foreign("return_tokens_as_token_ids", "rejected",
            "logprob tokens are always returned as text", (False,)),
    Foreign("min_new_tokens", "rejected", "SGLang's name; Candor's field is `min_tokens`"),
    Foreign("no_stop_trim", "rejected",
            "SGLang's name; Candor's field is `include_stop_str_in_output`", (False,)),
    Foreign("stop_regex", "rejected", "regular-expression stops are not implemented"),
    Foreign("typical_p", "rejected", "typical sampling is not implemented", (1, 1.0)),
    Foreign("documents", "rejected", "chat documents (RAG templates) are not implemented"),
    Foreign("mm_processor_kwargs", "rejected", "per-request image processor settings are not "
            "implemented (Gemma 3's pan-and-scan follows the checkpoint's do_pan_and_scan)",
            ({},)),
    Foreign("request_id", "ignored", "send the X-Request-Id header instead; it is echoed"),
    Foreign("kv_transfer_params", "ignored", "Candor's disaggregated prefill/decode is the "
            "deployment's (`--prefill-replicas` / `--decode-replicas`): the scheduler hands "
            "each request on and its KV moves worker to worker, so no client or proxy passes "
            "transfer parameters"),
)
