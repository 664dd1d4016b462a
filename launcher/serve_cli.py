"""``candor serve``'s flags and their mapping onto a ``Topology``.

The flags are vLLM's wherever the meaning is the same (``candor serve MODEL``,
``--served-model-name a b``, ``--gpu-memory-utilization``, ``--enable-prefix-caching``,
``--generation-config`` ...), so a ``vllm serve`` command line moves over unchanged;
docs/migrating-from-vllm.md lists every flag. A flag Candor does not have fails, naming
the nearest one it does have. No process is started here and torch is not imported.
"""

from __future__ import annotations

import argparse
import difflib
import json
import os
import re

import msgspec

from cluster.topology import QUANTIZATION_CHOICES, Topology

DEFAULT_MODEL_DIR = os.path.expanduser(
    os.environ.get("CANDOR_MODEL_DIR", "~/.cache/candor/models/tiny-llama"))
LOG_LEVELS = ("critical", "error", "warning", "info", "debug")
SERVER_LOG_LEVELS = (*LOG_LEVELS, "trace")

# vLLM flags whose job Candor does differently: the message says what to use instead.
VLLM_ELSEWHERE = {
    "--trust-remote-code": "Candor never runs code from a checkpoint; its model registry "
                           "covers the architectures it serves (README, Models)",
    "--download-dir": "Candor does not download; it reads the Hugging Face cache "
                      "(HF_HOME / HF_HUB_CACHE) or a checkpoint directory",
    "--swap-space": "Candor preempts by recomputing; there is no CPU swap space",
    "--kv-cache-dtype": "the KV cache uses the compute dtype (--dtype)",
    "--lora-dtype": "adapters compute in the model's dtype (--dtype)",
    "--fully-sharded-loras": "Candor shards every adapter like the layer it adapts (B by "
                             "its output rows, A by its input columns on row-parallel "
                             "layers); there is no other mode",
    "--long-lora-scaling-factors": "long-context LoRA is not supported",
}

_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?i?b?)?\s*$", re.IGNORECASE)
_UNIT = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "kib": 2**10, "m": 10**6, "mb": 10**6,
         "mib": 2**20, "g": 10**9, "gb": 10**9, "gib": 2**30, "t": 10**12, "tb": 10**12,
         "tib": 2**40}


def parse_size(text: str) -> int:
    """Bytes from '4GiB', '512MiB', '2G', '1073741824' (vLLM's --kv-cache-memory-bytes
    spelling). A plain number is bytes."""
    match = _SIZE.match(text)
    unit = (match.group(2) or "").lower() if match else None
    if match is None or unit not in _UNIT:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (e.g. 4GiB, 512MiB, 2G)")
    return int(float(match.group(1)) * _UNIT[unit])


def _json_object(text: str) -> dict:
    """A JSON object flag (vLLM's --speculative-config); its keys are checked by the
    topology's struct, which names a bad one."""
    try:
        value = json.loads(text)
    except ValueError as err:
        raise argparse.ArgumentTypeError(f"not JSON: {err}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError("expected a JSON object")
    return value


def _media_directory(text: str) -> str:
    """--allowed-local-media-path: an existing directory, as its real path (symlinks
    resolved), which the files a file:// URL names must lie inside."""
    path = os.path.realpath(os.path.expanduser(text))
    if not os.path.isdir(path):
        raise argparse.ArgumentTypeError(f"{text!r} is not a directory")
    return path


def _mm_limit(text: str) -> int:
    """vLLM's --limit-mm-per-prompt '{"image": N}' -> the images one prompt may hold.
    Candor takes images only: another modality may be named with 0 (nothing to allow)."""
    value = _json_object(text)
    others = sorted(k for k, v in value.items() if k != "image" and v != 0)
    if others:
        raise argparse.ArgumentTypeError(f"this deployment takes images only; {others[0]!r} "
                                         "can only be 0")
    count = value.get("image", 16)
    if isinstance(count, dict):  # vLLM 0.10's {"image": {"count": N, ...}}
        count = count.get("count")
    if not isinstance(count, int) or isinstance(count, bool) or count < 0:
        raise argparse.ArgumentTypeError(f"\"image\" must be a count >= 0, not {count!r}")
    return count


def _str_list(text: str) -> list[str]:
    """vLLM passes lists as JSON ('["*"]'); a comma-separated list works too."""
    text = text.strip()
    if text.startswith("["):
        try:
            value = json.loads(text)
        except ValueError as err:
            raise argparse.ArgumentTypeError(f"not a JSON list: {err}") from None
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            raise argparse.ArgumentTypeError("expected a JSON list of strings")
        return value
    return [part.strip() for part in text.split(",") if part.strip()]


def _lora_module(text: str) -> dict:
    """vLLM's --lora-modules item: ``name=path`` or JSON ``{"name", "path",
    "base_model_name"}``."""
    if text.lstrip().startswith("{"):
        try:
            value = json.loads(text)
        except ValueError as err:
            raise argparse.ArgumentTypeError(f"not JSON: {err}") from None
        unknown = set(value) - {"name", "path", "base_model_name"} if isinstance(value, dict) else ()
        if not isinstance(value, dict) or unknown or not {"name", "path"} <= set(value):
            raise argparse.ArgumentTypeError(
                f"expected {{\"name\": ..., \"path\": ..., \"base_model_name\": ...}}, got "
                f"{text[:120]!r}" + (f" (unknown: {', '.join(sorted(unknown))})" if unknown else ""))
        return value
    name, eq, path = text.partition("=")
    if not eq or not name or not path:
        raise argparse.ArgumentTypeError(f"expected NAME=PATH or JSON, got {text[:120]!r}")
    return {"name": name, "path": path}


def _hf_overrides(text: str) -> dict:
    from launcher.hf_overrides import parse
    return parse(text)


def runtime_lora_env(environ: dict[str, str]) -> bool:
    """vLLM's switch for runtime adapter loading."""
    return environ.get("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "").strip().lower() in ("1", "true")


class ServeParser(argparse.ArgumentParser):
    """Unknown flags name the nearest known flag (difflib), or where the job lives."""

    def error(self, message: str):  # noqa: D102 - argparse's hook
        match = re.search(r"unrecognized arguments: (.*)", message)
        if match is None:  # one line, not the forty-line usage
            self.exit(2, f"{self.prog}: error: {message}\n{self.prog}: see "
                         "candor serve --help\n")
        known = sorted(s for a in self._actions for s in a.option_strings
                       if s.startswith("--"))
        lines = []
        after_flag = False
        for arg in match.group(1).split():
            flag = arg.split("=", 1)[0]
            if not flag.startswith("-"):
                if not after_flag:  # else: the unknown flag's value
                    lines.append(f"unexpected argument {arg!r}")
                after_flag = False
                continue
            after_flag = True
            if flag in VLLM_ELSEWHERE:
                lines.append(f"{flag} is a vLLM flag Candor does not take: "
                             f"{VLLM_ELSEWHERE[flag]}")
            else:
                near = difflib.get_close_matches(flag, known, n=1, cutoff=0.6)
                hint = f"; did you mean {near[0]}?" if near else ""
                lines.append(f"unknown flag {flag}{hint}")
        self.exit(2, "".join(f"{self.prog}: error: {line}\n" for line in lines)
                  + f"{self.prog}: the flags Candor takes: candor serve --help; "
                    "from vLLM: docs/migrating-from-vllm.md\n")


def normalize_argv(argv: list[str]) -> list[str]:
    """vLLM accepts --max_model_len for --max-model-len; so does Candor."""
    out = []
    for arg in argv:
        if arg.startswith("--") and "_" in arg.split("=", 1)[0]:
            name, eq, value = arg.partition("=")
            arg = name.replace("_", "-") + eq + value
        out.append(arg)
    return out


def add_serve_arguments(serve: argparse.ArgumentParser) -> None:
    g = serve.add_argument_group("model (vLLM's names)")
    g.add_argument("model_tag", nargs="?", default=None, metavar="MODEL",
                   help="a checkpoint directory or a Hugging Face repo id in the local HF "
                        "cache (same as --model)")
    g.add_argument("--model", default=None, help="as MODEL; a GGUF file works too (its "
                   "tokenizer, chat template and settings from its metadata)")
    g.add_argument("--tokenizer", default=None, metavar="DIR",
                   help="GGUF models: an HF tokenizer directory whose tokenizer and chat "
                        "template replace the file's")
    g.add_argument("--revision", default=None,
                   help="the hub cache snapshot to serve (a branch, tag or commit)")
    g.add_argument("--served-model-name", nargs="+", default=None, metavar="NAME",
                   help="the name(s) clients send as `model`; every name answers and "
                        "responses carry the one the client used (default: MODEL)")
    g.add_argument("--max-model-len", type=int, default=None)
    g.add_argument("--dtype", default="auto",
                   choices=["auto", "half", "float16", "bfloat16", "float", "float32"],
                   help="auto: the checkpoint's dtype on CUDA, float32 on CPU")
    g.add_argument("--load-format", default="auto", choices=["auto", "dummy"])
    g.add_argument("--quantization", "-q", default=None, choices=QUANTIZATION_CHOICES,
                   help="the checkpoint's quantized format, checked against its "
                        "quantization_config (default: read from it); weights stay quantized")
    g.add_argument("--runner", default=None, choices=["auto", "generate", "pooling"],
                   help="generate: the completion routes; pooling: /v1/embeddings (the "
                        "checkpoint's sentence-transformers pooling, else last token + L2), "
                        "/v1/score, /v1/rerank, /classify (a cross-encoder's head); "
                        "auto (default): pooling for a checkpoint without an LM head")
    g.add_argument("--hf-overrides", type=_hf_overrides, default=None, metavar="JSON",
                   help="config.json fields laid over the checkpoint's before anything reads "
                        "it (vLLM's flag), e.g. a yes/no reranker as published: "
                        "'{\"architectures\": [\"Qwen3ForSequenceClassification\"], "
                        "\"classifier_from_token\": [\"no\", \"yes\"], "
                        "\"is_original_qwen3_reranker\": true}'")
    g.add_argument("--task", default=None, metavar="auto|generate|embed|classify|score",
                   help="vLLM's older spelling: embed (embedding), classify and score are "
                        "--runner pooling")
    g.add_argument("--tensor-parallel-size", "-tp", type=int, default=1,
                   help="gpu_worker ranks sharing the model (torch.distributed: NCCL on "
                        "CUDA, gloo on CPU)")
    g.add_argument("--data-parallel-size", "-dp", type=int, default=1,
                   help="engine replicas (a scheduler and its ranks each) behind the same "
                        "frontends and tokenizer workers")
    g.add_argument("--data-parallel-routing", default="cache_aware",
                   choices=["cache_aware", "round_robin"],
                   help="cache_aware: same prompt prefix or cache_salt -> same replica "
                        "unless overloaded, else least loaded")
    g.add_argument("--prefill-replicas", type=int, default=None, metavar="P",
                   help="disaggregated serving: P replicas compute prompts (KV and the "
                        "first token) and hand each request to a decode replica; with "
                        "--decode-replicas, instead of --data-parallel-size")
    g.add_argument("--decode-replicas", type=int, default=None, metavar="D",
                   help="disaggregated serving: D replicas receive the prompt KV worker to "
                        "worker and decode")
    g.add_argument("--prefill-tensor-parallel-size", "--prefill-tp", type=int, default=None,
                   metavar="N", help="disaggregated serving: ranks per prefill replica "
                   "(default: --tensor-parallel-size); KV heads are re-sliced on the way "
                   "to a decode replica of another size")
    g.add_argument("--decode-tensor-parallel-size", "--decode-tp", type=int, default=None,
                   metavar="N", help="disaggregated serving: ranks per decode replica "
                   "(default: --tensor-parallel-size)")
    g.add_argument("--kv-transfer-timeout", type=float, default=10.0, metavar="SECONDS",
                   help="disaggregated serving: a decode replica that has not received a "
                        "prompt's KV after this long recomputes the prompt itself")
    g.add_argument("--kv-store-size", type=float, default=None, metavar="GiB",
                   help="a KV store shared by the replicas, holding this many GiB of full "
                        "prompt blocks in memory (LRU): a prefix any replica computed is a "
                        "prefix-cache hit on every replica")
    g.add_argument("--kv-store-dir", default=None, metavar="DIR",
                   help="the KV store's disk tier: blocks evicted from memory go to files "
                        "here (emptied at start), up to --kv-store-disk-size")
    g.add_argument("--kv-store-disk-size", type=float, default=16.0, metavar="GiB",
                   help="the disk tier's bound (LRU)")
    g.add_argument("--kv-store-timeout", type=float, default=0.5, metavar="SECONDS",
                   help="how long a replica waits for the KV store's answer before it "
                        "computes the prompt itself")
    g.add_argument("--generation-config", default="auto", metavar="auto|vllm|none|DIR",
                   help="auto: requests that omit temperature/top_p/top_k/min_p/"
                        "repetition_penalty get the checkpoint's generation_config.json "
                        "values (named in the response's candor report); vllm or none: "
                        "the API's defaults; DIR: that directory's generation_config.json")
    g.add_argument("--seed", type=int, default=0, help="seed of the engine's sampler")

    g = serve.add_argument_group("engine")
    g.add_argument("--device", default="auto",
                   help="auto (CUDA when torch sees it, else cpu), cpu, cuda or cuda:N")
    g.add_argument("--gpu-memory-utilization", type=float, default=0.9,
                   help="CUDA: the share of the device's memory Candor may fill (weights, "
                        "activations and the KV cache)")
    g.add_argument("--kv-cache-memory", "--kv-cache-memory-bytes", type=parse_size,
                   default=None, metavar="SIZE",
                   help="KV cache size (e.g. 4GiB; also VLLM_CPU_KVCACHE_SPACE in GiB); "
                        "default on CPU: 4x the weights, at least one full context, at most "
                        "--max-num-seqs full contexts and 25%% of free memory; on CUDA: "
                        "what --gpu-memory-utilization leaves")
    g.add_argument("--num-kv-blocks", type=int, default=None)
    g.add_argument("--max-num-seqs", type=int, default=64)
    g.add_argument("--max-num-batched-tokens", type=int, default=1024)
    g.add_argument("--worker-threads", type=int, default=None,
                   help="gpu_worker threads (default: adaptive, following the cores the "
                        "other processes leave idle)")
    g.add_argument("--max-waiting-requests", type=int, default=1024,
                   help="waiting-queue bound; past it requests get 503 (0: unbounded)")
    g.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction,
                   default=True, help="reuse the KV blocks of shared prompt prefixes")
    g.add_argument("--no-prefix-caching", dest="enable_prefix_caching", action="store_false",
                   help=argparse.SUPPRESS)
    g.add_argument("--enforce-eager", action="store_true",
                   help="no CUDA graphs for decode steps (used only on CUDA with flashinfer)")
    g.add_argument("--deterministic", action=argparse.BooleanOptionalAction, default=None,
                   help="batch-invariant kernels: a greedy or seeded request gets the same "
                        "tokens and logprobs, bitwise, whatever else runs (default: on where "
                        "the device supports it, reported in /v1/capabilities; "
                        "--deterministic: refuse to start without it; --no-deterministic: "
                        "off, for speed)")
    g.add_argument("--speculative-config", "-sc", type=_json_object, default=None,
                   metavar="JSON",
                   help='speculative decoding, vLLM\'s keys, e.g. \'{"method": "ngram", '
                        '"num_speculative_tokens": 4, "prompt_lookup_max": 4}\' or '
                        '\'{"method": "suffix"}\' (suffix_decoding_* keys) or \'{"method": '
                        '"draft_model", "model": DIR, "num_speculative_tokens": 4}\' (a smaller '
                        'checkpoint with the same tokenizer) or \'{"method": "eagle3", "model": '
                        'HEAD_DIR, "num_speculative_tokens": 4}\' (an EAGLE-3 head); the answer is the '
                        'same bits as without it where the deterministic mode is on (each '
                        'response says: candor.speculative.exact)')

    g = serve.add_argument_group("LoRA adapters (vLLM's names)")
    g.add_argument("--enable-lora", action="store_true",
                   help="serve PEFT LoRA adapters over the model; clients name one in `model`")
    g.add_argument("--lora-modules", nargs="+", type=_lora_module, default=[],
                   metavar="NAME=PATH|JSON",
                   help='adapters served from start: name=path, or JSON {"name": ..., '
                        '"path": ..., "base_model_name": ...} (the parent /v1/models shows)')
    g.add_argument("--max-loras", type=int, default=1,
                   help="distinct adapters in one batch (and resident on the device); "
                        "requests for another adapter wait")
    g.add_argument("--max-lora-rank", type=int, default=16,
                   help="the largest adapter rank served (a larger one is refused)")
    g.add_argument("--max-cpu-loras", type=int, default=None,
                   help="adapters kept in host memory (default: --max-loras); the others "
                        "are read from their files again when needed")
    g.add_argument("--allow-runtime-lora-updating", action="store_true",
                   help="mount POST /v1/load_lora_adapter and /v1/unload_lora_adapter "
                        "(behind the API key; also VLLM_ALLOW_RUNTIME_LORA_UPDATING=True)")
    g.add_argument("--lora-allowed-dirs", type=_str_list, default=[], metavar="DIRS",
                   help="the directories runtime loads may read adapters from (JSON list or "
                        "comma-separated; default: those holding the --lora-modules)")

    g = serve.add_argument_group("processes")
    g.add_argument("--frontends", type=int, default=1)
    g.add_argument("--tokenizer-workers", type=int, default=1)
    g.add_argument("--detokenizers", type=int, default=1)

    g = serve.add_argument_group("HTTP")
    g.add_argument("--host", default="127.0.0.1")
    g.add_argument("--port", type=int, default=8000)
    g.add_argument("--max-body-mb", type=int, default=32)
    g.add_argument("--api-key", action="append", default=[],
                   help="require 'Authorization: Bearer KEY' (repeat or comma-separate "
                        "for several; also CANDOR_API_KEY / VLLM_API_KEY)")
    g.add_argument("--api-key-file", default=None, help="a file of API keys, one a line")
    g.add_argument("--protect-ops", action="store_true",
                   help="/health, /metrics and /version need an API key too")
    g.add_argument("--allowed-origins", type=_str_list, default=[],
                   help="CORS origins (JSON list or comma-separated; '[\"*\"]' for any); "
                        "default: no CORS")
    g.add_argument("--allowed-methods", type=_str_list, default=["*"])
    g.add_argument("--allowed-headers", type=_str_list, default=["*"])
    g.add_argument("--allow-credentials", action="store_true")
    g.add_argument("--keepalive-timeout-s", type=float, default=75.0,
                   help="close idle connections (and ones that never finish their "
                        "request headers) after this long")
    g.add_argument("--body-read-timeout-s", type=float, default=60.0,
                   help="a request body must arrive within this long (408)")
    g.add_argument("--drain-timeout-s", type=float, default=30.0,
                   help="SIGTERM/Ctrl-C: how long in-flight requests may finish")

    g.add_argument("--metrics-compat", default="vllm", choices=["vllm", "none"],
                   help="vllm (default): /metrics also exports vLLM's metric names, so "
                        "vLLM dashboards and alerts work; none: Candor's names only")

    g = serve.add_argument_group("logging")
    g.add_argument("--log-level", default=None, choices=LOG_LEVELS,
                   help="every process's log level (default info; CANDOR_LOG_LEVEL)")
    g.add_argument("--uvicorn-log-level", default="warning", choices=SERVER_LOG_LEVELS,
                   help="the HTTP server's own log level; debug or trace adds an access log")
    g.add_argument("--enable-log-requests", dest="log_requests", action="store_true",
                   default=False, help="one log line per generation request")
    g.add_argument("--disable-log-requests", dest="log_requests", action="store_false",
                   help="no per-request log lines (the default)")
    g.add_argument("--disable-log-stats", action="store_true",
                   help="accepted for vLLM compatibility: Candor logs no periodic stats "
                        "(they are on /metrics)")

    g = serve.add_argument_group("API policy")
    g.add_argument("--strict", action="store_true",
                   help="every ignored or clamped request field is a 400 naming it")
    g.add_argument("--max-tokens-policy", default="reject", choices=["reject", "clamp"],
                   help="prompt + max_tokens beyond the context: 400 (reject) or clamp")
    g.add_argument("--chat-template", default=None, metavar="PATH_OR_TEMPLATE",
                   help="a Jinja chat template (a file, or the template itself) that "
                        "replaces the checkpoint's")
    g.add_argument("--allow-request-chat-template", action="store_true",
                   help="accept a chat_template field in request bodies")
    g.add_argument("--scheduling-policy", default="fcfs", choices=["fcfs", "priority"],
                   help="fcfs (default): waiting requests run in arrival order and a "
                        "non-zero request `priority` is a 400; priority: lower `priority` "
                        "first (no aging: trusted clients only)")
    g.add_argument("--tool-call-parser", default="auto",
                   help="how tool calls are read from text under tool_choice auto: "
                        "hermes, llama3_json, mistral, deepseek_v31, granite, pythonic; "
                        "auto (default) detects it from the chat template; none")
    g.add_argument("--enable-auto-tool-choice", action="store_true",
                   help="accepted for vLLM command lines: tool_choice auto is on whenever a "
                        "tool-call parser is configured or detected")
    g.add_argument("--reasoning-parser", default="auto",
                   help="<think> blocks -> reasoning_content: qwen3, deepseek_r1; auto "
                        "(default) detects it from the chat template where clear; none")
    g.add_argument("--max-logprobs", type=int, default=None,
                   help="most logprobs / top_logprobs alternatives per token (default 20); "
                        "other request limits: the topology YAML's api.limits")
    g.add_argument("--max-n", type=int, default=None, help="most choices per request")
    g.add_argument("--max-prompts", type=int, default=None,
                   help="most prompts in one /v1/completions request")
    g.add_argument("--max-request-share", type=float, default=None,
                   help="largest fraction of the waiting queue one request may fill")
    g.add_argument("--limit-mm-per-prompt", type=_mm_limit, default=None, metavar="JSON",
                   help='images one prompt may hold, as vLLM: \'{"image": 2}\' (default 16; '
                        "a model that takes images only)")
    g.add_argument("--max-image-bytes", type=parse_size, default=None, metavar="SIZE",
                   help="largest encoded image a request may send (default 20MiB)")
    g.add_argument("--max-image-pixels", type=int, default=None,
                   help="largest decoded image, width x height, read from its header before "
                        "decoding (default 16777216, 4096x4096)")
    g.add_argument("--allowed-media-domains", nargs="+", type=_str_list, default=None,
                   metavar="HOST",
                   help="hosts whose http(s) image URLs the server fetches, as vLLM (exact "
                        "names, any port; space- or comma-separated, or a JSON list); default "
                        "none: only data: URLs")
    g.add_argument("--allowed-local-media-path", type=_media_directory, default=None,
                   metavar="DIR",
                   help="directory whose files file:// image URLs may name, as vLLM (only "
                        "files whose real path lies inside it); default none: no file:// URLs")
    g.add_argument("--media-fetch-timeout", type=float, default=None, metavar="SECONDS",
                   help="most seconds one image URL's fetch may take, redirects included "
                        "(default 10)")
    g.add_argument("--media-max-redirects", type=int, default=None,
                   help="redirects an image URL's fetch follows, each to an allowed host "
                        "(default 5; 0: none)")
    g.add_argument("--responses-store-max-entries", type=int, default=10_000,
                   help="/v1/responses kept for previous_response_id and GET, per frontend "
                        "(oldest first out; 0: store nothing)")
    g.add_argument("--responses-store-max-bytes", type=parse_size, default=256 << 20,
                   metavar="SIZE", help="encoded size of the stored responses, per "
                   "frontend (e.g. 256MiB)")
    g.add_argument("--responses-store-ttl-s", type=float, default=3600.0,
                   help="a stored response is gone this many seconds after it was stored")


def serve_parser() -> ServeParser:
    parser = ServeParser(prog="candor serve", allow_abbrev=False, description="Serve a checkpoint directory or "
                         "a Hugging Face repo id from the local cache; the flags are vLLM's "
                         "where the meaning is the same (docs/migrating-from-vllm.md).")
    add_serve_arguments(parser)
    return parser


class ServeArgsError(Exception):
    """The flags are individually fine but do not fit together."""


def model_argument(args: argparse.Namespace) -> str:
    if args.model_tag and args.model and args.model_tag != args.model:
        raise ServeArgsError(f"MODEL {args.model_tag!r} and --model {args.model!r} differ; "
                             "give one")
    return args.model_tag or args.model or DEFAULT_MODEL_DIR


# classify / score: a cross-encoder on the pooling runner (/v1/score, /v1/rerank, /classify)
_TASKS = {"auto": "auto", "generate": "generate", "embed": "pooling", "embedding": "pooling",
          "classify": "pooling", "score": "pooling"}


def runner(args: argparse.Namespace) -> str:
    """--runner, or vLLM's --task as its alias (they must agree when both are given)."""
    if args.task is None:
        return args.runner or "auto"
    if args.task not in _TASKS:
        raise ServeArgsError(f"--task {args.task} is not served by Candor (auto, generate, "
                             "embed, classify, score); reward models are not supported")
    if args.runner is not None and args.runner != _TASKS[args.task]:
        raise ServeArgsError(f"--task {args.task} means --runner {_TASKS[args.task]}, but "
                             f"--runner {args.runner} was given; give one")
    return _TASKS[args.task]


def kv_cache_mb(args: argparse.Namespace, environ: dict[str, str]) -> int | None:
    """--kv-cache-memory, else vLLM's VLLM_CPU_KVCACHE_SPACE (GiB), else None (auto)."""
    if args.kv_cache_memory is not None:
        return max(1, args.kv_cache_memory // 2**20)
    space = environ.get("VLLM_CPU_KVCACHE_SPACE", "").strip()
    if space and space != "0":
        try:
            return int(float(space) * 1024)
        except ValueError:
            raise ServeArgsError(f"VLLM_CPU_KVCACHE_SPACE={space!r} is not a number of "
                                 "GiB") from None
    return None


def _replicas(args: argparse.Namespace) -> dict:
    """``replicas`` and, with --prefill-replicas/--decode-replicas, ``disaggregation``."""
    p, d = args.prefill_replicas, args.decode_replicas
    per_role = {"prefill_tensor_parallel": args.prefill_tensor_parallel_size,
                "decode_tensor_parallel": args.decode_tensor_parallel_size}
    if p is None and d is None:
        if any(v is not None for v in per_role.values()):
            raise ServeArgsError("--prefill-tensor-parallel-size and "
                                 "--decode-tensor-parallel-size need --prefill-replicas and "
                                 "--decode-replicas")
        return {"replicas": args.data_parallel_size}
    if p is None or d is None:
        raise ServeArgsError("--prefill-replicas and --decode-replicas go together")
    if args.data_parallel_size not in (1, p + d):
        raise ServeArgsError(f"--data-parallel-size {args.data_parallel_size} does not match "
                         f"--prefill-replicas {p} + --decode-replicas {d}")
    return {"replicas": p + d, "disaggregation": {
        "prefill_replicas": p, "decode_replicas": d,
        "transfer_timeout_s": args.kv_transfer_timeout,
        **{k: v for k, v in per_role.items() if v is not None}}}


def _kv_store(args: argparse.Namespace) -> dict:
    """``kv_store`` with --kv-store-size (its other flags need it)."""
    if args.kv_store_size is None:
        if args.kv_store_dir is not None:
            raise ServeArgsError("--kv-store-dir needs --kv-store-size")
        return {}
    return {"kv_store": {"size_gib": args.kv_store_size, "dir": args.kv_store_dir,
                         "disk_size_gib": args.kv_store_disk_size,
                         "lookup_timeout_s": args.kv_store_timeout}}


def serve_topology(args: argparse.Namespace, model_path: str, default_name: str,
                   environ: dict[str, str] | None = None) -> Topology:
    """The flags as a topology, validated by the same constraints as a YAML file.
    ``model_path``: the resolved checkpoint directory; ``default_name``: the served name
    without --served-model-name (MODEL as given, like vLLM)."""
    env = os.environ if environ is None else environ
    names = args.served_model_name or [default_name]
    if not args.enable_lora:
        given = [flag for flag, value in (("--lora-modules", args.lora_modules),
                                          ("--allow-runtime-lora-updating",
                                           args.allow_runtime_lora_updating),
                                          ("--lora-allowed-dirs", args.lora_allowed_dirs)) if value]
        if given:
            raise ServeArgsError(f"{given[0]} needs --enable-lora")
    return msgspec.convert({
        "tensor_parallel": args.tensor_parallel_size,
        **_replicas(args),
        **_kv_store(args),
        "router": {"policy": args.data_parallel_routing},
        "model": {"path": model_path, "tokenizer": args.tokenizer,
                  "served_model_name": names if len(names) > 1 else names[0],
                  "max_model_len": args.max_model_len, "dtype": args.dtype,
                  "load_format": args.load_format, "runner": runner(args),
                  "quantization": args.quantization,
                  "generation_config": args.generation_config,
                  "hf_overrides": args.hf_overrides or {},
                  "lora": {"enabled": args.enable_lora, "modules": args.lora_modules,
                           "max_loras": args.max_loras, "max_lora_rank": args.max_lora_rank,
                           "max_cpu_loras": args.max_cpu_loras,
                           "allow_runtime_updates": args.enable_lora and (
                               args.allow_runtime_lora_updating or runtime_lora_env(env)),
                           "allowed_dirs": args.lora_allowed_dirs}},
        "roles": {"api_frontend": args.frontends, "tokenizer_worker": args.tokenizer_workers,
                  "detokenizer": args.detokenizers},
        "engine": {"num_kv_blocks": args.num_kv_blocks, "max_num_seqs": args.max_num_seqs,
                   "kv_cache_memory_mb": kv_cache_mb(args, env),
                   "gpu_memory_utilization": args.gpu_memory_utilization,
                   "max_num_batched_tokens": args.max_num_batched_tokens,
                   "worker_threads": args.worker_threads, "seed": args.seed,
                   "max_waiting_requests": args.max_waiting_requests,
                   "enable_prefix_caching": args.enable_prefix_caching,
                   "device": args.device, "enforce_eager": args.enforce_eager,
                   "deterministic": args.deterministic,
                   "speculative_config": args.speculative_config},
        "http": {"host": args.host, "port": args.port, "max_body_mb": args.max_body_mb,
                 "keepalive_timeout_s": args.keepalive_timeout_s,
                 "body_read_timeout_s": args.body_read_timeout_s,
                 "api_key_file": args.api_key_file, "protect_ops": args.protect_ops,
                 "cors": {"allowed_origins": args.allowed_origins,
                          "allowed_methods": args.allowed_methods,
                          "allowed_headers": args.allowed_headers,
                          "allow_credentials": args.allow_credentials},
                 "server_log_level": args.uvicorn_log_level,
                 "log_requests": args.log_requests,
                 "metrics_compat": args.metrics_compat},
        # tokenizer workers hold no state: one that dies (or that its watchdog stops
        # because a request got stuck) comes back, and only its requests fail
        "supervision": {"drain_timeout_s": args.drain_timeout_s,
                        "restart": ["tokenizer_worker"]},
        "api": {"strict": args.strict, "max_tokens_policy": args.max_tokens_policy,
                "chat_template": args.chat_template,
                "allow_request_chat_template": args.allow_request_chat_template,
                "scheduling_policy": args.scheduling_policy,
                "tool_call_parser": None if args.tool_call_parser == "none"
                else args.tool_call_parser,
                "reasoning_parser": None if args.reasoning_parser == "none"
                else args.reasoning_parser,
                "responses_store": {"max_entries": args.responses_store_max_entries,
                                    "max_bytes": args.responses_store_max_bytes,
                                    "ttl_s": args.responses_store_ttl_s},
                "limits": {name: value for name, value in (
                    ("max_n", args.max_n), ("max_logprobs", args.max_logprobs),
                    ("max_prompts", args.max_prompts),
                    ("max_request_share", args.max_request_share),
                    ("max_images_per_prompt", args.limit_mm_per_prompt),
                    ("max_image_bytes", args.max_image_bytes),
                    ("max_image_pixels", args.max_image_pixels),
                    ("allowed_media_domains", None if args.allowed_media_domains is None
                     else [host for hosts in args.allowed_media_domains for host in hosts]),
                    ("allowed_local_media_path", args.allowed_local_media_path),
                    ("media_fetch_timeout_s", args.media_fetch_timeout),
                    ("media_max_redirects", args.media_max_redirects)) if value is not None}},
    }, Topology)
