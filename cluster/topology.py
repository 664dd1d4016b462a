"""The topology: which roles run, how many, and the ZeroMQ addresses between them.

A YAML file decodes straight into ``Topology`` (msgspec.yaml, unknown keys rejected, so
a typo names the bad key). ``resolve`` turns its address templates into one address set
per engine replica; ``cluster.process_config`` cuts it into each process's config.
"""

from __future__ import annotations

import ipaddress
import os
import re
from dataclasses import dataclass
from typing import Annotated, Any, Literal

import msgspec
from msgspec import Meta

from protocol.security import SecuritySpec

ROLES = ("api_frontend", "tokenizer_worker", "scheduler", "gpu_worker", "detokenizer")
# roles a topology may leave out (placed with the scheduler when nodes do not name them)
OPTIONAL_ROLES = ("kv_store",)
RoleName = Literal["api_frontend", "tokenizer_worker", "scheduler", "gpu_worker", "detokenizer",
                   "kv_store"]
NodeName = Annotated[str, Meta(pattern=r"^[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?$")]
LOCAL_NODE = "local"

Count = Annotated[int, Meta(ge=1, le=64)]
Port = Annotated[int, Meta(ge=1, le=65535)]


class LoraModuleSpec(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """One PEFT LoRA adapter served from start (vLLM's ``--lora-modules``): clients name
    it in ``model``; ``base_model_name`` is the ``parent`` /v1/models shows (default:
    the base model's served name)."""

    name: Annotated[str, Meta(min_length=1, max_length=256)]
    path: str
    base_model_name: str | None = None

    def resolved_path(self) -> str:
        return os.path.abspath(os.path.expanduser(self.path))


class LoraSpec(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """LoRA adapters over the base model (vLLM's ``--enable-lora`` and its flags).

    ``max_loras``: distinct adapters in one step and resident on the device (a request
    for another adapter waits until one of them has no running request);
    ``max_cpu_loras``: adapters kept in host memory (None: ``max_loras``), the others
    are read again from their files when needed; ``max_lora_rank``: the largest rank an
    adapter may have. ``allow_runtime_updates`` mounts POST /v1/load_lora_adapter and
    /v1/unload_lora_adapter (vLLM's ``VLLM_ALLOW_RUNTIME_LORA_UPDATING``), which load
    only from ``allowed_dirs`` (default: the directories holding ``modules``)."""

    enabled: bool = False
    modules: list[LoraModuleSpec] = []
    max_loras: Annotated[int, Meta(ge=1, le=256)] = 1
    max_lora_rank: Annotated[int, Meta(ge=1, le=1024)] = 16
    max_cpu_loras: Annotated[int, Meta(ge=1)] | None = None
    allow_runtime_updates: bool = False
    allowed_dirs: list[str] = []

    @property
    def host_capacity(self) -> int:
        return max(self.max_cpu_loras or self.max_loras, self.max_loras)

    def allowed_roots(self) -> list[str]:
        """Directories runtime loads may read from: the named ones, else the parents of
        the start-up adapters' directories (absolute, normalised)."""
        dirs = self.allowed_dirs or [os.path.dirname(m.resolved_path().rstrip("/"))
                                     for m in self.modules]
        return list(dict.fromkeys(os.path.abspath(os.path.expanduser(d)) for d in dirs))


QUANTIZATION_CHOICES = ("gptq", "gptq_marlin", "awq", "awq_marlin", "compressed-tensors", "fp8", "gguf")


class ModelSpec(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """``served_model_name``: one name or several (aliases; the first is the primary,
    every one answers). ``generation_config``: where requests that omit a sampling
    field get its default: auto (the checkpoint's generation_config.json), vllm or none
    (the API's own defaults), or a directory holding a generation_config.json.
    ``runner`` (vLLM's --runner): generate serves the completion routes; pooling serves
    /v1/embeddings (``cluster.pooling``); auto is pooling for a checkpoint without an LM
    head (a base ``*Model`` architecture) and generate otherwise. ``lora``: adapters
    served over this model. ``path`` may be a GGUF file (``launcher.gguf_checkpoint``);
    ``tokenizer`` (vLLM's --tokenizer, GGUF files only): an HF tokenizer directory whose
    tokenizer and chat template replace those of the file's metadata."""

    path: str
    tokenizer: str | None = None
    served_model_name: str | list[str] | None = None
    generation_config: str = "auto"
    max_model_len: Annotated[int, Meta(ge=16)] | None = None
    dtype: Literal["auto", "half", "float16", "bfloat16", "float", "float32"] = "auto"
    load_format: Literal["auto", "dummy"] = "auto"
    # vLLM's --quantization names: checked against the checkpoint's own format
    quantization: Literal[QUANTIZATION_CHOICES] | None = None
    runner: Literal["auto", "generate", "pooling"] = "auto"
    lora: LoraSpec = msgspec.field(default_factory=LoraSpec)
    # vLLM's --hf-overrides: config.json fields laid over the checkpoint's before any role
    # reads it (launcher.hf_overrides serves them from a directory of their own)
    hf_overrides: dict[str, Any] = {}

    def runner_kind(self) -> str:
        """generate | pooling (auto settled from the checkpoint; without its config.json
        here, generate)."""
        if self.runner != "auto":
            return self.runner
        from cluster.pooling import auto_runner
        try:
            return auto_runner(self.resolved_path())
        except (OSError, ValueError):
            return "generate"

    def resolved_path(self) -> str:
        return os.path.abspath(os.path.expanduser(self.path))

    def names(self) -> list[str]:
        if isinstance(self.served_model_name, list) and self.served_model_name:
            return list(self.served_model_name)
        if isinstance(self.served_model_name, str) and self.served_model_name:
            return [self.served_model_name]
        return [os.path.basename(self.resolved_path().rstrip("/"))]

    def name(self) -> str:
        return self.names()[0]


SPECULATIVE_METHODS = ("ngram", "suffix", "draft_model", "eagle", "eagle3", "medusa", "mlp_speculator",
                       "mtp")
SERVED_SPECULATIVE_METHODS = ("ngram", "suffix", "draft_model", "eagle3")
# vLLM's defaults for suffix decoding's keys
SUFFIX_DEFAULTS = {"suffix_decoding_max_tree_depth": 24,
                   "suffix_decoding_max_cached_requests": 10000,
                   "suffix_decoding_max_spec_factor": 1.0,
                   "suffix_decoding_min_token_prob": 0.1}


class SpeculativeSpec(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """Speculative decoding (vLLM's ``--speculative-config`` JSON, its keys): each decode
    step feeds up to ``num_speculative_tokens`` drafted tokens after the last one and
    keeps the longest run the model itself would have produced, plus one token of its
    own, so the answer is the same bits as without it (scheduler/speculation.py).

    ``method`` ngram (prompt lookup): the drafts follow the latest earlier occurrence of
    the sequence's last n tokens, longest n first, ``prompt_lookup_min`` <= n <=
    ``prompt_lookup_max`` (vLLM's defaults: both 5 when neither is given, else the one
    given); ``num_speculative_tokens`` is required. ``method`` suffix (suffix decoding,
    scheduler/suffix.py): the drafts follow the longest recent suffix (at most
    ``suffix_decoding_max_tree_depth`` ids) that occurred in the request's own ids or in
    the outputs of the last ``suffix_decoding_max_cached_requests`` finished requests,
    along their most frequent continuation, at most ``suffix_decoding_max_spec_factor``
    times the match length, while its estimated probability stays at least
    ``suffix_decoding_min_token_prob``; ``num_speculative_tokens`` defaults to the tree
    depth, as vLLM's (at most 32 here). A key of the other method is refused, never
    ignored. ``disable_by_batch_size``: no drafts while this many requests or more are
    running (a full batch is compute-bound; verifying drafts then costs more than it
    saves). ``method`` draft_model: ``model``, a smaller checkpoint with the target's
    tokenizer (a directory or a GGUF file), proposes ``num_speculative_tokens`` (required)
    greedy drafts per step on the gpu_worker (gpu_worker/draft_model.py); as vLLM, a
    ``model`` with no ``method`` means draft_model, and no ``method`` at all ngram.
    ``method`` eagle3: ``model``, an EAGLE-3 head in vLLM's checkpoint layout, proposes
    ``num_speculative_tokens`` (required) greedy drafts per step from the target's hidden
    states (gpu_worker/eagle3.py). Other methods are refused at start: not yet served."""

    method: Literal[SPECULATIVE_METHODS] | None = None
    num_speculative_tokens: Annotated[int, Meta(ge=1, le=32)] | None = None
    prompt_lookup_min: Annotated[int, Meta(ge=1, le=64)] | None = None
    prompt_lookup_max: Annotated[int, Meta(ge=1, le=64)] | None = None
    suffix_decoding_max_tree_depth: Annotated[int, Meta(ge=1, le=64)] | None = None
    suffix_decoding_max_cached_requests: Annotated[int, Meta(ge=0, le=1_000_000)] | None = None
    suffix_decoding_max_spec_factor: Annotated[float, Meta(gt=0.0, le=64.0)] | None = None
    suffix_decoding_min_token_prob: Annotated[float, Meta(ge=0.0, le=1.0)] | None = None
    disable_by_batch_size: Annotated[int, Meta(ge=2)] | None = None
    model: str | None = None  # the draft checkpoint (draft_model) or EAGLE-3 head (eagle3)

    def __post_init__(self) -> None:
        if self.method is None:  # vLLM's reading: a draft model if one is named
            self.method = "draft_model" if self.model is not None else "ngram"
        if self.method not in SERVED_SPECULATIVE_METHODS:
            raise ValueError(f"speculative method {self.method!r} is not yet served (served: "
                             f"{', '.join(SERVED_SPECULATIVE_METHODS)})")
        lookup = [k for k in ("prompt_lookup_min", "prompt_lookup_max")
                  if getattr(self, k) is not None]
        suffix = [k for k in SUFFIX_DEFAULTS if getattr(self, k) is not None]
        if self.method in ("draft_model", "eagle3"):
            what = "the draft checkpoint" if self.method == "draft_model" else "the EAGLE-3 head"
            if self.model is None:
                raise ValueError(f"method {self.method!r} needs `model` ({what})")
            if lookup or suffix:
                raise ValueError(f"{', '.join(lookup + suffix)}: not a key of method "
                                 f"{self.method} (it drafts with `model`)")
            if self.num_speculative_tokens is None:
                raise ValueError(f"method {self.method!r} needs num_speculative_tokens")
            self.model = os.path.abspath(os.path.expanduser(self.model))
            return
        if self.model is not None:
            raise ValueError(f"speculative method {self.method!r} takes no `model` (it drafts "
                             "from the sequence itself)")
        if self.method == "suffix":
            if lookup:
                raise ValueError(f"{', '.join(lookup)}: method ngram's, not suffix's")
            for key, value in SUFFIX_DEFAULTS.items():
                if getattr(self, key) is None:
                    setattr(self, key, value)
            if self.num_speculative_tokens is None:
                self.num_speculative_tokens = min(32, self.suffix_decoding_max_tree_depth)
            return
        if suffix:
            raise ValueError(f"{', '.join(suffix)}: method suffix's, not {self.method}'s")
        if self.num_speculative_tokens is None:
            raise ValueError(f"method {self.method!r} needs num_speculative_tokens")
        low, high = self.prompt_lookup_min, self.prompt_lookup_max
        if low is None and high is None:
            low = high = 5
        low, high = low or high, high or low
        if low > high:
            raise ValueError(f"prompt_lookup_min ({low}) is greater than prompt_lookup_max "
                             f"({high})")
        self.prompt_lookup_min, self.prompt_lookup_max = low, high


class EngineSpec(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """``device`` auto: CUDA when torch sees it, else CPU. KV cache size, first set wins:
    ``num_kv_blocks``, ``kv_cache_memory_mb``, else sized from free memory (on CUDA,
    ``gpu_memory_utilization`` of the device). ``worker_threads`` unset: adaptive, the
    cores the other processes leave idle (``gpu_worker.thread_governor``; logged)."""

    device: str = "auto"
    block_size: Annotated[int, Meta(ge=1, le=256)] = 16
    num_kv_blocks: Annotated[int, Meta(ge=2)] | None = None
    kv_cache_memory_mb: Annotated[int, Meta(ge=1)] | None = None
    gpu_memory_utilization: Annotated[float, Meta(gt=0.0, le=1.0)] = 0.9
    max_num_seqs: Annotated[int, Meta(ge=1)] = 64
    max_num_batched_tokens: Annotated[int, Meta(ge=16)] = 1024
    worker_threads: Annotated[int, Meta(ge=1)] | None = None
    seed: int = 0
    max_waiting_requests: Annotated[int, Meta(ge=0)] = 1024  # 0: unbounded
    enable_prefix_caching: bool = True
    # No CUDA graphs: decode-only steps launch eagerly (vLLM's --enforce-eager). Graphs
    # are used only with the flashinfer backend on CUDA; elsewhere this changes nothing.
    enforce_eager: bool = False
    # Batch-invariant kernels (same request, same bits, whatever the batch): unset = on
    # where the device has them (CPU, fp32), else off with the reason reported; true =
    # required (a worker that cannot refuses to start); false = off, for speed.
    deterministic: bool | None = None
    # Speculative decoding (None: off); vLLM's --speculative-config
    speculative_config: SpeculativeSpec | None = None


class CorsSpec(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """Cross-origin access for browser clients (vLLM's --allowed-origins etc.). No
    origins: no CORS headers at all (vLLM allows every origin by default; Candor asks)."""

    allowed_origins: list[str] = []
    allowed_methods: list[str] = msgspec.field(default_factory=lambda: ["*"])
    allowed_headers: list[str] = msgspec.field(default_factory=lambda: ["*"])
    allow_credentials: bool = False


class HttpSpec(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """The HTTP listener. ``keepalive_timeout_s`` also bounds how long a new connection
    may take to send its request headers (slowloris); ``body_read_timeout_s`` bounds
    reading one request body. API keys never live here (the topology travels on the
    children's command lines): ``api_key_file`` names a file of keys, one per line, and
    the launcher hands the keys to the frontends through their environment.
    ``protect_ops``: /health, /metrics and /version need a key too."""

    host: str = "127.0.0.1"
    port: Port = 8000
    max_body_mb: Annotated[int, Meta(ge=1)] = 32
    keepalive_timeout_s: Annotated[float, Meta(gt=0, le=3600)] = 75.0
    body_read_timeout_s: Annotated[float, Meta(gt=0, le=3600)] = 60.0
    api_key_file: str | None = None
    protect_ops: bool = False
    cors: CorsSpec = msgspec.field(default_factory=CorsSpec)
    # aiohttp's own loggers (vLLM's --uvicorn-log-level); debug or trace also turns
    # on the access log (one line per request)
    server_log_level: Literal["critical", "error", "warning", "info", "debug", "trace"] = \
        "warning"
    log_requests: bool = False  # one log line per generation request (--enable-log-requests)
    # /metrics also exports vLLM's metric names (vllm:...) derived at scrape time
    metrics_compat: Literal["vllm", "none"] = "vllm"


# a host name or an IPv4 address, as an allow-list entry names it
_HOST_NAME = re.compile(r"[a-z0-9_]([a-z0-9_.-]*[a-z0-9_])?")


def _media_host(name: str) -> str:
    """An allow-list entry as the host a URL names (lower case; IPv6 without brackets)."""
    host = name.strip().lower().rstrip(".")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    if ":" in host:
        ipaddress.IPv6Address(host)  # ValueError for anything else (a port, a scheme)
    elif not _HOST_NAME.fullmatch(host):
        raise ValueError(host)
    return host


class RequestLimits(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """Bounds on every fan-out a request can ask for, checked in the frontend before any
    work (400 naming the field and the limit) and published by GET /v1/capabilities.

    ``max_request_share`` is the fraction of the engine's waiting queue one request's
    choices (n x prompts) may take, so one client cannot fill the queue for everyone.
    The template bounds cover request-supplied and server templates alike: source size,
    wall time of one render (the rendered text itself is bounded by the context). The image
    bounds: the count in the frontend, bytes and pixels in the tokenizer worker, which
    decodes images; an http(s) image URL is fetched by the frontend, only from the hosts
    listed, within the byte, time and redirect bounds."""

    max_n: Annotated[int, Meta(ge=1)] = 128
    max_prompts: Annotated[int, Meta(ge=1)] = 256
    max_embedding_inputs: Annotated[int, Meta(ge=1)] = 2048  # OpenAI's bound
    max_logprobs: Annotated[int, Meta(ge=0)] = 20
    max_stop_strings: Annotated[int, Meta(ge=0)] = 64
    max_stop_string_chars: Annotated[int, Meta(ge=1)] = 1024
    max_stop_token_ids: Annotated[int, Meta(ge=0)] = 1024
    max_logit_bias: Annotated[int, Meta(ge=0)] = 1024
    max_messages: Annotated[int, Meta(ge=1)] = 4096
    max_tools: Annotated[int, Meta(ge=0)] = 128
    max_request_share: Annotated[float, Meta(gt=0.0, le=1.0)] = 0.25
    max_template_bytes: Annotated[int, Meta(ge=1024)] = 1 << 20
    template_render_timeout_s: Annotated[float, Meta(gt=0.0, le=600.0)] = 2.0
    # images (a model that takes them): how many one prompt may hold (vLLM's
    # --limit-mm-per-prompt '{"image": N}'), and the most one image may be, as its encoded
    # file and as decoded width x height (checked from its header before it is decoded)
    max_images_per_prompt: Annotated[int, Meta(ge=0)] = 16
    max_image_bytes: Annotated[int, Meta(ge=1)] = 20 << 20
    max_image_pixels: Annotated[int, Meta(ge=1)] = 4096 * 4096
    # http(s) image URLs: the hosts the frontend may fetch from (vLLM's
    # --allowed-media-domains; exact host names, any port; empty: none, only data: URLs),
    # the wall time one image's fetch may take, redirects included, and how many redirects
    # it follows (each to a listed host; 0: none, as vLLM's VLLM_MEDIA_URL_ALLOW_REDIRECTS=0)
    allowed_media_domains: list[str] = msgspec.field(default_factory=list)
    media_fetch_timeout_s: Annotated[float, Meta(gt=0.0, le=600.0)] = 10.0
    media_max_redirects: Annotated[int, Meta(ge=0, le=20)] = 5
    # file:// image URLs: the directory the frontend may read them from (vLLM's
    # --allowed-local-media-path; an absolute path; "": none, a file:// URL is refused)
    allowed_local_media_path: str = ""

    def __post_init__(self) -> None:
        domains = []
        for name in self.allowed_media_domains:
            try:
                domains.append(_media_host(name))
            except ValueError:
                raise ValueError(f"allowed_media_domains: {name!r} is not a host name (write "
                                 "the host alone, as example.com or 127.0.0.1: no scheme, port "
                                 "or path)") from None
        self.allowed_media_domains = domains
        if self.allowed_local_media_path and not self.allowed_local_media_path.startswith("/"):
            raise ValueError(f"allowed_local_media_path: {self.allowed_local_media_path!r} is not "
                             "an absolute path")


class SamplingDefaults(msgspec.Struct, forbid_unknown_fields=True, kw_only=True,
                       omit_defaults=True):
    """Values a request that omits the field gets instead of the API's default, and
    where they came from (named in every response's report). The launcher fills these
    from ``model.generation_config``; a topology file may also set them."""

    temperature: Annotated[float, Meta(ge=0.0, le=2.0)] | None = None
    top_p: Annotated[float, Meta(gt=0.0, le=1.0)] | None = None
    top_k: Annotated[int, Meta(ge=-1)] | None = None
    min_p: Annotated[float, Meta(ge=0.0, le=1.0)] | None = None
    repetition_penalty: Annotated[float, Meta(gt=0.0, le=2.0)] | None = None
    source: str = "topology"

    def items(self) -> dict[str, float | int]:
        return {k: v for k in SAMPLING_DEFAULT_FIELDS if (v := getattr(self, k)) is not None}


SAMPLING_DEFAULT_FIELDS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")


class ResponsesStoreSpec(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """The bounds of each frontend's store of ``/v1/responses`` results (``store: true``,
    the default), which ``previous_response_id`` continues and GET /v1/responses/{id}
    reads. In memory: oldest entries go first past ``max_entries`` or ``max_bytes``
    (encoded size), and each is gone ``ttl_s`` after it was stored. 0 entries: nothing
    is stored (every ``store: true`` is reported as not stored)."""

    max_entries: Annotated[int, Meta(ge=0)] = 10_000
    max_bytes: Annotated[int, Meta(ge=0)] = 256 << 20
    ttl_s: Annotated[float, Meta(gt=0.0)] = 3600.0


class ApiSpec(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """The deployment's API policy; published by GET /v1/capabilities.

    strict: every ignored or clamped field is a 400 naming it. max_tokens_policy: what a
    prompt + max_tokens beyond the context gets (reject: 400 with the accounting; clamp:
    cut to what fits and reported as a clamp). chat_template: a server-wide template file
    that replaces the checkpoint's. allow_request_chat_template: accept ``chat_template``
    in a request body (a template is code the server runs, so it is off by default).
    scheduling_policy (vLLM's --scheduling-policy): fcfs serves waiting requests in arrival
    order and refuses a non-zero ``priority``; priority lets clients set it (lower first,
    arrival order within one; no aging, so a steady stream of lower values starves higher
    ones: for deployments whose clients are trusted to use it)."""

    strict: bool = False
    max_tokens_policy: Literal["reject", "clamp"] = "reject"
    chat_template: str | None = None
    allow_request_chat_template: bool = False
    scheduling_policy: Literal["fcfs", "priority"] = "fcfs"
    limits: RequestLimits = msgspec.field(default_factory=RequestLimits)
    sampling_defaults: SamplingDefaults = msgspec.field(default_factory=SamplingDefaults)
    responses_store: ResponsesStoreSpec = msgspec.field(default_factory=ResponsesStoreSpec)
    # Tool calls under tool_choice auto: a parser name, "auto" (detected from the chat
    # template at launch, which writes the outcome here) or None (auto is a 400).
    tool_call_parser: str | None = None
    tool_call_parser_source: str | None = None  # flag | detected from <template> | ...
    # <think> blocks -> reasoning_content: a parser name, "auto" (detected) or None
    reasoning_parser: str | None = None
    reasoning_parser_source: str | None = None

    @property
    def priority_scheduling(self) -> bool:
        """Clients may set ``priority`` (the field table's ``only_with`` flag)."""
        return self.scheduling_policy == "priority"


class RoleCounts(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    api_frontend: Count = 1
    tokenizer_worker: Count = 1
    detokenizer: Count = 1


class Addresses(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """Address templates. ``{run_dir}`` is the launcher's private socket directory,
    ``{i}`` the instance index of a role that has several processes and ``{r}`` the
    engine replica (scheduler and gpu_worker addresses, one set per replica)."""

    scheduler_in: str = "ipc://{run_dir}/scheduler-in-{r}"
    scheduler_pub: str = "ipc://{run_dir}/scheduler-pub-{r}"
    worker_in: str = "ipc://{run_dir}/worker-in-{r}"
    worker_out: str = "ipc://{run_dir}/worker-out-{r}"
    tokenizer_in: str = "ipc://{run_dir}/tokenizer-{i}"
    detokenizer_in: str = "ipc://{run_dir}/detokenizer-{i}"
    frontend_results: str = "ipc://{run_dir}/frontend-{i}"
    # each node's launcher publishes its children's liveness here ({n}: node index)
    node_status: str = "ipc://{run_dir}/node-{n}"
    # torch.distributed rendezvous of one replica's tensor-parallel ranks: by default a
    # file store in the launcher's private run directory (every rank on one node); ranks
    # that span nodes need tcp://{host}:PORT ({host}: rank 0's node; {port}: a free port
    # one launcher picks, so one node only)
    tp_rendezvous: str = "file://{run_dir}/tp-rendezvous-{r}"
    # where a decode replica's gpu_worker rank {k} receives prompt KV from prefill
    # replicas (disaggregation only; {host}: the node of that rank)
    kv_in: str = "ipc://{run_dir}/kv-in-{r}-{k}"
    # the shared KV store's inbound (puts and lookups), and where rank {k} of replica {r}
    # receives the blocks a lookup found (kv_store only)
    kv_store: str = "ipc://{run_dir}/kv-store"
    kv_store_rank_in: str = "ipc://{run_dir}/kv-store-in-{r}-{k}"


class NodeSpec(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """One machine (or pod): the roles it runs. ``host`` is how other nodes reach it and
    what ``{host}`` means in the address templates of sockets its roles bind."""

    name: NodeName
    roles: list[RoleName]
    host: str = "127.0.0.1"
    devices: list[Annotated[int, Meta(ge=0)]] = []  # GPU ids, one per gpu_worker rank here
    # Which gpu_worker processes run here (index = replica * tensor_parallel + rank) when
    # the ranks span several nodes; None: every one (gpu_worker on this node alone).
    gpu_workers: list[Annotated[int, Meta(ge=0)]] | None = None
    # Which api_frontend processes run here when frontends run on several nodes (each
    # pool pod serving the API itself); None: every one (api_frontend on this node alone).
    api_frontends: list[Annotated[int, Meta(ge=0)]] | None = None
    http_port: Port | None = None  # this node's frontends listen here (None: http.port)
    metrics_port: Port | None = None  # the launcher serves /metrics and /health here
    status_address: str | None = None  # overrides the addresses.node_status template

    def instances(self, role: str) -> list[int] | None:
        """The instances of ``role`` this node names (None: it names none, so every one;
        only roles in ``PLACED_BY_INDEX`` may be split across nodes)."""
        key = PLACED_BY_INDEX.get(role)
        return getattr(self, key) if key is not None else None


# roles whose instances may run on several nodes, and the NodeSpec key naming them
PLACED_BY_INDEX = {"gpu_worker": "gpu_workers", "api_frontend": "api_frontends"}


class SupervisionSpec(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """What the launcher does when a child dies or a stop is asked for.

    A role in ``restart`` comes back at once after its first death in a window; each
    further restart within ``restart_window_s`` waits twice as long as the one before (1 s,
    2 s, 4 s ... up to ``restart_backoff_max_s``), and a death past ``max_restarts``
    restarts within the window stops the topology. Restarts older than the window no
    longer count, so a crash a day never adds up to the limit."""

    restart: list[RoleName] = []  # stateless roles only: tokenizer_worker, detokenizer
    max_restarts: Annotated[int, Meta(ge=0)] = 10  # per process and window, then stop
    restart_window_s: Annotated[float, Meta(gt=0)] = 600.0
    restart_backoff_max_s: Annotated[float, Meta(ge=0)] = 30.0
    teardown_delay_s: Annotated[float, Meta(ge=0, le=300)] = 0.0  # after a fatal death
    drain_timeout_s: Annotated[float, Meta(ge=0, le=3600)] = 30.0  # SIGTERM grace
    heartbeat_stale_s: Annotated[float, Meta(gt=0.2, le=60)] = 2.0
    step_stuck_s: Annotated[float, Meta(gt=0)] = 120.0  # one step in flight this long: 503


class RouterSpec(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """How frontends pick an engine replica. ``cache_aware``: a request whose prompt
    prefix (or cache_salt) was sent to a replica before goes there again, unless that
    replica's load exceeds the least loaded one's by more than ``balance_abs`` requests
    and ``balance_rel`` times; otherwise the least loaded. ``round_robin``: in turn."""

    policy: Literal["cache_aware", "round_robin"] = "cache_aware"
    balance_abs: Annotated[int, Meta(ge=0)] = 8
    balance_rel: Annotated[float, Meta(ge=1.0)] = 1.5
    prefix_chunk_chars: Annotated[int, Meta(ge=1)] = 64
    max_prefix_entries: Annotated[int, Meta(ge=1)] = 200_000


class ServedModel(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """A further model behind the same frontends (``Topology.models``), reached by the
    ``model`` a request names: its own engine replicas (schedulers and gpu_worker ranks),
    tokenizer workers and detokenizers (none needed by a pooling model). The frontends,
    the router policy, the API policy and the nodes are the topology's."""

    model: ModelSpec
    tensor_parallel: Count = 1
    replicas: Count = 1
    engine: EngineSpec = msgspec.field(default_factory=EngineSpec)
    tokenizer_workers: Count = 1
    detokenizers: Annotated[int, Meta(ge=0, le=64)] | None = None  # None: 1; pooling: 0


@dataclass(frozen=True)
class EngineGroup:
    """One served model's processes, numbered within the topology: its replicas, gpu_worker
    ranks, tokenizer workers and detokenizers are the ``first_*`` onwards of their role
    (every role's instances are numbered across models, so names and addresses stay
    unique)."""

    index: int
    model: ModelSpec
    runner: str
    tensor_parallel: int
    replicas: int
    engine: EngineSpec
    tokenizer_workers: int
    detokenizers: int
    first_replica: int
    first_worker: int
    first_tokenizer: int
    first_detokenizer: int
    # ranks of each replica where they differ (a prefill/decode split with a TP size per
    # role); empty: ``tensor_parallel`` for every replica
    replica_tp: tuple[int, ...] = ()

    def tp_of(self, replica: int) -> int:
        """gpu_worker ranks of replica ``replica`` (numbered across models)."""
        return self.replica_tp[replica - self.first_replica] if self.replica_tp \
            else self.tensor_parallel

    @property
    def workers(self) -> int:
        return sum(self.tp_of(r) for r in self.replica_ids())

    def replica_ids(self) -> list[int]:
        return list(range(self.first_replica, self.first_replica + self.replicas))

    def tokenizer_ids(self) -> list[int]:
        return list(range(self.first_tokenizer, self.first_tokenizer + self.tokenizer_workers))

    def detokenizer_ids(self) -> list[int]:
        return list(range(self.first_detokenizer, self.first_detokenizer + self.detokenizers))

    def ranks_of(self, replica: int) -> range:
        """The gpu_worker indexes of replica ``replica`` (numbered across models)."""
        first = self.first_worker + sum(self.tp_of(r) for r in range(self.first_replica,
                                                                      replica))
        return range(first, first + self.tp_of(replica))


class DisaggregationSpec(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """Prefill and decode on separate replicas. Replicas ``0..prefill_replicas-1`` prefill
    (prompt KV and the first token), the next ``decode_replicas`` decode; the prompt's KV
    blocks move worker to worker over ZeroMQ. ``transfer_timeout_s`` bounds one transfer:
    past it the decode replica recomputes the prompt itself. ``prefill_tensor_parallel``
    / ``decode_tensor_parallel``: ranks per replica of each role (None: the topology's
    ``tensor_parallel``); KV heads are re-sliced on the way when they differ."""

    prefill_replicas: Count
    decode_replicas: Count
    transfer_timeout_s: Annotated[float, Meta(gt=0.0, le=600.0)] = 10.0
    prefill_tensor_parallel: Count | None = None
    decode_tensor_parallel: Count | None = None

    @property
    def replicas(self) -> int:
        return self.prefill_replicas + self.decode_replicas

    def resolved(self, tensor_parallel: int) -> DisaggregationSpec:
        """This split with both TP sizes filled in (``tensor_parallel``: the default)."""
        return msgspec.structs.replace(
            self, prefill_tensor_parallel=self.prefill_tensor_parallel or tensor_parallel,
            decode_tensor_parallel=self.decode_tensor_parallel or tensor_parallel)

    def replica_tp(self, tensor_parallel: int) -> tuple[int, ...]:
        """Ranks of each replica, prefill ones first."""
        full = self.resolved(tensor_parallel)
        return (full.prefill_tensor_parallel,) * self.prefill_replicas + \
            (full.decode_tensor_parallel,) * self.decode_replicas


ReplicaRole = Literal["colocated", "prefill", "decode"]


class KvStoreSpec(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """A KV store shared by the replicas: full prompt blocks any replica computed, found
    by chain hash (with cache_salt, the checkpoint, dtype, layout and TP shard in the key)
    by any other. ``size_gib`` bounds its memory (LRU); with ``dir``, what memory evicts
    goes to files there, at most ``disk_size_gib`` (LRU). A replica's lookup waits at
    most ``lookup_timeout_s``; a store that is dead or slower than that means misses."""

    size_gib: Annotated[float, Meta(gt=0.0)]
    dir: str | None = None
    disk_size_gib: Annotated[float, Meta(ge=0.0)] = 16.0
    lookup_timeout_s: Annotated[float, Meta(gt=0.0, le=10.0)] = 0.5


class Topology(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """``tensor_parallel``: gpu_worker ranks per engine replica, one torch.distributed
    group (vLLM's --tensor-parallel-size). ``replicas``: engine replicas (a scheduler and
    its ranks each) behind the same frontends, tokenizer workers and detokenizers
    (--data-parallel-size), routed by ``router``. ``models``: further models served by
    the same frontends beside ``model`` (e.g. an embedding model next to a chat model),
    each with its own engines; requests are routed by their ``model`` field."""

    model: ModelSpec
    tensor_parallel: Count = 1
    replicas: Count = 1
    router: RouterSpec = msgspec.field(default_factory=RouterSpec)
    roles: RoleCounts = msgspec.field(default_factory=RoleCounts)
    engine: EngineSpec = msgspec.field(default_factory=EngineSpec)
    http: HttpSpec = msgspec.field(default_factory=HttpSpec)
    addresses: Addresses = msgspec.field(default_factory=Addresses)
    nodes: list[NodeSpec] = []  # empty: one node "local" on 127.0.0.1 running every role
    supervision: SupervisionSpec = msgspec.field(default_factory=SupervisionSpec)
    security: SecuritySpec = msgspec.field(default_factory=SecuritySpec)
    models: list[ServedModel] = []

    def groups(self) -> list[EngineGroup]:
        """Every served model's engines: ``model`` (with the top-level engine fields)
        first, then ``models``."""
        specs = [ServedModel(model=self.model, tensor_parallel=self.tensor_parallel,
                             replicas=self.replicas, engine=self.engine,
                             tokenizer_workers=self.roles.tokenizer_worker,
                             detokenizers=self.roles.detokenizer), *self.models]
        out, replica, worker, tok, detok = [], 0, 0, 0, 0
        for i, spec in enumerate(specs):
            runner = spec.model.runner_kind()
            detoks = spec.detokenizers if spec.detokenizers is not None else (
                0 if runner == "pooling" else 1)
            split = self.disaggregation if i == 0 else None  # (one model: topology_check)
            out.append(EngineGroup(i, spec.model, runner, spec.tensor_parallel, spec.replicas,
                                   spec.engine, spec.tokenizer_workers, detoks, replica,
                                   worker, tok, detok,
                                   split.replica_tp(spec.tensor_parallel) if split else ()))
            replica += spec.replicas
            worker += out[-1].workers
            tok += spec.tokenizer_workers
            detok += detoks
        return out

    def group_of_replica(self, replica: int) -> EngineGroup:
        return next(g for g in self.groups() if replica in g.replica_ids())

    @property
    def total_replicas(self) -> int:
        return self.replicas + sum(m.replicas for m in self.models)

    @property
    def total_gpu_workers(self) -> int:
        return sum(g.workers for g in self.groups())

    def effective_nodes(self) -> list[NodeSpec]:
        if self.nodes:
            return self.nodes
        return [NodeSpec(name=LOCAL_NODE, roles=[*ROLES, *OPTIONAL_ROLES])]

    def node_of(self, role: str, index: int | None = None) -> NodeSpec:
        """The node running ``role`` (instance ``index`` when its instances span nodes:
        gpu_worker ranks, api_frontends)."""
        for node in self.effective_nodes():
            named = node.instances(role)
            if role in node.roles and (index is None or named is None or index in named):
                return node
        if role in OPTIONAL_ROLES:  # not named by the nodes: it runs beside the scheduler
            return self.node_of("scheduler")
        raise ValueError(f"role {role} is not placed on any node")

    def nodes_of(self, role: str) -> list[NodeSpec]:
        return [n for n in self.effective_nodes() if role in n.roles]

    def http_of(self, node: NodeSpec) -> HttpSpec:
        """The HTTP listener of ``node``'s frontends (its own port when it names one)."""
        if node.http_port is None:
            return self.http
        return msgspec.structs.replace(self.http, port=node.http_port)

    def rank_nodes(self, replica: int) -> list[NodeSpec]:
        """The nodes running replica ``replica``'s gpu_worker ranks (one, unless its
        tensor-parallel group spans machines)."""
        out: list[NodeSpec] = []
        for index in self.group_of_replica(replica).ranks_of(replica):
            node = self.node_of("gpu_worker", index)
            if node not in out:
                out.append(node)
        return out

    def tp_interface(self, replica: int) -> str | None:
        """The network interface replica ``replica``'s collectives bind to: loopback when
        its ranks share a node (nothing of theirs listens beyond the host), else
        ``security.tensor_parallel.interface`` (None: torch's own choice)."""
        if self.group_of_replica(replica).tp_of(replica) == 1:
            return None
        if len(self.rank_nodes(replica)) == 1:
            return "lo"
        traffic = self.security.tensor_parallel
        return traffic.interface if traffic is not None else None
    api: ApiSpec = msgspec.field(default_factory=ApiSpec)
    # prefill/decode split of ``replicas`` (None: every replica does both)
    disaggregation: DisaggregationSpec | None = None
    kv_store: KvStoreSpec | None = None  # a KV store shared by the replicas (None: none)

    def replica_role(self, replica: int) -> ReplicaRole:
        """Prefill replicas are numbered first, then decode ones."""
        d = self.disaggregation
        if d is None:
            return "colocated"
        return "prefill" if replica < d.prefill_replicas else "decode"


class ResolvedAddresses(msgspec.Struct, kw_only=True):
    scheduler_in: str
    scheduler_pub: str
    worker_in: str
    worker_out: str
    tokenizer_in: list[str]
    detokenizer_in: list[str]
    frontend_results: list[str]
    node_status: list[str] = []  # one per node, in topology order
    tp_rendezvous: str = ""
    # every replica's scheduler inbound / stats addresses (the fields above: this
    # process's replica); roles shared by the replicas route over these
    replica_scheduler_in: list[str] = []
    replica_scheduler_pub: list[str] = []
    # a scheduler's own model's detokenizers, where the topology serves several models
    # (None: all of detokenizer_in; a pooling model has none)
    group_detokenizer_in: list[str] | None = None

    def detokenizers(self) -> list[str]:
        """The detokenizers this replica's requests are decoded by."""
        return self.detokenizer_in if self.group_detokenizer_in is None \
            else self.group_detokenizer_in
    # disaggregation: [replica][tp rank] -> that decode rank's KV inbound ([] elsewhere)
    replica_kv_in: list[list[str]] = []
    # the shared KV store ("" without one) and where this replica's ranks take its blocks
    kv_store: str = ""
    kv_store_rank_in: list[str] = []

    def schedulers_in(self) -> list[str]:
        """Every replica's scheduler inbound address, in replica order."""
        return self.replica_scheduler_in or [self.scheduler_in]

    def schedulers_pub(self) -> list[str]:
        return self.replica_scheduler_pub or [self.scheduler_pub]


def _free_port() -> int:
    """A port free on this machine (the launcher of the node running the ranks)."""
    import socket
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def load_topology(path: str) -> Topology:
    with open(path, "rb") as fh:
        return msgspec.yaml.decode(fh.read(), type=Topology)


# Which role binds each address (``{host}`` in its template is that role's node).
BINDERS = {"scheduler_in": "scheduler", "scheduler_pub": "scheduler",
           "worker_in": "scheduler", "worker_out": "scheduler",
           "tokenizer_in": "tokenizer_worker", "detokenizer_in": "detokenizer",
           "frontend_results": "api_frontend"}
# ... and which roles connect to it (an ipc:// address must not cross nodes).
# (a prefill replica's scheduler hands requests to decode replicas' schedulers)
# (the kv_store answers lookups on scheduler_in)
CONNECTORS = {"scheduler_in": ("tokenizer_worker", "detokenizer", "api_frontend",
                               "scheduler", "kv_store"),
              "scheduler_pub": ("api_frontend",), "worker_in": ("gpu_worker",),
              "worker_out": ("gpu_worker",), "tokenizer_in": ("api_frontend",),
              "detokenizer_in": ("scheduler",),
              # frontends ask each other for stored /v1/responses (api_frontend/endpoints/responses)
              "frontend_results": ("scheduler", "tokenizer_worker", "detokenizer",
                                   "api_frontend"),
              "node_status": ("api_frontend", "detokenizer")}


def _store_addresses(topology: Topology, group: EngineGroup, r: int, run_dir: str) -> dict:
    """The KV store's address and replica ``r``'s rank inbounds for it (none without one)."""
    if topology.kv_store is None:
        return {}
    a = topology.addresses
    store_host = topology.node_of("kv_store").host
    return {"kv_store": a.kv_store.format(run_dir=run_dir, i=0, r=0, host=store_host),
            "kv_store_rank_in": [a.kv_store_rank_in.format(
                run_dir=run_dir, r=r, k=k, i=0, host=topology.node_of("gpu_worker", w).host)
                for k, w in enumerate(group.ranks_of(r))]}


def resolve(topology: Topology, run_dir: str) -> list[ResolvedAddresses]:
    """One address set per engine replica, numbered across served models (they differ in
    the scheduler and worker addresses, the TP rendezvous and, with several models, the
    detokenizers; the shared roles use replica 0's)."""
    a = topology.addresses
    groups = topology.groups()

    def host(key: str, i: int | None = None) -> str:
        return topology.node_of(BINDERS[key], i).host

    def one(key: str, r: int) -> str:
        return getattr(a, key).format(run_dir=run_dir, i=0, r=r, host=host(key))

    def many(key: str, n: int) -> list[str]:  # instance i binds on its own node
        return [getattr(a, key).format(run_dir=run_dir, i=i, r=0, host=host(key, i))
                for i in range(n)]

    def rendezvous(group: EngineGroup, r: int) -> str:
        if group.tp_of(r) == 1:
            return ""
        port = _free_port() if "{port}" in a.tp_rendezvous else 0
        rank0 = topology.node_of("gpu_worker", group.ranks_of(r)[0])
        return a.tp_rendezvous.format(run_dir=run_dir, r=r, host=rank0.host, port=port)

    replicas = range(topology.total_replicas)
    detokenizers = many("detokenizer_in", sum(g.detokenizers for g in groups))
    shared = dict(
        tokenizer_in=many("tokenizer_in", sum(g.tokenizer_workers for g in groups)),
        detokenizer_in=detokenizers,
        frontend_results=many("frontend_results", topology.roles.api_frontend),
        node_status=[(node.status_address or a.node_status).format(
                         run_dir=run_dir, n=n, i=n, r=0, node=node.name, host=node.host)
                     for n, node in enumerate(topology.effective_nodes())],
        replica_scheduler_in=[one("scheduler_in", r) for r in replicas],
        replica_scheduler_pub=[one("scheduler_pub", r) for r in replicas],
        # disaggregation serves one model (topology_check): its replicas are the first
        replica_kv_in=[[a.kv_in.format(run_dir=run_dir, r=r, k=k, i=0,
                                       host=topology.node_of("gpu_worker", index).host)
                        for k, index in enumerate(groups[0].ranks_of(r))]
            if topology.replica_role(r) == "decode" else [] for r in replicas]
        if topology.disaggregation is not None else [])
    resolved = []
    for group in groups:
        own = [detokenizers[i] for i in group.detokenizer_ids()] if len(groups) > 1 else None
        resolved += [ResolvedAddresses(
            scheduler_in=one("scheduler_in", r), scheduler_pub=one("scheduler_pub", r),
            worker_in=one("worker_in", r), worker_out=one("worker_out", r),
            tp_rendezvous=rendezvous(group, r), group_detokenizer_in=own,
            **_store_addresses(topology, group, r, run_dir), **shared)
            for r in group.replica_ids()]
    every = [x for ra in resolved for x in (ra.scheduler_in, ra.scheduler_pub, ra.worker_in,
                                            ra.worker_out)]
    every += [x for ranks in shared["replica_kv_in"] for x in ranks]
    every += [x for ra in resolved for x in ra.kv_store_rank_in]
    every += [*shared["tokenizer_in"], *shared["detokenizer_in"],
              *shared["frontend_results"], *shared["node_status"]]
    duplicates = sorted({x for x in every if every.count(x) > 1})
    if duplicates:
        raise ValueError(f"topology addresses collide: {duplicates} (a role with count > 1 "
                         "needs '{i}' in its address template, node_status needs '{n}', "
                         "scheduler and worker addresses need '{r}' with several replicas "
                         "or models)")
    return resolved
