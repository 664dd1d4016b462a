"""Messages that cross process boundaries.

Each receiving socket decodes one tagged union (see the ``*_MESSAGES`` aliases at the
bottom), so a socket never needs to guess what arrived. Everything is msgpack via
msgspec; token ids travel as plain int lists.
"""

from __future__ import annotations

from typing import Any, ClassVar, Literal, Union

import msgspec

from protocol.kv_store import StoreHeld


class _Message(msgspec.Struct, tag_field="msg"):
    """Base of every tagged IPC message; the tag lives in the ``msg`` key."""


class SamplingParams(msgspec.Struct, frozen=True, omit_defaults=True):
    """What the gpu_worker's sampler needs for one sequence.

    temperature == 0 means greedy argmax with no RNG at all.
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1: off
    seed: int | None = None
    # Penalties (vLLM/HF semantics): presence/frequency over generated tokens,
    # repetition over prompt + generated. Neutral values cost nothing in the worker.
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_p: float = 0.0
    # Sparse (token_id, bias) pairs; the worker adds them with index_put, cost ~ entries.
    logit_bias: list[tuple[int, float]] = []
    # Top-k logprobs to return for each sampled token (-1: none; 0: only the sampled one)
    # and for each prompt token (completions echo); from the raw logits, before filters.
    logprobs: int = -1
    prompt_logprobs: int = -1
    # Set by the tokenizer worker: where the prompt ends (penalties split on it), and the
    # ids to suppress until ``min_tokens`` tokens were generated (eos + stop_token_ids).
    num_prompt_tokens: int = 0
    min_tokens: int = 0
    min_tokens_stop_ids: list[int] = []
    # Constrained decoding: an llguidance grammar, compiled and checked by the tokenizer
    # worker; the gpu_worker masks every sampled token with it.
    grammar: str | None = None

    def has_penalties(self) -> bool:
        return (self.presence_penalty != 0.0 or self.frequency_penalty != 0.0
                or self.repetition_penalty != 1.0)

    def needs_history(self) -> bool:
        """Whether sampling reads the request's token history (prompt + generated): the
        worker keeps it only for such requests, and the scheduler sends them the prompt
        ids a prefix-cache hit skips (``SeqChunk.context``)."""
        return self.has_penalties() or self.min_tokens > 0


class GuidedSpec(msgspec.Struct, frozen=True):
    """A constraint on the output, as the client asked for it. ``kind``: json_schema |
    json_object | regex | choice | grammar; ``spec`` is its text (a schema as JSON, a
    regex, a JSON list of choices, a Lark/GBNF grammar); ``field`` names the request field
    it came from, so a 400 about it names that field."""

    kind: Literal["json_schema", "json_object", "regex", "choice", "grammar"]
    spec: str
    field: str
    # the reasoning parser whose <think> block comes first, unconstrained; the
    # constraint applies to the answer after it (None: to the whole reply)
    reasoning: str | None = None


class PoolingParams(msgspec.Struct, frozen=True, omit_defaults=True):
    """What the gpu_worker needs to pool one sequence of a pooling deployment (the
    method and normalisation are the checkpoint's, fixed at start): ``dimensions`` keeps
    the first n values (Matryoshka) before the vector is normalised.
    ``second_segment``: where a text pair's second text starts (a cross-encoder's
    query + document): its tokens take token type 1 (None: one text, all type 0)."""

    dimensions: int | None = None
    second_segment: int | None = None


class DetokParams(msgspec.Struct, frozen=True, omit_defaults=True):
    """How the detokenizer turns ids into text for one request."""

    stop: list[str] = []
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    return_token_ids: bool = False
    # stop strings count only where they end after the first ``min_tokens`` tokens' text
    # (vLLM's rule: min_tokens holds back every stop condition)
    min_tokens: int = 0


# ---------------------------------------------------------------- frontend -> tokenizer


class GenerateReq(_Message, tag="generate", omit_defaults=True):
    """A validated generation request, before templating and tokenization.

    Exactly one of ``prompt`` (completions) or ``messages`` (chat) is set.
    ``max_tokens_field`` is the name the client used ("max_tokens" or
    "max_completion_tokens"), so budget errors can name it; ``max_tokens`` None means
    "the rest of the context".
    """

    rid: str
    reply_to: str
    sampling: SamplingParams
    detok: DetokParams
    prompt: str | list[int] | None = None
    messages: list[dict[str, Any]] | None = None
    tools: list[dict[str, Any]] | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] = {}
    max_tokens: int | None = None
    max_tokens_field: str = "max_tokens"
    stop_token_ids: list[int] = []
    ignore_eos: bool = False
    min_tokens: int = 0
    arrival_time: float = 0.0
    priority: int = 0  # extension: lower runs first; FCFS within a priority
    cache_salt: str | None = None  # extension: prefix-cache blocks are shared only within a salt
    probe: bool = False  # /health/generate: served ahead of queued traffic
    # per-request policy, template, echo, constraints and routing (defaults: plain serving)
    strict: bool = False             # every ignored/clamped field becomes a 400
    chat_template: str | None = None  # request-supplied template (frontend checked the flag)
    echo_prompt: bool = False        # return the prompt text in RequestInfo (completions echo)
    guided: GuidedSpec | None = None  # constrained decoding, compiled by the tokenizer worker
    replica: int = 0  # the engine replica the frontend's router chose
    lora: str | None = None  # the LoRA adapter the client named in `model` (None: the base)
    # disaggregation: the decode replica the prefill replica hands it to (-1: none)
    decode_replica: int = -1


class PoolReq(_Message, tag="pool", omit_defaults=True):
    """One input of an /v1/embeddings request: tokenize it, check it fits the context,
    schedule it as a prefill whose result is the pooled hidden state. The tokenizer
    worker answers with a RequestInfo (its token count) or a RequestError."""

    rid: str
    reply_to: str
    input: str | list[int]
    pooling: PoolingParams = PoolingParams()
    add_special_tokens: bool = True
    arrival_time: float = 0.0
    priority: int = 0
    replica: int = 0  # the engine replica the frontend's router chose
    probe: bool = False  # /health/generate on an embedding model: ahead of queued traffic
    # a text pair (a cross-encoder's query + document): tokenized together as the
    # tokenizer pairs them; its second text's tokens take token type 1
    pair: str | None = None


class TemplateInfo(msgspec.Struct, frozen=True):
    """Which chat template rendered a prompt: ``source`` is request | server-flag |
    checkpoint, ``origin`` the exact file or flag, and the template's sha256."""

    source: str
    origin: str
    sha256: str


class Adjustment(msgspec.Struct, omit_defaults=True):
    """One thing done to a request that the client did not literally ask for.

    ``tier`` is clamped | ignored; clamps carry ``from``/``to`` values."""

    field: str
    tier: str
    reason: str = ""
    from_: Any = msgspec.field(default=None, name="from")
    to: Any = None


class RequestInfo(_Message, tag="request_info", omit_defaults=True):
    """Tokenizer worker -> frontend, before any token: what preparing the request did.
    Sent for every request that is scheduled (an error is sent instead otherwise)."""

    rid: str
    prompt_tokens: int
    template: TemplateInfo | None = None
    adjustments: list[Adjustment] = []
    prompt_text: str | None = None
    # echo with prompt logprobs: where each prompt token starts in prompt_text
    prompt_offsets: list[int] | None = None


class EngineHas(_Message, tag="engine_has"):
    """Scheduler -> frontend: the engine took ``rid`` from its tokenizer worker. Until
    then the request depends on that worker: one killed after its ``RequestInfo`` went
    out but before the ``TokenizedReq`` did (or while that sat unsent in its socket) loses
    the request, so the frontend fails it when the worker dies instead of waiting for a
    token that never comes."""

    rid: str


class RenderReq(_Message, tag="render", omit_defaults=True):
    """Frontend -> tokenizer worker: template and tokenize ``gen`` (or decode
    ``token_ids``) and reply with a RenderResult; nothing is scheduled."""

    rid: str
    reply_to: str
    gen: GenerateReq | None = None
    token_ids: list[int] | None = None  # detokenize
    with_token_strs: bool = False
    # /tokenize: counts texts past the context (up to a bound), and may override whether
    # the tokenizer's special tokens are added (None: the endpoint's default)
    tokenize_only: bool = False
    add_special_tokens: bool | None = None
    tokenizer_info: bool = False  # reply with the tokenizer's description instead


class TokenizerInfo(msgspec.Struct, omit_defaults=True):
    """What a client-side tokenizer needs to mirror the server's (GET /tokenizer_info).
    ``chat_template`` is the one the server applies (flag over checkpoint)."""

    tokenizer_class: str
    model_max_length: int
    vocab_size: int
    special_tokens: dict[str, str] = {}
    eos_token_ids: list[int] = []
    chat_template: str | None = None
    config: dict[str, Any] = {}  # tokenizer_config.json's plain settings (flags, names)


class RenderResult(_Message, tag="render_result", omit_defaults=True):
    rid: str
    prompt_text: str
    token_ids: list[int]
    token_strs: list[str] | None = None
    template: TemplateInfo | None = None
    adjustments: list[Adjustment] = []
    tokenizer_info: TokenizerInfo | None = None


# ---------------------------------------------------------------- tokenizer -> scheduler


class ImageInput(msgspec.Struct, array_like=True, frozen=True):
    """One image of a prompt, preprocessed by the model's HF image processor in the
    tokenizer worker: its pixel values as raw bytes (C order, ``dtype`` as numpy names it,
    ``shape`` e.g. [3, 336, 336]) and where its placeholder tokens sit in the prompt
    (``offset``, ``length``: the span the vision tower's embeddings replace).
    ``content_hash`` (sha256 of the pixel values, and of the grid where there is one)
    keys the prefix cache: two different images behind the same placeholder ids must
    never share KV. ``whole``: the span's
    tokens attend each other both ways (Gemma 3), so the scheduler feeds it in one chunk
    and never starts a request (a prefix-cache hit) inside it. ``grid``: the span's tokens
    as a [temporal, rows, columns] grid (Qwen2-VL: images of any size, and M-RoPE positions
    its tokens by row and column); empty: a model whose images are a flat span."""

    pixels: bytes
    shape: list[int]
    dtype: str
    offset: int
    length: int
    content_hash: bytes
    whole: bool = False
    grid: list[int] = []

    @property
    def rope_gain(self) -> int:
        """How much further the positions after the span stand under M-RoPE than its
        length would put them (HF's ``get_rope_index``: an image advances the text's
        position by max(rows, columns), not by its token count); 0 without a grid."""
        return max(self.grid[1], self.grid[2]) - self.length if self.grid else 0


class TokenizedReq(_Message, tag="tokenized", omit_defaults=True):
    """A request ready to schedule: prompt ids and an exact token budget."""

    rid: str
    reply_to: str
    prompt_token_ids: list[int]
    max_tokens: int
    sampling: SamplingParams
    detok: DetokParams
    eos_token_ids: list[int] = []
    stop_token_ids: list[int] = []
    ignore_eos: bool = False
    arrival_time: float = 0.0
    priority: int = 0
    cache_salt: str | None = None
    probe: bool = False  # /health/generate: joins the head of the waiting queue
    # set: a pooling request (prefill only; its one output is the pooled hidden state,
    # sent to ``reply_to`` as ``Pooled``; max_tokens is 1, that output)
    pooling: PoolingParams | None = None
    lora: str | None = None  # LoRA adapter name (the scheduler resolves it; None: the base)
    decode_replica: int = -1  # disaggregation: hand it there after its first token
    # the prompt's images (LLaVA, Gemma 3): pixels and placeholder spans, in order
    images: list[ImageInput] = []


class KvHandoff(_Message, tag="kv_handoff"):
    """Prefill scheduler -> decode scheduler: ``req`` has its prompt's KV computed (being
    sent worker to worker) and its first token sampled. The decode replica sends
    ``first_output`` (the first token, its logprobs, the prompt logprobs and the cache
    hit) to the detokenizer as soon as the handoff arrives, ahead of its own tokens: one
    sender keeps a request's tokens in order (the detokenizer's socket takes its peers'
    messages in turn, so the prefill replica sending the first token itself could land
    behind the decode replica's second). It then imports the KV or, past
    ``transfer_timeout_s``, recomputes it."""

    req: TokenizedReq
    first_output: TokenOutput  # its one token; cached_tokens: the prefill replica's hit
    prefill_replica: int = 0


class Abort(_Message, tag="abort"):
    """Stop a request and free its KV blocks. ``reason``: disconnect | stop_string | error
    | probe_timeout (the cause ``candor_aborts_total`` counts it under)."""

    rid: str
    reason: str = "disconnect"


# ---------------------------------------------------------------- scheduler <-> gpu_worker


# In a SeqChunk: "the token you sampled for this request in the previous step" (the
# scheduler plans a step before the one in flight has returned its samples).
PLACEHOLDER_TOKEN = -1


class SeqChunk(msgspec.Struct, array_like=True):
    """One sequence's work in a step: feed ``token_ids`` at positions
    ``start_pos..start_pos+len-1``. When ``sample`` is true the worker samples one token
    from the last position's logits. A last token of ``PLACEHOLDER_TOKEN`` stands for the
    token the worker sampled for ``rid`` last.

    The block table travels as a diff, so a plan's size does not grow with context: the
    worker keeps each rid's table, cuts it to its first ``kept_blocks`` ids and appends
    ``new_blocks``. ``kept_blocks`` 0 (a request's first chunk, or after preemption)
    means ``new_blocks`` is the whole table.

    ``context``: the ids at positions ``0..start_pos-1`` when the worker was never fed
    them (a prefix-cache hit), sent once, with the first chunk of a request whose sampling
    reads its token history (penalties, min_tokens); empty otherwise (one byte).

    ``draft``: speculative decoding's guesses at the tokens after ``token_ids`` (a decode
    chunk only, its last token known). The worker feeds them at the next positions and
    verifies them: it keeps the longest run equal to what it samples at each position and
    samples one token after that run (``StepResult.accepted``); the KV slots of the rest
    are rewritten later and never cached. A constrained request's drafts past the first
    its grammar refuses are dropped by the worker before the forward pass (they count as
    rejected).

    ``propose`` (speculative method draft_model): how many drafts the worker's draft model
    proposes after this chunk's sampled token (``StepResult.drafts``), for the request's
    next step; 0: none (the scheduler would not use them).

    ``images``: the prompt images whose placeholder span these positions overlap. An
    image's pixels travel once, with the first chunk that needs them since the request
    was (re)admitted; a later chunk of the span names it with empty ``pixels`` and the
    worker reads its embeddings from its encoder cache (keyed by content hash).

    ``rope_shift`` (M-RoPE, Qwen2-VL): what the prompt's images that end at or before
    ``start_pos`` add to the positions (the sum of their ``rope_gain``s, never above 0):
    a text token at index p is rotated by position p + the shift, an image's tokens by
    their grid (``images``); a decode's is every image's. Computed from the request's
    images alone, so a chunk gets the same positions however the prompt was split,
    cached or recomputed, on a prefill or a decode replica."""

    rid: str
    token_ids: list[int]
    start_pos: int
    new_blocks: list[int]
    sample: bool
    kept_blocks: int = 0
    context: list[int] = []
    draft: list[int] = []
    images: list[ImageInput] = []
    propose: int = 0
    rope_shift: int = 0


class KvExport(msgspec.Struct, array_like=True):
    """After this step: send blocks ``first_block..`` of the KV of ``rid``'s first
    ``num_tokens`` positions to decode ``replica`` (disaggregation). ``final``: the chunk
    that completes the prompt is in the step; otherwise an earlier chunk's full blocks go
    ahead while the rest of the prompt computes."""

    rid: str
    replica: int
    num_tokens: int
    first_block: int = 0
    final: bool = True


class KvImport(msgspec.Struct, array_like=True):
    """Before this step: write the KV received for ``rid`` into ``blocks``."""

    rid: str
    blocks: list[int]


class KvStorePut(msgspec.Struct, array_like=True):
    """After this step: copy ``blocks`` (full, written by this step for ``rid``) to the
    shared KV store under ``hashes`` (``protocol.kv_store``), off the step's path."""

    rid: str
    blocks: list[int]
    hashes: list[bytes]


class PdTransferPlan(msgspec.Struct, tag_field="connector", tag="pd_transfer",
                     omit_defaults=True):
    """The prefill/decode transfer's work in a step: a prefill rank's ``exports`` after it,
    a decode rank's ``imports`` before its forward."""

    exports: list[KvExport] = []
    imports: list[KvImport] = []


class KvStorePlan(msgspec.Struct, tag_field="connector", tag="kv_store", omit_defaults=True):
    """The shared KV store's work in a step: blocks it found written in before the forward
    (``imports``), full blocks copied out to it after the step (``puts``)."""

    imports: list[KvImport] = []
    puts: list[KvStorePut] = []


# What a step asks of one KV connector (gpu_worker/kv_connectors/): one struct per
# connector, tagged with its name, so a new connector adds a member here and no StepPlan
# field.
KvConnectorPlan = Union[PdTransferPlan, KvStorePlan]


class StepPlan(_Message, tag="step", omit_defaults=True):
    """One forward pass over a batch. ``step_id`` numbers the plans from 1 without gaps
    (every rank checks it: gpu_worker/plan_order.py; the adapter messages below take
    their numbers from the same sequence). ``new_sampling`` carries params for sequences
    the worker has not seen (or sees again after preemption); ``released`` lists rids
    whose worker-side state (block table, seeded generators) can be dropped.
    ``new_adapters``: the LoRA adapter id of each such sequence that uses one (see
    ``LoadAdapter``)."""

    step_id: int
    seqs: list[SeqChunk]
    new_sampling: dict[str, SamplingParams] = {}
    released: list[str] = []
    # the KV connectors' work around this step, one entry per connector that has some
    # (none configured, or nothing to move: empty, and not on the wire)
    kv: list[KvConnectorPlan] = []
    new_pooling: dict[str, PoolingParams] = {}  # pooling rids among new_sampling's
    new_adapters: dict[str, int] = {}


class LoadAdapter(_Message, tag="load_adapter"):
    """Scheduler -> every rank: register a LoRA adapter under ``adapter_id`` (the
    scheduler's number, never reused), read from ``path`` (which must lie in the
    deployment's allowed directories). Rank 0 answers ``AdapterLoaded``; the ranks agree
    first, so either all hold it or none. ``step_id``: its place in the plans' sequence
    (``StepPlan.step_id``)."""

    step_id: int
    adapter_id: int
    name: str
    path: str


class DropAdapter(_Message, tag="drop_adapter"):
    """Scheduler -> every rank: an adapter no request uses any more is gone (``step_id``
    as ``LoadAdapter``'s)."""

    step_id: int
    adapter_id: int


class AdapterLoaded(_Message, tag="adapter_loaded"):
    """Rank 0 -> scheduler: the outcome of a ``LoadAdapter`` (``error`` empty: every rank
    holds it)."""

    adapter_id: int
    error: str = ""


class PlanMark(_Message, tag="plan_mark"):
    """The newest ``StepPlan.step_id`` the scheduler has published, re-sent with its
    heartbeat while steps are in flight: a rank that has not seen that plan lost it."""

    step_id: int


class Shutdown(_Message, tag="shutdown"):
    pass


class WorkerReady(_Message, tag="ready"):
    """Sent once after the model is loaded and the KV cache allocated."""

    num_blocks: int
    block_size: int
    max_model_len: int
    device: str = ""  # what --device / --dtype auto resolved to, for /version
    dtype: str = ""
    deterministic: bool = False  # batch-invariant kernels in use (see gpu_worker.batch_invariant)
    deterministic_note: str = ""  # what was decided and why
    kv_namespace: bytes = b""  # the shared KV store's key prefix of this replica's KV
    bidirectional: bool = False  # an encoder: prompts are never split across steps


class TokenLogprob(msgspec.Struct, array_like=True):
    """One position's logprob (raw log-softmax) and its top alternatives. ``logprob`` is
    None only for the first prompt token, which nothing predicts."""

    token_id: int
    logprob: float | None
    top_ids: list[int] = []
    top_logprobs: list[float] = []
    rank: int | None = None  # 1 + ids at least as likely; prompt logprobs only (vLLM's rank)


class SampleLogprobs(msgspec.Struct, array_like=True):
    """Logprobs of one sampled token; ``prompt`` rides along on a request's first sample
    when prompt logprobs were asked for (all prompt positions, in order). ``accepted``:
    those of the drafts kept before it (speculative decoding), in order."""

    token: TokenLogprob
    prompt: list[TokenLogprob] | None = None
    accepted: list[TokenLogprob] = []


class RequestFailure(msgspec.Struct, array_like=True, frozen=True):
    """Why one request ended with an error of its own (a token its grammar rejects, no
    token left to sample, non-finite logits) while its step went on for the others; it
    becomes that request's ``RequestError``. ``recompute``: the prompt KV imported for it
    could not be written (``KvImport``), so the scheduler computes its prompt instead and
    the client never sees this failure."""

    code: str
    message: str
    status: int = 500
    param: str | None = None
    recompute: bool = False

    def error(self, rid: str) -> RequestError:
        """What the client that sent ``rid`` is told."""
        kind = "invalid_request_error" if 400 <= self.status < 500 else "internal_error"
        return RequestError(rid, self.status, self.message, type=kind, param=self.param,
                            code=self.code)


class WorkerTimings(msgspec.Struct, array_like=True):
    """Cumulative seconds rank 0 spent in each part of its steps since it started
    (perf_counter deltas, a handful per step). On CUDA the forward is asynchronous: its
    time lands where the step first waits on a result, the sampler."""

    prepare: float = 0.0  # request state, block tables, checks, building the batch
    forward: float = 0.0  # the model's forward pass, attention metadata included
    sample: float = 0.0  # logits, sampler, token and prompt logprobs
    grammar: float = 0.0  # matcher/mask work the step waited for
    send: float = 0.0  # encoding and sending results (up to the previous step)


class StepResult(_Message, tag="result"):
    """Sampled token ids, one per ``SeqChunk`` with ``sample=True``, in plan order.
    ``logprobs`` is empty unless some row asked for them; else aligned with ``sampled``.
    ``failed``: requests of the plan that failed on their own (by rid; their ``sampled``
    entry, if any, is -1): they end with that error, everyone else goes on."""

    step_id: int
    sampled: list[int]
    forward_s: float
    idle_s: float = 0.0  # worker idle between sending the previous result and this plan
    logprobs: list[SampleLogprobs | None] = []
    timings: WorkerTimings | None = None
    failed: dict[str, RequestFailure] = {}
    # a pooling deployment: each sampling row's pooled vector (little-endian float32
    # bytes, OpenAI's base64 layout), aligned with ``sampled`` (whose ids are then 0)
    pooled: list[bytes] = []
    # speculative decoding: how many of each sampling chunk's ``draft`` were kept before
    # its ``sampled`` token, aligned with ``sampled`` (empty: no chunk had drafts)
    accepted: list[int] = []
    # speculative decoding: the tokens a constrained request's grammar forces after its
    # ``sampled`` token (its next step's free drafts), aligned with ``sampled`` (empty:
    # no constrained request sampled, or speculation is off)
    forced: list[list[int]] = []
    # speculative method draft_model: the draft model's greedy guesses at the tokens after
    # each sampling chunk's ``sampled`` token (up to its ``propose``; its next step's
    # drafts), aligned with ``sampled`` (empty: no chunk asked for any)
    drafts: list[list[int]] = []


class KvReceived(_Message, tag="kv_received"):
    """A decode rank received (``ok``) or refused a request's prompt KV; ``reason`` says
    why it refused (checksum, frames, layout, ...). Every rank reports its own shard."""

    rid: str
    rank: int
    ok: bool
    reason: str = ""
    nbytes: int = 0


class WorkerError(_Message, tag="worker_error"):
    """A step failed; the scheduler fails the step's requests instead of hanging."""

    step_id: int
    message: str


# ---------------------------------------------------------------- scheduler -> detokenizer


class DetokStart(_Message, tag="detok_start"):
    """Announces a request before its first token, on the same ordered socket."""

    rid: str
    reply_to: str
    prompt_tokens: int
    detok: DetokParams
    prompt_tail: list[int] = []  # last prompt ids, so the first token decodes in context
    prompt_token_ids: list[int] | None = None  # all of them, only if return_token_ids
    replica: int = 0  # the replica serving it (stop-string aborts go back there)
    decode_replica: int = -1  # disaggregation: the replica it is handed to (aborts too)


class TokenOutput(msgspec.Struct, array_like=True):
    rid: str
    token_ids: list[int]
    finish_reason: str | None  # None while running; "stop" | "length" | "abort" | "error"
    cached_tokens: int | None = None  # prompt tokens served by the prefix cache (first output)
    logprobs: list[TokenLogprob] | None = None  # aligned with token_ids, when asked for
    prompt_logprobs: list[TokenLogprob] | None = None
    # why, when finish_reason is "error" (None: a step it was in failed)
    failure: RequestFailure | None = None
    # speculative decoding, so far (cumulative, on every output once the request has
    # drafted: a stop string the detokenizer finds may end it at any output): draft
    # tokens verified, and those kept
    spec_drafted: int = 0
    spec_accepted: int = 0


class TokenBatch(_Message, tag="tokens"):
    outputs: list[TokenOutput]


# ---------------------------------------------------------------- -> frontend


class TextDelta(msgspec.Struct, array_like=True):
    """New text for one request. ``finish_reason`` set means this is its last delta;
    the token counts are cumulative for usage accounting. ``token_ids`` are the ids
    consumed since the previous delta (their text may still be held back)."""

    rid: str
    text: str
    finish_reason: str | None
    prompt_tokens: int
    completion_tokens: int
    token_ids: list[int] = []
    prompt_token_ids: list[int] | None = None  # on the first delta, if return_token_ids
    cached_tokens: int = 0  # prompt tokens served by the prefix cache
    logprobs: list[DecodedLogprob] | None = None  # aligned with token_ids
    prompt_logprobs: list[DecodedLogprob] | None = None  # once, with the first delta
    # with logprobs: where each of ``logprobs``' tokens starts in the generated text (the
    # characters decoded before it), whatever the grouping of tokens into deltas
    text_offsets: list[int] | None = None
    spec_drafted: int = 0  # on the last delta: speculative draft tokens verified
    spec_accepted: int = 0  # and of those, the ones kept
    stop_string: str | None = None  # on the last delta: the stop string that ended it


class TopLogprob(msgspec.Struct, array_like=True):
    token_id: int
    token: str
    logprob: float
    raw: bytes | None = None  # as DecodedLogprob.raw


class DecodedLogprob(msgspec.Struct, array_like=True):
    """A TokenLogprob with the token texts filled in by the detokenizer."""

    token_id: int
    token: str
    logprob: float | None
    top: list[TopLogprob] = []
    rank: int | None = None
    # the token's own bytes where ``token`` lost some (part of a UTF-8 character decodes
    # to U+FFFD); None: they are ``token``'s UTF-8
    raw: bytes | None = None


class TextDeltas(_Message, tag="deltas"):
    items: list[TextDelta]


class RequestError(_Message, tag="request_error"):
    """A request failed before or during generation; becomes an OpenAI error body."""

    rid: str
    status: int
    message: str
    type: str = "invalid_request_error"
    param: str | None = None
    code: str | None = None


class SchedulerStats(_Message, tag="stats"):
    """Published by the scheduler every heartbeat; the frontend's /health reads it.
    ``CUMULATIVE`` fields count since the scheduler started (they never go down)."""

    CUMULATIVE: ClassVar[tuple[str, ...]] = (
        "steps", "prefix_hit_blocks", "worker_idle_s", "worker_busy_s", "preemptions",
        "aborts", "prefix_cache_queried_tokens", "prefix_cache_hit_tokens", "step_phases_s",
        "spec_drafts", "spec_draft_tokens", "spec_accepted_tokens", "spec_accepted_per_pos")

    time: float
    running: int
    waiting: int
    free_blocks: int
    total_blocks: int
    steps: int
    worker_ready: bool
    max_waiting: int = 0  # the waiting-queue bound (0: unbounded); frontends shed load past it
    cached_blocks: int = 0  # blocks findable in the prefix cache
    prefix_hit_blocks: int = 0  # cumulative blocks served from the prefix cache
    worker_idle_s: float = 0.0  # cumulative worker idle time between consecutive steps
    worker_busy_s: float = 0.0  # cumulative worker time inside steps
    worker_idle_ms_p50: float = 0.0  # median idle gap over recent busy steps (ms)
    preemptions: int = 0  # cumulative requests preempted (recompute)
    # Cumulative since start, exported as Prometheus counters by scheduler/metrics.py.
    aborts: dict[str, int] = {}  # by cause: disconnect | stop_string | error | probe_timeout
    # Prefix cache, in prompt tokens: looked up, and found cached (the planner counts both).
    prefix_cache_queried_tokens: int = 0
    prefix_cache_hit_tokens: int = 0
    step_in_flight_s: float = 0.0  # age of the step the worker is running, 0 when idle
    worker_device: str = ""  # the device and dtype the gpu_worker computes in
    worker_dtype: str = ""
    replica: int = 0  # which engine replica's scheduler this is
    deterministic: bool = False  # the worker runs batch-invariant kernels (WorkerReady's)
    deterministic_note: str = ""
    # Cumulative wall seconds of the step loop by phase: the scheduler's own (sched_*)
    # and the worker's (worker_*, from WorkerTimings); candor_step_phase_seconds.
    step_phases_s: dict[str, float] = {}
    # LoRA (max_loras 0: adapters off): the adapters this replica serves, and its
    # requests per adapter name, running and waiting (names with none left out)
    max_loras: int = 0
    lora_adapters: list[LoraAdapterInfo] = []
    lora_running: dict[str, int] = {}
    lora_waiting: dict[str, int] = {}
    # speculative decoding (cumulative, vLLM's spec_decode counters): steps' requests
    # that carried drafts, draft tokens, accepted ones, and accepted ones by position
    spec_drafts: int = 0
    spec_draft_tokens: int = 0
    spec_accepted_tokens: int = 0
    spec_accepted_per_pos: dict[str, int] = {}  # by position ("0" first), summed key by key


class LoraAdapterInfo(msgspec.Struct):
    """A LoRA adapter a replica serves: the name clients send as ``model``, its
    directory, and the base model name /v1/models shows as its ``parent``."""

    name: str
    path: str
    parent: str


class AdapterLoad(_Message, tag="adapter_load"):
    """Frontend -> every replica's scheduler: serve the adapter at ``path`` as ``name``
    (POST /v1/load_lora_adapter). ``replace``: an adapter already served under the name
    gives way once the new one is loaded (its running requests finish on it). Answered
    with an ``AdapterReply`` carrying ``rid``."""

    rid: str
    reply_to: str
    name: str
    path: str
    parent: str
    replace: bool = False


class AdapterUnload(_Message, tag="adapter_unload"):
    """Frontend -> every replica's scheduler: stop serving ``name`` (POST
    /v1/unload_lora_adapter). New requests for it are refused at once; requests already
    queued or running finish on it, then the ranks drop it."""

    rid: str
    reply_to: str
    name: str


class AdapterReply(_Message, tag="adapter_reply"):
    """Scheduler -> frontend: the outcome of an AdapterLoad / AdapterUnload on one replica
    (``status`` 200, or the HTTP status of the error ``message`` names).
    ``in_flight``: an unload's requests that still finish on the adapter."""

    rid: str
    replica: int
    status: int
    message: str = ""
    param: str | None = None  # the request field the error is about
    code: str | None = None
    in_flight: int = 0


class Pooled(_Message, tag="pooled"):
    """Scheduler -> frontend: a pooling request's result (``PoolReq``), its vector as
    little-endian float32 bytes."""

    rid: str
    data: bytes
    prompt_tokens: int


class StoreQuery(_Message, tag="store_query"):
    """One frontend asks the frontend that stored a ``/v1/responses`` result for it (or to
    delete it); the response id names that frontend. The answer goes to ``reply_to``."""

    qid: str
    reply_to: str
    response_id: str
    op: Literal["get", "delete"] = "get"


class StoreAnswer(_Message, tag="store_answer"):
    """``entry``: the encoded ``StoredResponse`` (get); ``why``: what became of a missing id."""

    qid: str
    found: bool
    entry: bytes = b""
    why: str = ""


# One tagged union per receiving socket.
TokenizerInbound = Union[GenerateReq, RenderReq, PoolReq]
SchedulerInbound = Union[TokenizedReq, Abort, KvHandoff, AdapterLoad, AdapterUnload,
                         StoreHeld]
WorkerInbound = Union[StepPlan, PlanMark, Shutdown, LoadAdapter, DropAdapter]
WorkerOutbound = Union[WorkerReady, StepResult, WorkerError, KvReceived, AdapterLoaded]
DetokenizerInbound = Union[DetokStart, TokenBatch]
FrontendInbound = Union[TextDeltas, RequestError, RequestInfo, RenderResult, StoreQuery,
                        StoreAnswer, Pooled, AdapterReply, EngineHas]
SchedulerBroadcast = SchedulerStats
