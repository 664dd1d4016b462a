"""The request-field table: every field's tier on each endpoint, and what it means.

One row per fact. The code reads it for ``GET /v1/capabilities`` (``tiers``), the
``candor`` report and strict mode (``report``), and the 400 for a foreign field that would
change the output (``foreign_notes``); ``api_frontend.fields_doc`` renders the same rows
into ``docs/fields.md``. A tier is one of ``TIER_MEANINGS``; a deployment shifts it:
``--strict`` turns ignored and clamped into rejected, ``--max-tokens-policy clamp`` turns
``clamps`` rows into clamped, and an ``only_with`` row is rejected unless its flag is on.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal

import msgspec

from api_frontend.errors import ApiError
from cluster.topology import ApiSpec
from protocol.openai_api import (CandorReport, ChatCompletionRequest, CompletionRequest,
                                 EmbeddingRequest, FieldNote)
from protocol.responses_api import ResponsesRequest

Tier = Literal["honoured", "clamped", "ignored", "extension", "rejected"]
Endpoint = Literal["chat", "completions", "responses", "embeddings"]

TIER_MEANINGS: dict[str, str] = {
    "honoured": "maps onto sampling/decoding",
    "clamped": "accepted, rewritten and reported",
    "ignored": "accepted, not acted on, reported",
    "extension": "not an OpenAI field, honoured",
    "rejected": "400 naming it",
}

UNKNOWN = "<unknown field>"  # the tier key every field not in the table falls under


class Row(msgspec.Struct, frozen=True, kw_only=True):
    """Request fields that share a tier and a description. ``chat`` / ``completions`` /
    ``responses``: their tier on that endpoint (None: not a field there). ``label`` names a
    row that is a behaviour rather than fields. ``reason``: why an ignored field is ignored
    (reported). A dotted field (``reasoning.effort``) is a key inside an object field."""

    fields: tuple[str, ...] = ()
    chat: Tier | None = None
    completions: Tier | None = None
    responses: Tier | None = None
    embeddings: Tier | None = None
    candor: str
    vllm: str = "—"
    sglang: str = "—"
    tests: str = ""
    label: str = ""
    reason: str = ""
    clamps: bool = False
    only_with: str = ""  # an ApiSpec flag; without it the field is rejected

    def tier(self, kind: Endpoint) -> Tier | None:
        return getattr(self, kind)


class Foreign(msgspec.Struct, frozen=True):
    """A vLLM or SGLang field Candor does not implement. Rejected: a 400
    ``unsupported_field`` unless the value is one of ``harmless`` (values that ask for
    what Candor does anyway, reported as ignored). Ignored: it cannot change the output."""

    field: str
    tier: Literal["rejected", "ignored"]
    reason: str
    harmless: tuple[Any, ...] = ()


BOTH = {"chat": "honoured", "completions": "honoured"}
EXT = {"chat": "extension", "completions": "extension"}

ROWS: tuple[Row, ...] = (
    Row(fields=("model",), **BOTH, candor="honoured; a LoRA adapter's name (`--lora-modules`, "
        "or loaded at runtime; /v1/models lists it with its `parent`) runs the request on "
        "that adapter over the base model; unknown → 404 listing served names, adapters "
        "included", vllm="same (adapter names too)", sglang="no check; `:` = LoRA",
        tests="H `test_unknown_model_route_and_method`, C `test_sdk_exception_classes`, "
        "LR `test_mixed_adapters_and_base_batched_give_peft_tokens`"),
    Row(fields=("max_tokens",), **BOTH, clamps=True,
        candor="honoured; overflow → 400 naming the field used and both counts; "
        "`--max-tokens-policy clamp` → clamped and reported",
        vllm="clamp silently", sglang="400 with accounting",
        tests="H `test_context_overflow_names_the_field_and_both_counts`, "
        "P `test_clamp_policy_reports_the_clamp`"),
    Row(fields=("max_completion_tokens",), chat="honoured", clamps=True,
        candor="as `max_tokens`, and wins over it", vllm="same", sglang="same",
        tests="S `test_max_completion_tokens_wins`"),
    Row(fields=("temperature",), **BOTH,
        candor="honoured; 0 = greedy argmax, no RNG; (0, 0.01) kept (fp32-safe); range 0..2",
        vllm="raised to 0.01", sglang="top_k=1 at 0",
        tests="C `test_out_of_range_values_are_400_naming_the_field`, "
        "S `test_top_k_1_and_min_p_1_are_greedy`"),
    Row(fields=("top_p",), **BOTH, candor="honoured, (0, 1]", vllm="honoured",
        sglang="honoured", tests="C ranges, model parity `test_sampler_filters`"),
    Row(fields=("n",), **BOTH,
        candor="honoured: n choices (seed + i per choice); temperature 0 → computed once, "
        "n identical choices; usage counts every choice; at most `max_n` (400 naming the "
        "limit), and n × prompts at most `max_request_share` of the waiting queue",
        vllm="400 at temperature 0", sglang="n identical samples",
        tests="S `test_n_choices_sampled_and_greedy`, "
        "A `test_fan_out_limits_are_400_naming_field_and_limit`"),
    Row(fields=("stream", "stream_options"), **BOTH,
        candor="honoured; `stream_options` without `stream` → 400", vllm="400",
        sglang="ignored",
        tests="H `test_sse_framing_finish_length_and_usage`, C `test_sdk_exception_classes`"),
    Row(fields=("stop",), **BOTH,
        candor="honoured, trimmed; `finish_reason: stop` whenever a stop string cut the text, "
        "on the last allowed token too; at most `max_stop_strings`, each at most "
        "`max_stop_string_chars`", vllm="honoured", sglang="honoured",
        tests="H `test_finish_reason_stop_on_stop_string_is_trimmed`, A limits, "
        "K `test_stop_string_ending_on_the_last_allowed_token_is_stop`"),
    Row(fields=("seed",), **BOTH,
        candor="honoured: per-request generator; same seed + same request + same deployment = "
        "same tokens and logprobs (top_logprobs, prompt logprobs), bitwise, whatever else is "
        "in the batch, on a prefix-cache hit or miss, under any step budget, preempted or not, "
        "on any replica, after a restart (the deterministic mode: the default where the device "
        "has batch-invariant kernels; `/v1/capabilities` `deterministic` and each response's "
        "`candor.deterministic` say whether it answered; `--no-deterministic` turns it off); "
        "greedy requests the same",
        vllm="hint (batch-invariant only with `VLLM_BATCH_INVARIANT=1`, GPU)",
        sglang="hint (`--enable-deterministic-inference`, GPU)",
        tests="S `test_seed_gives_same_tokens_alone_and_in_a_busy_batch`, "
        "D `test_alone_and_in_random_batches_bitwise`, D `test_other_step_budget_preemption_and_restart`, "
        "D `test_every_data_parallel_replica`"),
    Row(fields=("presence_penalty", "frequency_penalty"), **BOTH,
        candor="honoured over generated tokens, -2..2 (checked against an HF reference; "
        "the same with or without a prefix-cache hit)",
        vllm="honoured", sglang="honoured",
        tests="S `test_penalties_match_hf_reference`, "
        "U `test_penalties_match_a_dense_reference`, "
        "K `test_history_fields_give_the_same_answer_with_and_without_a_cache_hit`"),
    Row(fields=("logit_bias",), **BOTH,
        candor="at most `max_logit_bias` entries; honoured, sparse (index_put over entries, "
        "cost ∝ entries); ids checked against the vocabulary → 400 `logit_bias`",
        vllm="sparse; off under spec decoding", sglang="dense B×V fp32",
        tests="S `test_logit_bias_forces_and_bans_tokens`, "
        "S `test_logit_bias_errors_name_the_field`, U `test_logit_bias_is_sparse_and_exact`"),
    Row(fields=("logprobs", "top_logprobs"), chat="honoured",
        candor="honoured, raw log-softmax before filters; `top_logprobs` 0..`max_logprobs` "
        "(default 20, `--max-logprobs`) and only with `logprobs: true`. `bytes` are the "
        "token's own bytes: a token holding part of a UTF-8 character has `token` U+FFFD "
        "and its real byte(s) in `bytes` (top_logprobs too), so they rebuild the text",
        vllm="same split; `bytes` the UTF-8 of the text (U+FFFD's for part of a character)",
        sglang="same",
        tests="L `test_chat_logprobs_match_hf_and_parse`, L `test_logprobs_validation`, "
        "L `test_chat_logprob_bytes_are_the_tokens_own_bytes`"),
    Row(fields=("logprobs", "echo"), completions="honoured",
        candor="honoured; `logprobs` 0..`max_logprobs`; echo returns the prompt and its "
        "logprobs (first token `null`); `text_offset` is where each token starts in the "
        "returned `text` (a BOS the echoed prompt lacks has no width), streamed chunks "
        "concatenate to the whole answer", vllm="honoured (`--max-logprobs`); offsets count "
        "the BOS text", sglang="honoured",
        tests="L `test_completion_logprobs_with_echo_match_hf`, "
        "L `test_echo_text_offsets_index_the_returned_text_whole_and_streamed`"),
    Row(fields=("prompt",), completions="honoured",
        candor="honoured: a string, token ids, or a list of up to `max_prompts` strings / "
        "token-id lists; one choice per prompt × n, `index = prompt_index * n + i`, streamed "
        "too, usage summed over prompts; render takes one prompt", vllm="honoured",
        sglang="honoured", tests="A `test_prompt_list_with_the_openai_sdk`"),
    Row(fields=("messages",), chat="honoured",
        candor="honoured; at most `max_messages`; a system / developer / user message "
        "without `content` → 400 `messages[i].content`", vllm="400",
        tests="A `test_message_without_content_names_the_path`"),
    Row(fields=("prompt_logprobs",), **EXT,
        candor="extension: 0..`limits.max_logprobs` alternatives per prompt token, as vLLM: "
        "`choices[].prompt_logprobs` (completions) / top-level (chat), first entry null, each "
        "`{token_id: {logprob, rank, decoded_token}}`; never truncated: such a request skips "
        "prefix-cache hits; with `stream` → 400", vllm="same (stream → 400)",
        tests="L `test_prompt_logprobs_extension_on_completions_matches_hf`, "
        "L `test_echo_logprobs_are_whole_on_a_prefix_cache_hit`"),
    Row(fields=("user",), chat="ignored", completions="ignored",
        reason="accepted for compatibility; Candor does not use it (no per-user policy)",
        candor="ignored, reported; strict → 400", vllm="ignored silently", sglang="absent",
        tests="H `test_ignored_fields_are_reported_not_dropped_silently`, "
        "X `test_strict_server_rejects_ignored_fields`"),
    Row(fields=("suffix",), completions="ignored",
        reason="accepted for compatibility; insertion (fill-in-the-middle) is not implemented",
        candor="ignored, reported; strict → 400", vllm="ignored silently", sglang="absent",
        tests="C `test_report_on_first_stream_frame_only`, X"),
    Row(fields=(UNKNOWN,), label="unknown fields", chat="ignored", completions="ignored",
        reason="not a field Candor knows", candor="ignored, reported; strict → 400",
        vllm="ignored", sglang="ignored",
        tests="C `test_report_lists_ignored_extensions_and_template`, X"),
    Row(fields=("tools",), chat="honoured",
        candor="honoured: at most `max_tools`; `[]`, a tool without `function.name` (1-64 of "
        "`A-Za-z0-9_.-`), a name given twice, non-object `parameters` → 400 naming the path "
        "(`tools[i].function.name` …); rendered by the chat template. Earlier assistant "
        "turns' `tool_calls[].function.arguments` (JSON text, as returned) reach the template "
        "as the object they encode (transformers' convention) unless it only prints or "
        "concatenates them (DeepSeek); text that encodes no object → 400 naming "
        "`messages[i].tool_calls[j].function.arguments`",
        vllm="honoured; arguments always decoded (DeepSeek's templates then fail)",
        sglang="honoured",
        tests="T `test_tool_validation_names_the_field`, "
        "T `test_assistant_tool_calls_and_tool_results_render`, "
        "P `test_tool_call_arguments_reach_the_template_as_it_reads_them`"),
    Row(fields=("tool_choice",), chat="honoured",
        candor="honoured. `none`: no parsing. `auto` (default with tools): free generation "
        "read by the deployment's tool-call parser (`--tool-call-parser`, or detected from the "
        "chat template; reported as `candor.tool_parser` and in `/v1/capabilities` "
        "`policy.tool_call_parser[_source]`); no parser → 400 rather than calls arriving as "
        "content. `required` / named: constrained decoding (a JSON list of `{name, "
        "parameters}` / the named function's arguments object), so arguments parse and "
        "validate whenever the reply finishes `tool_calls`. Without `tools`, or naming a function not in `tools` → 400 "
        "`tool_choice`",
        vllm="auto needs `--enable-auto-tool-choice`; required/named guided", sglang="guided",
        tests="T `test_required_calls_always_validate`, "
        "T `test_named_call_validates_and_streams_the_same_arguments`, "
        "T `test_auto_reads_hermes_calls_whole_and_streamed`, "
        "T `test_auto_without_a_parser_is_a_400`"),
    Row(fields=("parallel_tool_calls",), chat="honoured",
        candor="honoured: `false` → one call. `required`: the grammar allows exactly one; "
        "`auto`: generation stops where the first call ends (no tokens spent on others); with "
        "a reasoning parser only calls after `</think>` count", vllm="truncates after "
        "generating every call",
        tests="T `test_parallel_false_yields_exactly_one_call`, "
        "T `test_parallel_false_under_auto_stops_after_the_first_call`, "
        "T `test_parallel_false_keeps_the_first_call_after_think`"),
    Row(label="tool-call output",
        candor="`message.tool_calls` (`id`, `type`, `function.name`, `function.arguments` as "
        "JSON text), `content` null when the reply is only calls; streamed as OpenAI deltas "
        "(id, type, name in a call's first delta, then `arguments` fragments that concatenate "
        "to exactly the non-streamed arguments); tags never reach `content`; `finish_reason: "
        "\"tool_calls\"` exactly when calls were emitted and every call's arguments parse. "
        "A reply that ends inside a call (a stop string or stop token, `max_tokens`, a "
        "reasoning block never closed) finishes `stop` / `length` with that call as far as "
        "it was written, whole and streamed alike (fragments stream as written, so neither "
        "form drops it); a call whose name was not finished stays content. A call has arguments (or "
        "`parameters`) and a name one of `tools` declares; anything else, however call-like, "
        "stays `content` verbatim (finish `stop`); with a reasoning parser calls are read only "
        "after `</think>`. Parsers: hermes (Hermes / Qwen2.5 / Qwen3), llama3_json (with or "
        "without `<\\|python_tag\\|>`), mistral, deepseek_v31, granite, pythonic",
        vllm="same shape; any name becomes a call; `tool_calls` even when `max_tokens` cut "
        "the call (named: always `stop`)", sglang="same; undeclared names dropped "
        "(log line)",
        tests="T `test_a_call_cut_before_its_end_never_finishes_tool_calls`, TP (every parser on its real template's text, streamed in pieces of 1..n "
        "characters), TP `test_only_declared_tools_are_called`, "
        "T `test_a_call_to_an_undeclared_tool_stays_content`, "
        "T `test_a_call_drafted_inside_think_is_reasoning_not_a_call`"),
    Row(fields=("response_format",), chat="honoured", completions="extension",
        candor="honoured: `text`; `json_object`; `json_schema` (`strict` or not: always "
        "enforced). Also accepted on `/v1/completions` (extension, as vLLM). A schema keyword "
        "the engine cannot enforce → 400 `unsupported_constraint` naming "
        "`response_format.json_schema.schema` before generation", vllm="honoured",
        sglang="honoured",
        tests="G `test_json_schema_always_validates`, "
        "G `test_unenforceable_constraints_are_400s_naming_the_field`"),
    Row(fields=("guided_json", "guided_regex", "guided_choice", "guided_grammar",
                "structured_outputs"), **EXT,
        candor="extensions, enforced by the one grammar engine (llguidance; compiled and "
        "checked by the tokenizer worker, cached by hash; the worker masks every sampled "
        "token). `guided_grammar` is Lark or GBNF; `structured_outputs` takes `json`, `regex`, "
        "`choice`, `grammar`, `json_object`. JSON is compact (no free whitespace). At most one "
        "constraint per request (two → 400 naming the second); with `tool_choice` "
        "required/named → 400; with `ignore_eos` → 400. Holds with `n`, `seed`, `logprobs` "
        "(raw, before the mask), `logit_bias`, stop strings, streaming and preemption. Objects "
        "listing `properties` without `additionalProperties` get `false` (as vLLM's default "
        "engine). With a reasoning parser the `<think>` block stays free and the answer after "
        "`</think>` is constrained", vllm="honoured", sglang="`regex`, `ebnf`, `json_schema`",
        tests="G `test_each_guided_field_is_enforced`, "
        "G `test_constraint_survives_preemption_with_the_same_tokens`, "
        "G `test_stop_string_cuts_constrained_output`"),
    Row(fields=("top_k",), **EXT, candor="extension, -1 or ≥ 1 (0 = off)", vllm="extension",
        sglang="extension", tests="S `test_top_k_1_and_min_p_1_are_greedy`, C ranges"),
    Row(fields=("min_p",), **EXT, candor="extension, 0..1", vllm="extension",
        sglang="extension",
        tests="S `test_top_k_1_and_min_p_1_are_greedy`, "
        "U `test_min_p_keeps_only_tokens_near_the_top`"),
    Row(fields=("repetition_penalty",), **EXT,
        candor="extension, over prompt + generated (HF; a cached prompt included), (0, 2]",
        vllm="extension", sglang="extension",
        tests="S `test_penalties_match_hf_reference`, "
        "K `test_history_fields_give_the_same_answer_with_and_without_a_cache_hit`"),
    Row(fields=("min_tokens",), **EXT,
        candor="extension: eos and `stop_token_ids` masked until reached (prefix-cache hit or "
        "not); stop strings count only where they end after those tokens (as vLLM). With a "
        "constraint that must end sooner: 400 `constraint_conflict` naming both where known "
        "up front (`guided_choice`, boolean/null schemas), otherwise that request alone ends "
        "with that error (its batch goes on)", vllm="extension; the conflict fails the batch",
        sglang="`min_new_tokens`",
        tests="S `test_stop_token_ids_min_tokens_and_ignore_eos`, "
        "S `test_min_tokens_holds_back_stop_strings`, "
        "U `test_min_tokens_suppresses_stop_ids_until_reached`, "
        "K `test_runtime_constraint_conflict_fails_only_that_request`"),
    Row(fields=("ignore_eos", "stop_token_ids"), **EXT,
        candor="extension; at most `max_stop_token_ids` ids. The id that stops a sequence "
        "counts in usage and logprobs; its text is left out of the answer (as vLLM)",
        vllm="extension", sglang="extension",
        tests="S `test_stop_token_ids_min_tokens_and_ignore_eos`, "
        "K `test_stopping_token_text_is_left_out_unless_asked_for`"),
    Row(fields=("include_stop_str_in_output",), **EXT,
        candor="extension: keeps the matched stop string, and the text of the EOS or "
        "`stop_token_ids` id that stopped the sequence", vllm="extension",
        sglang="`no_stop_trim`", tests="S `test_stop_string_include_stop_str_in_output`, "
        "K `test_stopping_token_text_is_left_out_unless_asked_for`"),
    Row(fields=("return_token_ids", "skip_special_tokens"), **EXT, candor="extension",
        vllm="extension", sglang="extension", tests="H `test_usage_counts_equal_tokens_produced`"),
    Row(fields=("priority",), **EXT, only_with="priority_scheduling",
        candor="extension with `--scheduling-policy priority` (`api.scheduling_policy`): "
        "lower runs first when requests wait, arrival order within one; -2^31..2^31-1; no "
        "aging (a steady stream of lower values starves higher ones). Default `fcfs`: "
        "arrival order, a non-zero `priority` → 400 `priority`",
        vllm="400 unless `--scheduling-policy priority`; no bound", sglang="extension",
        tests="P `test_priority_needs_the_priority_scheduling_policy`, test_prefix_cache.py "
        "`test_priority_orders_waiting_fcfs_within_a_priority`"),
    Row(fields=("cache_salt",), **EXT,
        candor="extension: prefix-cache blocks are shared only between requests with the "
        "same salt (none: the unsalted pool), so one tenant cannot time another's prompts; "
        "with several replicas the salt is also an affinity key",
        vllm="extension", sglang="—",
        tests="test_e2e_engine.py `test_prefix_cache_hit_reports_cached_tokens_and_matches_hf`"
        ", test_data_parallel.py "
        "`test_cache_salt_is_an_affinity_key_and_separates_equal_prompts`"),
    Row(fields=("strict",), **EXT, candor="extension: this request in strict mode",
        tests="C `test_per_request_strict_turns_ignored_into_400`"),
    Row(fields=("add_generation_prompt", "continue_final_message"), chat="extension",
        candor="extension; both true → 400", vllm="400",
        tests="H `test_chat_validation_errors`, "
        "C `test_render_tokenize_detokenize_agree_with_generation`"),
    Row(fields=("chat_template_kwargs",), chat="extension",
        candor="extension; keys the template does not declare are reported ignored with the "
        "declared variables; strict → 400", vllm="dropped silently",
        tests="C `test_report_lists_ignored_extensions_and_template`, "
        "C `test_per_request_strict_turns_ignored_into_400`"),
    Row(label="reasoning (`--reasoning-parser qwen3 \\| deepseek_r1`, or detected)",
        candor="`<think>` text → `message.reasoning_content` / `delta.reasoning_content`, "
        "never `content`; `chat_template_kwargs.enable_thinking: false` (qwen3) / `thinking: "
        "false` (deepseek_r1) turn it off per request; reported as `candor.reasoning_parser`",
        vllm="same field", sglang="same",
        tests="TP `test_reasoning_split_whole_and_streamed`, "
        "T `test_reasoning_parser_fills_reasoning_content_whole_and_streamed`, "
        "G `test_constraint_applies_after_the_reasoning_block`"),
    Row(fields=("chat_template",), chat="extension", only_with="allow_request_chat_template",
        candor="extension only with `--allow-request-chat-template`, else 400; source "
        "reported as `request`; bounded in source size, render time, output and the size of "
        "any one value it builds (sized before it is built) → 400 naming it",
        vllm="honoured", sglang="honoured",
        tests="C `test_request_chat_template_needs_the_server_flag`, "
        "P `test_template_sources_and_string_content_format`, "
        "test_e2e_hardening_tokenizer.py `test_request_template_cannot_build_a_huge_value`"),
    Row(fields=("echo",), chat="extension",
        candor="extension: the final assistant message's content is prepended", vllm="same",
        tests="C `test_chat_echo_prepends_the_final_assistant_message`"),
    Row(label="message `content` as list of text parts",
        candor="honoured; for templates that read content as a string, parts are joined with "
        "\"\\n\"", vllm="content-format detection",
        tests="P `test_template_sources_and_string_content_format`"),
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
    Foreign("request_id", "ignored", "send the X-Request-Id header instead; it is echoed"),
    Foreign("kv_transfer_params", "ignored", "disaggregated prefill is not part of Candor"),
)
FOREIGN_FIELDS: dict[str, Foreign] = {f.field: f for f in FOREIGN}


class RouteField(msgspec.Struct, frozen=True, kw_only=True):
    """A body field of a management route (the LoRA adapter routes): no tiers there,
    every field is honoured and an unknown one is a 400."""

    route: str
    field: str
    candor: str
    vllm: str = "same"
    tests: str = ""


_LOAD, _UNLOAD = "/v1/load_lora_adapter", "/v1/unload_lora_adapter"
# tests: LR = test_e2e_lora.py
LORA_ROUTE_FIELDS: tuple[RouteField, ...] = (
    RouteField(route=_LOAD, field="lora_name",
               candor="the name clients send as `model`; the base model's name, or an adapter "
               "already served without `load_inplace` → 400 naming `lora_name`",
               tests="LR `test_runtime_load_and_unload_behind_the_key`"),
    RouteField(route=_LOAD, field="lora_path",
               candor="an absolute PEFT adapter directory inside `--lora-allowed-dirs` (default: "
               "the directories holding the `--lora-modules`), symlinks resolved; outside them, "
               "missing files, a rank above `--max-lora-rank`, DoRA or other non-plain LoRA, "
               "target modules or shapes that do not fit the base → 400 naming it",
               vllm="any path the server can read",
               tests="LR `test_bad_adapters_are_400_naming_the_problem`"),
    RouteField(route=_LOAD, field="load_inplace",
               candor="replace the adapter served under `lora_name`: new requests take the new "
               "one once every replica holds it; running ones finish on the old",
               tests="LR `test_runtime_load_and_unload_behind_the_key`"),
    RouteField(route=_UNLOAD, field="lora_name",
               candor="new requests for it → 404 at once; queued and running ones finish on it "
               "(the reply counts them); unknown → 404 listing the served adapters",
               tests="LR `test_runtime_load_and_unload_behind_the_key`"),
    RouteField(route=_UNLOAD, field="lora_int_id",
               candor="accepted, not used (an adapter is named by `lora_name`)",
               vllm="used when given"),
)


RESP = {"responses": "extension"}
_NOT_USED = "accepted for compatibility; Candor does not use it"
# /v1/responses runs on the chat pipeline (api_frontend/endpoints/responses): a field whose
# meaning is chat's says so; tests: R = test_e2e_responses.py
RESPONSES_ROWS: tuple[Row, ...] = (
    Row(fields=("model",), responses="honoured", candor="as chat: a LoRA adapter's name runs "
        "on that adapter; unknown → 404 listing served names", vllm="same",
        tests="R `test_bad_requests_are_4xx_naming_the_field`, "
        "LR `test_mixed_adapters_and_base_batched_give_peft_tokens`"),
    Row(fields=("input",), responses="honoured",
        candor="a string (one user message) or items: `message` (roles user, assistant, "
        "system, developer; content a string or `input_text` / `output_text` / `refusal` "
        "parts), `function_call`, `function_call_output` (a string or `input_text` parts), "
        "`reasoning` (its `content` text becomes the next assistant turn's "
        "`reasoning_content`); rendered by the chat template as chat messages (consecutive "
        "calls are one assistant turn). Other item types (`item_reference`, built-in tool "
        "calls) and image / file / audio parts → 400 naming `input[i]...`; at most "
        "`max_messages` items, the previous response's conversation included",
        vllm="same item types; harmony models differ",
        tests="R `test_function_call_round_trip_with_the_openai_sdk`, "
        "R `test_bad_requests_are_4xx_naming_the_field`"),
    Row(fields=("instructions",), responses="honoured",
        candor="a system message before the conversation; not carried over by "
        "`previous_response_id` (as OpenAI)", vllm="same",
        tests="R `test_continuation_and_the_store_through_the_sdk`"),
    Row(fields=("max_output_tokens",), responses="honoured", clamps=True,
        candor="as chat's `max_completion_tokens`: overflow → 400 naming "
        "`max_output_tokens` and both counts; `--max-tokens-policy clamp` → clamped and "
        "reported; the limit reached → `status: incomplete`, `incomplete_details.reason: "
        "max_output_tokens`", vllm="clamped silently",
        tests="R `test_create_whole_and_streamed_agree_event_by_event`"),
    Row(fields=("temperature", "top_p"), responses="honoured",
        candor="as chat; the response echoes the values used (a deployment default "
        "included)", vllm="same",
        tests="R `test_create_whole_and_streamed_agree_event_by_event`"),
    Row(fields=("tools",), responses="honoured",
        candor="function tools (`{type: function, name, description, parameters, "
        "strict}`), validated as chat's (400 naming `tools[i].name` ...); a built-in tool "
        "(web_search, file_search, computer use, code_interpreter, image_generation, mcp, "
        "custom, ...) → 400 naming `tools[i].type`", vllm="built-ins on harmony models",
        tests="R `test_bad_requests_are_4xx_naming_the_field`"),
    Row(fields=("tool_choice", "parallel_tool_calls"), responses="honoured",
        candor="as chat: `none`, `auto` (the deployment's tool-call parser), `required` and "
        "`{type: function, name}` (constrained decoding: arguments always validate); "
        "`allowed_tools` and built-in choices → 400 naming `tool_choice.type`. Calls come "
        "back as `function_call` items (`call_id`, `name`, `arguments`)", vllm="same",
        tests="R `test_function_call_round_trip_with_the_openai_sdk`, "
        "R `test_auto_tool_call_streams_function_call_events`"),
    Row(fields=("text",), responses="honoured",
        candor="`text.format`: `text`, `json_object`, `json_schema` (always enforced, "
        "through the same grammar engine as chat's `response_format`; a keyword it cannot "
        "enforce → 400 naming `text.format.schema`). With `tool_choice` required / named "
        "the reply is calls only, so the format is reported ignored for that turn",
        vllm="json_object → 500 (NotImplementedError)",
        tests="R `test_json_schema_output_parses`, R `test_agents_sdk_runs_a_tool_agent`"),
    Row(label="reasoning items",
        candor="with a reasoning parser (`--reasoning-parser`, or detected) the `<think>` "
        "text is a `reasoning` output item (`content: [{type: reasoning_text}]`, `summary: "
        "[]`), streamed as `response.reasoning_text.delta` / `.done`; "
        "`usage.output_tokens_details.reasoning_tokens` counts the tokens before the answer "
        "began (all of them when it never did)", vllm="same item; summary events differ",
        tests="R `test_reasoning_items_whole_and_streamed`"),
    Row(fields=("reasoning.effort", "reasoning.summary", "reasoning.generate_summary"),
        responses="ignored", reason="Candor has no reasoning-effort control and writes no "
        "summaries; thinking follows the chat template's switch (`chat_template_kwargs`) "
        "and the reasoning text is returned whole", candor="ignored, reported; strict → 400",
        vllm="effort passed to harmony models",
        tests="R `test_ignored_and_unbuilt_fields_are_reported_or_400`"),
    Row(fields=("text.verbosity",), responses="ignored",
        reason="Candor has no verbosity control", candor="ignored, reported; strict → 400",
        tests="R `test_ignored_and_unbuilt_fields_are_reported_or_400`"),
    Row(fields=("stream",), responses="honoured",
        candor="OpenAI's semantic events, each `event:` + `data:` with its "
        "`sequence_number`: response.created, response.in_progress, then per item "
        "output_item.added, content_part.added, output_text.delta / reasoning_text.delta "
        "/ function_call_arguments.delta, their .done, content_part.done, "
        "output_item.done; last response.completed or response.incomplete. A failure "
        "after the first event: an `error` event (code, message, param) then "
        "response.failed. No `[DONE]`", vllm="same events",
        tests="R `test_create_whole_and_streamed_agree_event_by_event`, "
        "R `test_failure_after_the_first_event_is_error_then_failed`"),
    Row(fields=("stream_options.include_obfuscation",), responses="ignored",
        reason="Candor never adds obfuscation padding to stream events",
        candor="ignored, reported; `stream_options` without `stream` → 400",
        tests="R `test_ignored_and_unbuilt_fields_are_reported_or_400`"),
    Row(fields=("store", "previous_response_id"), responses="honoured",
        candor="`store` (default true) keeps the response in the frontend that made it, "
        "bounded (`--responses-store-max-entries`, `--responses-store-max-bytes`, "
        "`--responses-store-ttl-s`; oldest first out; `candor_responses_store_*` metrics). "
        "`previous_response_id` continues its conversation (its input items and output, "
        "not its instructions) whichever frontend the request lands on: the id names the "
        "frontend that stored it, which the others ask over ZeroMQ. An id that is unknown, "
        "evicted, expired, deleted or made with `store: false` → 404 saying which",
        vllm="unbounded in-memory store, off unless VLLM_ENABLE_RESPONSES_API_STORE; one "
        "process only",
        tests="R `test_continuation_and_the_store_through_the_sdk`, "
        "R `test_store_bounds_say_what_became_of_an_id`, "
        "R `test_continuation_finds_its_response_on_either_of_two_frontends`"),
    Row(fields=("metadata",), responses="honoured",
        candor="stored and echoed; at most 16 keys, keys ≤ 64 and values ≤ 512 characters "
        "(400 `limit_exceeded` naming it)", vllm="echoed",
        tests="R `test_continuation_and_the_store_through_the_sdk`"),
    Row(fields=("truncation",), responses="honoured",
        candor="`disabled` (default): a conversation past the context → 400 with the token "
        "counts; `auto` (drop the oldest items) → 400 `unsupported_field`",
        vllm="auto honoured",
        tests="R `test_ignored_and_unbuilt_fields_are_reported_or_400`"),
    Row(fields=("include",), responses="honoured",
        candor="`[]` only: every value (output logprobs, `reasoning.encrypted_content`, "
        "built-in tool outputs) → 400 naming `include[i]`; reasoning text is returned in "
        "the reasoning item's `content`", vllm="logprobs honoured",
        tests="R `test_ignored_and_unbuilt_fields_are_reported_or_400`"),
    Row(fields=("user", "safety_identifier", "prompt_cache_key", "prompt_cache_retention",
                "prompt_cache_options", "service_tier", "max_tool_calls"),
        responses="ignored", reason=_NOT_USED + " (no per-user policy, one service tier, "
        "routing and caching follow the prompt prefix, no built-in tools to cap)",
        candor="ignored, reported; strict → 400", vllm="ignored silently",
        tests="R `test_ignored_and_unbuilt_fields_are_reported_or_400`"),
    Row(fields=("seed", "top_k", "min_p", "repetition_penalty", "presence_penalty",
                "frequency_penalty", "stop", "stop_token_ids", "min_tokens", "logit_bias",
                "cache_salt", "strict", "chat_template_kwargs", "guided_json",
                "guided_regex", "guided_choice", "guided_grammar", "structured_outputs"),
        **RESP,
        candor="extensions, exactly as on chat (the same checks and limits)",
        vllm="top_k, logit_bias, cache_salt, priority",
        tests="R `test_auto_tool_call_streams_function_call_events`"),
    Row(fields=("priority",), **RESP, only_with="priority_scheduling",
        candor="as chat: extension with `--scheduling-policy priority`, else a non-zero "
        "value → 400 `priority`", vllm="same",
        tests="R `test_bad_requests_are_4xx_naming_the_field`"),
    Row(fields=(UNKNOWN,), label="unknown fields", responses="ignored",
        reason="not a field Candor knows", candor="ignored, reported; strict → 400",
        vllm="ignored", tests="R `test_ignored_and_unbuilt_fields_are_reported_or_400`"),
)

EMB = {"embeddings": "extension"}
# /v1/embeddings on a pooling model (runner pooling); tests: E = test_e2e_embeddings.py,
# PR = test_pooling_runner.py, MM = test_multi_model.py
EMBEDDINGS_ROWS: tuple[Row, ...] = (
    Row(fields=("model",), embeddings="honoured",
        candor="honoured: routed to that model's engines; unknown → 404 listing served "
        "names; a generation model → 400 `wrong_model_runner` naming its runner (and chat on "
        "an embedding model likewise); a deployment without an embedding model → 404 "
        "naming what it serves", vllm="404 (route not mounted) on a generation model",
        tests="MM `test_wrong_kind_of_model_is_a_400_naming_the_runner`, "
        "C `test_embeddings_404_says_what_is_served`"),
    Row(fields=("input",), embeddings="honoured",
        candor="a string, token ids, or a list of up to `max_embedding_inputs` strings / "
        "token-id lists, each embedded on its own (batched by the scheduler with other "
        "requests; chunked like any prompt); an input longer than the context → 400 naming "
        "`input[i]` and both counts, never truncated; an empty string or list, or ids "
        "outside the vocabulary → 400 naming `input[i]`; inputs × requests bounded by "
        "`max_request_share` of the waiting queue",
        vllm="`truncate_prompt_tokens` to truncate; else 400",
        tests="E `test_input_forms_match_sentence_transformers_through_the_sdk`, "
        "E `test_bad_inputs_are_400s_naming_the_index`, "
        "E `test_inputs_are_batched_by_the_scheduler`, "
        "MM `test_an_input_longer_than_its_models_context_is_a_400`"),
    Row(fields=("encoding_format",), embeddings="honoured",
        candor="`float` (default) or `base64` (little-endian float32 bytes, OpenAI's "
        "layout; the SDK's default)", vllm="same",
        tests="E `test_base64_is_little_endian_float32_of_the_float_vector`"),
    Row(fields=("dimensions",), embeddings="honoured",
        candor="only on a model that declares Matryoshka support (config.json "
        "`matryoshka_dimensions` / `is_matryoshka`, vLLM's convention): the vector is cut "
        "to its first n values, then normalised where the model normalises; any other "
        "model, or a size it does not list → 400 naming `dimensions`",
        vllm="same (truncate, then normalise)",
        tests="E `test_dimensions_only_where_the_model_declares_matryoshka`, "
        "PR `test_matryoshka_dimensions_cut_then_normalise`, "
        "MM `test_dimensions_on_a_model_without_matryoshka_is_a_400`"),
    Row(fields=("user",), embeddings="ignored",
        reason="accepted for compatibility; Candor does not use it (no per-user policy)",
        candor="ignored, reported; strict → 400", vllm="ignored silently",
        tests="E `test_report_usage_and_strict`"),
    Row(fields=("add_special_tokens",), **EMB,
        candor="extension (vLLM's): false tokenizes each string without the tokenizer's "
        "BOS/EOS; default true, as sentence-transformers", vllm="same",
        tests="E `test_report_usage_and_strict`"),
    Row(fields=("strict",), **EMB, candor="extension: this request in strict mode",
        tests="E `test_report_usage_and_strict`"),
    Row(fields=("priority",), **EMB, only_with="priority_scheduling",
        candor="as chat: extension with `--scheduling-policy priority`, else a non-zero "
        "value → 400 `priority`", vllm="same",
        tests="E `test_bad_inputs_are_400s_naming_the_index`"),
    Row(fields=(UNKNOWN,), label="unknown fields", embeddings="ignored",
        reason="not a field Candor knows", candor="ignored, reported; strict → 400",
        vllm="ignored", tests="E `test_report_usage_and_strict`"),
    Row(label="pooling",
        candor="the checkpoint's sentence-transformers files (`modules.json`, "
        "`1_Pooling/config.json`: lasttoken / mean / cls; a `Normalize` module: L2), else "
        "the last token L2-normalised; from the final normed hidden states in fp32; a "
        "chunked prompt accumulates across chunks; the prefix cache is not used (mean and "
        "cls need every position's state); equal to sentence-transformers to cosine ≥ "
        "0.99999. Another module (`Dense` ...) or mode (`max` ...) → refused at start, "
        "naming it. Strings are tokenized as given (sentence-transformers 6 renders them "
        "through a chat template when the tokenizer has one)",
        vllm="same sources; `--override-pooler-config`",
        tests="PR `test_every_pooling_mode_matches_sentence_transformers_at_any_chunking`, "
        "E `test_input_forms_match_sentence_transformers_through_the_sdk`, "
        "MM `test_each_route_reaches_its_model`"),
    Row(label="usage",
        candor="`prompt_tokens` = `total_tokens` = the tokens of every input, as embedded",
        vllm="same", tests="E `test_report_usage_and_strict`"),
)

_NO_EMBED = "not built on /v1/embeddings"
EMBEDDINGS_FOREIGN: tuple[Foreign, ...] = (
    Foreign("truncate_prompt_tokens", "rejected", "inputs are never truncated: one longer "
            "than the context is a 400 naming it"),
    Foreign("normalize", "rejected", _NO_EMBED + ": the model's own files say whether "
            "vectors are normalised"),
    Foreign("embed_dtype", "rejected", _NO_EMBED + ": vectors are float32", ("float32",)),
    Foreign("endianness", "rejected", _NO_EMBED + ": base64 is little-endian float32",
            ("little",)),
    Foreign("messages", "rejected", "chat-form embedding inputs are not built; send `input`"),
    Foreign("request_id", "ignored", "send the X-Request-Id header instead; it is echoed"),
    Foreign("cache_salt", "ignored", "embeddings never use the prefix cache"),
)

_NOT_BUILT = "not built on /v1/responses"
# OpenAI Responses fields Candor does not build: a 400 naming them (harmless values pass)
RESPONSES_UNBUILT: tuple[Foreign, ...] = (
    Foreign("background", "rejected", _NOT_BUILT + ": a response runs while its request "
            "waits (stream it, or retry)", (False,)),
    Foreign("background_options", "rejected", _NOT_BUILT + " (no background responses)"),
    Foreign("conversation", "rejected", _NOT_BUILT + ": no conversation objects; continue "
            "with `previous_response_id`"),
    Foreign("prompt", "rejected", _NOT_BUILT + ": no stored prompt templates; send "
            "`instructions` and `input`"),
    Foreign("context_management", "rejected", _NOT_BUILT + ": no compaction"),
    Foreign("moderation", "rejected", _NOT_BUILT + ": no moderation models"),
    Foreign("top_logprobs", "rejected", _NOT_BUILT + ": no logprobs (use "
            "/v1/chat/completions)", (0,)),
)


def _strict(tier: Tier, api: ApiSpec) -> Tier:
    """A strict deployment rejects what it would otherwise ignore or clamp."""
    return "rejected" if api.strict and tier in ("ignored", "clamped") else tier


def _deployed(row: Row, tier: Tier, api: ApiSpec) -> Tier:
    """``tier`` as this deployment's flags shift it."""
    if row.clamps and api.max_tokens_policy == "clamp":
        tier = "clamped"
    if row.only_with and not getattr(api, row.only_with):
        tier = "rejected"
    return _strict(tier, api)


def rows(kind: Endpoint) -> tuple[Row, ...]:
    return {"responses": RESPONSES_ROWS, "embeddings": EMBEDDINGS_ROWS}.get(kind, ROWS)


def foreign(kind: Endpoint) -> tuple[Foreign, ...]:
    """The fields of other APIs the endpoint names (a 400 or ignored, never unknown)."""
    if kind == "embeddings":
        return EMBEDDINGS_FOREIGN
    return FOREIGN + RESPONSES_UNBUILT if kind == "responses" else FOREIGN


def tiers(kind: Endpoint, api: ApiSpec) -> dict[str, Tier]:
    """The tier of every request field of ``kind`` under ``api`` (``UNKNOWN`` for the
    rest), as GET /v1/capabilities publishes it."""
    out: dict[str, Tier] = {}
    for row in rows(kind):
        tier = row.tier(kind)
        if tier is not None:
            out.update({f: _deployed(row, tier, api) for f in row.fields})
    unknown = out.pop(UNKNOWN)
    out.update({f.field: _strict(f.tier, api) for f in foreign(kind)})
    out[UNKNOWN] = unknown
    return out


ENDPOINTS: tuple[Endpoint, ...] = ("chat", "completions", "responses", "embeddings")
# a field reaches the report only where its deployment accepted it (``only_with`` rows too)
_EXTENSIONS: dict[Endpoint, frozenset[str]] = {
    kind: frozenset(f for row in rows(kind) if row.tier(kind) == "extension"
                    for f in row.fields)
    for kind in ENDPOINTS}
_IGNORED: dict[Endpoint, tuple[tuple[str, str], ...]] = {
    kind: tuple((f, row.reason) for row in rows(kind) if row.tier(kind) == "ignored"
                for f in row.fields if f != UNKNOWN)
    for kind in ENDPOINTS}
_UNKNOWN_REASON = next(row.reason for row in ROWS if UNKNOWN in row.fields)
_VALUE = msgspec.json.Decoder()
_FOREIGN_FIELDS: dict[Endpoint, dict[str, Foreign]] = {
    kind: {f.field: f for f in foreign(kind)} for kind in ENDPOINTS}


def _value(req: msgspec.Struct, path: str) -> Any:
    """The request's value at a dotted field path (None where absent)."""
    value: Any = req
    for part in path.split("."):
        value = getattr(value, part, None)
        if value is None:
            return None
    return value


def foreign_notes(raw: Mapping[str, Any] | list[str], known: set[str],
                  kind: Endpoint = "chat") -> list[FieldNote]:
    """400 for a foreign field that would change the output; notes for the harmless ones."""
    notes = []
    table = _FOREIGN_FIELDS[kind]
    for key in raw:
        spec = table.get(key)
        if spec is None or key in known:
            continue
        if spec.tier == "rejected":
            value = _VALUE.decode(raw[key]) if isinstance(raw, dict) else None
            if not any(value == h and type(value) is type(h) for h in spec.harmless):
                raise ApiError(400, f"`{key}` is not supported by Candor ({spec.reason}); "
                               "remove it rather than have it ignored", key,
                               "unsupported_field")
            notes.append(FieldNote(key, f"the value asks for Candor's own behaviour "
                                   f"({spec.reason})"))
        else:
            notes.append(FieldNote(key, spec.reason))
    return notes


def report(raw_keys: Mapping[str, Any] | list[str],
           req: CompletionRequest | ChatCompletionRequest | ResponsesRequest | EmbeddingRequest,
           api: ApiSpec) -> CandorReport:
    """The ``candor`` report for a request whose body had ``raw_keys``: the ignored fields
    it sent (a 400 in strict mode), the extensions it used, and the defaults it took."""
    kind: Endpoint = ("chat" if isinstance(req, ChatCompletionRequest) else
                      "responses" if isinstance(req, ResponsesRequest) else
                      "embeddings" if isinstance(req, EmbeddingRequest) else "completions")
    known = set(req.__struct_fields__)
    ignored = [FieldNote(f, reason) for f, reason in _IGNORED[kind]
               if _value(req, f) is not None]
    ignored += foreign_notes(raw_keys, known, kind)
    ignored += [FieldNote(k, _UNKNOWN_REASON) for k in raw_keys
                if k not in known and k not in _FOREIGN_FIELDS[kind]]
    extensions = [k for k in raw_keys if k in _EXTENSIONS[kind]]
    strict = api.strict or req.strict
    if strict and ignored:
        note = ignored[0]
        raise ApiError(400, f"`{note.field}` would be ignored ({note.reason}); strict mode "
                       "turns ignored fields into errors", note.field, "ignored_field")
    defaults = [FieldNote(k, f"omitted; default from {api.sampling_defaults.source}", to=v)
                for k, v in api.sampling_defaults.items().items()
                if k not in raw_keys and kind != "embeddings"]
    return CandorReport(ignored=ignored, extensions=extensions, defaults=defaults,
                        strict=strict)
