"""Executes scheduler ``StepPlan``s: one forward pass over a mixed prefill/decode batch.

The runner owns the model, the paged KV cache and per-request sampling state. It keeps
no notion of sequences beyond that: positions and block tables come from the plan, so
the scheduler alone decides what lives where in the cache.

The cache has one block more than the scheduler is told of (``scratch_block``, the last
index): padding rows of a fixed-size decode batch write there (see ``cuda_graphs``).
Decode-only steps go through ``cuda_graphs.DecodeGraphRunner`` when the attention
backend can be captured (flashinfer) and ``enforce_eager`` is off.

Under tensor parallelism every rank runs the same plan through its shard of the model
(its share of the heads, so its share of the KV cache); the block count is the smallest
any rank can hold, and rank 0's sampled ids are adopted by every rank, so the
placeholders of a run-ahead step resolve to the same token everywhere.

A request's own bad state fails that request alone: a grammar that does not compile or
rejects a token, a row with nothing left to sample (``StepResult.failed``). From then on
its chunks are not fed (a run-ahead step queued behind the failure would feed a token
nobody sampled) until the scheduler releases it. A step that raises (an engine fault)
fails every request in it the same way, and the step queued behind it runs for the rest.

Speculative decoding: a chunk's ``draft`` is fed after its last token (the chunk is then
a short prefill of 1 + k positions) and every one of those positions is sampled as a
decode row would be (``_verify_rows``): the same numerics row for row (batch-invariant
layers and attention make an M = 1 + k row equal an M = 1 decode row, bitwise), the same
processors over the history up to that position (penalties, min_tokens, logit_bias), the
same seeded noise at the same generated position (the sampler). The longest run of drafts
equal to the rows' own tokens is kept, plus the token after it; the step's result says how
many (``StepResult.accepted``). A constrained chunk's drafts are first cut where its
grammar refuses one (``GrammarStates.check_drafts``), and each verify row gets the mask of
its own position; after sampling its matcher takes the kept drafts and the token, and the
tokens the grammar then forces go back to the scheduler as the next step's drafts
(``StepResult.forced``, up to ``forced_drafts`` of them). With a draft model
(``draft_model``), after verification it is fed every live chunk's real ids and proposes
each sampling chunk's ``propose`` drafts (``StepResult.drafts``: the request's next
drafts; see draft_model.py for its cache, which mirrors this one's block ids). With an
EAGLE-3 head (``eagle3``) the model keeps its aux hidden states each forward
(``aux_layers``) and the head is fed those rows, one id behind (see eagle3.py).

Images (a LLaVA, Gemma 3, Qwen2-VL or Qwen2.5-VL checkpoint): a chunk names the images its
positions overlap (``SeqChunk.images``); ``images`` (``image_cache``) encodes each once,
keeps its embeddings until every request holding it has fed its span, and the model
splices them over the placeholder rows. A step with image rows never runs as a CUDA
graph. Gemma 3's image tokens attend each other both ways: each image's span goes to the
attention backend as a bidirectional span of its chunk (the scheduler never splits one).
Qwen2-VL's M-RoPE: each chunk's rows are positioned from its ``rope_shift`` and its
images' grids (``mrope``); a step with image rows passes [3, rows] positions, any other
step the one position per row that text and decode rows take (index + shift), so decode
steps keep their CUDA graphs.

With LoRA enabled, ``adapters`` (``lora.store``) holds the adapters and groups each
step's rows by adapter before the forward pass; a step with adapter rows runs eagerly
(no CUDA graph: the groups change from step to step).
"""

from __future__ import annotations

import concurrent.futures
import logging
import time
from dataclasses import dataclass

import torch

from cluster import checkpoint
from cluster.pooling import PoolingConfig
from cluster.topology import LoraSpec
from gpu_worker import batch_invariant, cuda_graphs
from gpu_worker.attention.base import AttentionBackend, AttentionSpec
from gpu_worker.attention.registry import select_backend
from gpu_worker.batch_invariant import Numerics
from gpu_worker.draft_model import DraftFeed, DraftModel
from gpu_worker.eagle3 import Eagle3Drafter, has_own_embeddings
from gpu_worker.grammar import GrammarStates
from gpu_worker.image_cache import ImageCache
from gpu_worker.kv_budget import KvDemand, auto_kv_bytes, resident_bytes
from gpu_worker.distributed import Ranks
from gpu_worker.lora.store import AdapterStore
from gpu_worker.model_build import build_model
from gpu_worker.mrope import positions as mrope_positions
from gpu_worker.model_config import load_config
from gpu_worker.models import fused_moe, row_ops
from gpu_worker.models.decoder import DecoderForCausalLM
from gpu_worker.models.encoder import EncoderModel
from gpu_worker.pooler import Pooler
from gpu_worker.progress import Progress
from gpu_worker.request_state import RequestTracker
from gpu_worker.tp_shard import tp_shard
from gpu_worker.sampler import NO_TOKEN, Sampler
from protocol.ipc import (PLACEHOLDER_TOKEN, PoolingParams, RequestFailure, SampleLogprobs, SamplingParams,
                          SeqChunk, StepPlan, StepResult, TokenLogprob, WorkerTimings)

log = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
# Requests of a step that raised: the scheduler fails them on the WorkerError already.
_IN_FAILED_STEP = RequestFailure("engine_error", "the engine failed a step this request was in")
# Rank 0 could not sample the row, and this rank does not know why (ranks disagree).
_NOT_SAMPLED = RequestFailure("no_token_allowed", "no token could be sampled for this request")
# (sampled ids, their logprobs, the requests that failed on their own: rid -> why)
_Sampled = tuple[list[int], list[SampleLogprobs | None], dict[str, RequestFailure]]


@dataclass
class _Batch:
    """One step's sequences in forward order (prefill chunks, then decodes by length)."""

    ordered: list[SeqChunk]
    prefills: list[SeqChunk]
    decodes: list[SeqChunk]
    ids: list[int]
    positions: list[int] | list[list[int]]  # [3][rows] where M-RoPE positions image rows
    last_row: dict[int, int]  # id(seq) -> row of its last token
    to_sample: list[SeqChunk]  # plan order


def resolve_dtype(name: str, model_path: str, device: torch.device) -> tuple[torch.dtype, str]:
    """(torch dtype, why) for ``--dtype name`` (see ``cluster.checkpoint.resolve_dtype``)."""
    canonical, why = checkpoint.resolve_dtype(name, device.type, model_path)
    return _DTYPES[canonical], why


class ModelRunner:
    """Start-up runs in named steps (``_build_model``, ``_size_kv_cache``,
    ``_allocate_kv_cache``, ``_settle_determinism`` with ``_pick_attention``,
    ``_capture_graphs``); ``execute`` runs one plan. With ``pooling`` (a pooling deployment)
    the model has no LM head and each request's output is its pooled hidden state
    (``pooler``) instead of a sampled token.

    ``deterministic``: None (the default) runs batch-invariant numerics (layers padded by
    ``batch_invariant.Numerics``, a batch-invariant attention backend) where this device
    has them on every rank, the fast ones elsewhere; True refuses to start without them;
    False runs the fast ones."""

    def __init__(
        self,
        model_path: str,
        *,
        device: str = "cpu",
        dtype: str = "float32",
        block_size: int = 16,
        num_blocks: int | None = None,
        kv_cache_memory_bytes: int | None = 512 * 2**20,
        gpu_memory_utilization: float = 0.9,
        max_model_len: int | None = None,
        load_format: str = "auto",
        seed: int = 0,
        enforce_eager: bool = False,
        max_num_seqs: int = cuda_graphs.MAX_CAPTURE_SIZE,
        ranks: Ranks | None = None,
        pooling: PoolingConfig | None = None,
        deterministic: bool | None = None,
        lora: LoraSpec | None = None,
        forced_drafts: int = 0,
        draft_model: str | None = None,
        draft_method: str = "draft_model",
    ) -> None:
        self.config = cfg = load_config(model_path)
        self.pooling = pooling
        self.ranks = ranks = ranks or Ranks()
        self.shard = tp_shard(cfg, ranks.rank, ranks.size)
        self.device = torch.device(device)
        self.dtype, self.dtype_reason = resolve_dtype(dtype, model_path, self.device)
        self.block_size = block_size
        # The context limit is settled before this process starts (cluster.checkpoint's
        # effective_max_model_len, which every role uses); windows do not shorten it.
        limit = cfg.max_position_embeddings
        self.max_model_len = min(limit, max_model_len) if max_model_len else limit

        # Batch-invariant layers unless turned off; whether the mode holds here is settled
        # once the weights are in and the attention backend is chosen (_settle_determinism).
        self.numerics = Numerics(deterministic=deterministic is not False)
        self.model = self._build_model(model_path, load_format, seed)
        log.info(self.numerics.pack(self.model.matmuls(), self.model.matmul_only()))
        self.adapters = (AdapterStore(self.model, lora, cfg, self.dtype, self.device, ranks,
                                      self.numerics)
                         if lora is not None and lora.enabled else None)
        self._log_moe_path()
        self._load_row_ops()
        if isinstance(self.model, DecoderForCausalLM):
            log.info("decoder layers: %s", self.model.flatten())
        # speculative decoding's draft_model or eagle3 head: its weights now (its cache
        # shares the budget)
        self.draft = self._draft_model(draft_model, draft_method, forced_drafts, load_format,
                                       seed, max_num_seqs)
        self.num_blocks, self.kv_reason = self._size_kv_cache(num_blocks, kv_cache_memory_bytes,
                                                              gpu_memory_utilization, max_num_seqs)
        self.scratch_block = self.num_blocks  # never in a plan: _check rejects ids >= num_blocks
        self.kv_caches = self._allocate_kv_cache()
        self.attn_spec, self.attn_backend, self.deterministic_note = self._settle_determinism(deterministic)
        if self.draft is not None:
            self.draft.allocate(self.num_blocks)
            log.info("draft model numerics: %s", self.draft.settle(self.deterministic))
            log.info("draft model %s", self.draft.describe())
        if self.adapters is not None:  # their row groups padded as the mode needs
            self.adapters.settle()

        self.grammars = GrammarStates(model_path, cfg.vocab_size, self.device)
        self.sampler = Sampler(self.device, seed, apply_masks=self.grammars.apply_masks)
        self.sampling: dict[str, SamplingParams] = {}
        self.generators: dict[str, torch.Generator] = {}
        self.last_sampled: dict[str, int] = {}  # rid -> its latest token (fills placeholders)
        self.block_tables: dict[str, list[int]] = {}  # rid -> its table, built from plan diffs
        self.failed: dict[str, RequestFailure] = {}  # rid -> why; not fed until released
        self.tracker = RequestTracker()  # token history (penalties) and prompt logprobs
        self.timings = WorkerTimings()  # cumulative, sent with every result
        self.images = self._image_cache()
        self.pooler = None if pooling is None else Pooler(
            pooling, self.model.final_norm,
            self.model.classify if pooling.task == "classify" else None)
        self.accepted: dict[int, int] = {}  # id(chunk) -> drafts kept, this step
        self.last_rows: dict[int, int] = {}  # id(chunk) -> its last row, this step (eagle3)
        # speculative decoding: a constrained request's tokens its grammar forces after
        # this step's sample, reported up to this many (0: speculation off, none)
        self.forced_drafts = forced_drafts
        self.forced: dict[int, list[int]] = {}  # id(chunk) -> them, this step
        # the KV connectors' loads into the cache, (runner, plan) -> None, run before the
        # forward of a plan with KV work (gpu_worker/kv_connectors: KvConnectors.load)
        self.load_kv = None

        self.decode_graphs = self._capture_graphs(enforce_eager, max_num_seqs)

    # ------------------------------------------------------------------ start-up steps

    def _build_model(self, model_path: str, load_format: str, seed: int) -> DecoderForCausalLM | EncoderModel:
        """This rank's shard of the model, its weights loaded (or seeded, ``dummy``)
        (``model_build``; an encoder config builds the bidirectional ``EncoderModel``)."""
        return build_model(self.config, model_path, load_format=load_format, seed=seed,
                           max_positions=self.max_model_len, device=self.device, dtype=self.dtype,
                           tp=self.ranks.tp_group(self.shard, self.numerics),
                           lm_head=self.pooling is None)

    def _draft_model(self, path: str | None, method: str, k: int, load_format: str, seed: int,
                     max_num_seqs: int) -> DraftModel | None:
        """Speculative decoding's draft model (``draft_model``) or EAGLE-3 head
        (``eagle3``: then this model keeps its aux hidden states), or None. Under tensor
        parallelism rank 0 alone holds it (whole) and proposes: drafts reach every rank
        on the next plan, and only rank 0 answers. Its cache takes part of rank 0's KV
        budget, and the block count is the smallest any rank holds, so the tables it
        mirrors fit. Not with pooling or images (the launcher refuses them first)."""
        if path is None:
            return None
        if self.pooling is not None or self.config.vision is not None:
            raise ValueError("a draft model is served with a generating text model")
        if method == "eagle3":
            return self._eagle3_head(path, k, max_num_seqs)
        if self.ranks.rank != 0:
            return None
        return DraftModel(path, k=k, vocab_size=self.config.vocab_size, device=self.device,
                          dtype=self.dtype, block_size=self.block_size,
                          max_model_len=self.max_model_len, max_num_seqs=max_num_seqs,
                          load_format=load_format, seed=seed)

    def _eagle3_head(self, path: str, k: int, max_num_seqs: int) -> Eagle3Drafter | None:
        """The EAGLE-3 head on rank 0, reading this model's aux hidden states; a head with
        no embeddings of its own embeds with this model's table (under tensor parallelism
        every rank sends its share once, now, and rank 0 keeps the whole)."""
        table = None
        if not has_own_embeddings(path):
            embed = self.model.model.embed_tokens
            if self.ranks.size == 1:
                table = embed
            elif not embed.method.dense:
                raise ValueError(f"EAGLE-3 head {path}: it has no embed_tokens, and the target's "
                                 "quantized table cannot be gathered across tensor-parallel ranks")
            else:
                whole = self.model.tp.gather_last(embed.weight.t().contiguous()).t()
                table = torch.nn.Embedding.from_pretrained(
                    whole[:self.config.vocab_size].contiguous(), freeze=True)
        if self.ranks.rank != 0:
            return None
        head = Eagle3Drafter(path, k=k, target=self.config, device=self.device, dtype=self.dtype,
                             block_size=self.block_size, max_model_len=self.max_model_len,
                             max_num_seqs=max_num_seqs)
        if table is not None:
            head.share_embeddings(table)
        self.model.aux_layers = head.aux_layers
        return head

    def _image_cache(self) -> ImageCache:
        """The encoder cache over this model's image path (none: a text model's, which
        refuses chunks with images)."""
        return ImageCache(getattr(self.model, "vision", None), self.device, self.dtype)

    def _log_moe_path(self) -> None:
        """Build the fused MoE kernel now (not on the first request) where it applies, and
        say which expert path serves."""
        if self.config.moe is None:
            return
        probe = torch.empty(0, dtype=self.dtype, device=self.device)
        if not fused_moe.applies(probe, self.config.act):
            log.info("MoE experts: per-expert matmuls (the fused kernel is for float32 SiLU "
                     "experts on CPU)")
        elif fused_moe.load() is None:
            log.info("MoE experts: per-expert matmuls (the fused kernel could not be built)")
        else:
            log.info("MoE experts: the fused CPU kernel")

    def _load_row_ops(self) -> None:
        """Build the row-wise layer kernels now (not on the first request) where they apply."""
        if self.device.type == "cpu" and self.dtype == torch.float32:
            log.info("row-wise layer ops (norms, RoPE, SiLU * up): %s", "the CPU kernels"
                     if row_ops.load() is not None else "torch's (the kernels could not be built)")

    @property
    def block_bytes(self) -> int:
        """K and V bytes of one cache block over every layer (this rank's KV heads)."""
        elem = torch.empty((), dtype=self.dtype).element_size()
        cfg = self.config
        return 2 * cfg.num_layers * self.block_size * self.shard.kv_heads * cfg.head_dim * elem

    def _size_kv_cache(self, num_blocks: int | None, memory_bytes: int | None,
                       gpu_memory_utilization: float, max_num_seqs: int) -> tuple[int, str]:
        """(blocks every rank can hold, why): an explicit count is the scheduler's; a byte
        budget covers the scratch block too; neither: what the model
        and ``max_num_seqs`` full-context sequences can use, within what the machine has
        free (``kv_budget``)."""
        per_block = self.block_bytes + (self.draft.block_bytes if self.draft is not None else 0)
        if num_blocks is not None:
            reason = f"--num-kv-blocks {num_blocks}"
        elif memory_bytes is not None:
            reason = f"{memory_bytes / 2**20:.0f} MiB asked for"
        else:
            demand = KvDemand(per_block, self.block_size, max_num_seqs,
                              self.max_model_len, resident_bytes(self.model))
            memory_bytes, reason = auto_kv_bytes(self.device, demand, gpu_memory_utilization)
        if self.draft is not None and num_blocks is None:  # the draft model's cache shares it
            memory_bytes -= self.draft.scratch_bytes
            reason += ", with the draft model's cache"
        local = num_blocks if num_blocks is not None else memory_bytes // per_block - 1
        blocks = self.ranks.min_int(local)  # every rank must hold every block
        if blocks < 1:
            raise ValueError(f"KV cache budget too small: two blocks need {2 * self.block_bytes} bytes")
        return blocks, reason

    def _allocate_kv_cache(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Every layer's K and V: [blocks + the scratch block, block_size, kv_heads, head_dim].
        Zeros, not empty: padded decode slots are masked but still multiplied, and
        uninitialised memory could hold NaN/inf. An encoder keeps no KV between steps:
        empty tensors (its blocks only bound how many tokens run at once)."""
        cfg = self.config
        if cfg.encoder is not None:
            empty = torch.empty(0, dtype=self.dtype, device=self.device)
            return [(empty, empty)] * cfg.num_layers
        shape = (self.num_blocks + 1, self.block_size, self.shard.kv_heads, cfg.head_dim)
        kv_bytes = (self.num_blocks + 1) * self.block_bytes
        progress = Progress("allocating the KV cache", kv_bytes)
        caches = []
        for _ in range(cfg.num_layers):
            caches.append((torch.zeros(shape, dtype=self.dtype, device=self.device),
                           torch.zeros(shape, dtype=self.dtype, device=self.device)))
            progress.advance(kv_bytes // cfg.num_layers)
        progress.finish()
        return caches

    def _pick_attention(self, batch_invariant: bool) -> tuple[AttentionSpec, AttentionBackend]:
        """The first attention backend that serves this rank's heads, dtype and device,
        each layer's kind (window, soft-cap) and, when asked, batch invariance; see
        ``attention.registry`` (ValueError: none does)."""
        cfg, shard = self.config, self.shard
        spec = AttentionSpec(shard.heads, shard.kv_heads, cfg.head_dim, self.block_size, self.dtype,
                             self.device, cfg.scale, tuple((layer.window, cfg.attn_softcap) for layer in cfg.layers),
                             batch_invariant=batch_invariant, causal=cfg.encoder is None,
                             image_spans=cfg.vision is not None and cfg.vision.bidirectional)
        return spec, select_backend(spec, None if spec.causal else ["bidirectional"])

    @property
    def deterministic(self) -> bool:
        return self.numerics.deterministic

    def _settle_determinism(self, asked: bool | None) -> tuple[AttentionSpec, AttentionBackend, str]:
        """(attention spec, backend, what was decided and why): batch-invariant where a
        backend serves it and the matmuls agree from a measured row count on, on this rank
        and every other one; else the fast path. ``asked`` True: off is an error."""
        if asked is False:
            self.numerics.deterministic = False
            return *self._pick_attention(False), "off (--no-deterministic)"
        try:
            spec, backend = self._pick_attention(True)
            rows, reason = batch_invariant.measure_min_rows(self.model.matmuls(), matmul=self.numerics.matmul)
        except ValueError as err:  # no backend attends batch-invariantly here
            rows, reason = None, str(err)
        if self.ranks.min_int(int(not reason)) == 0:
            reason = reason or "another tensor-parallel rank cannot run it"
        if not reason:
            self.numerics.min_rows = rows
            return spec, backend, f"on (batch-invariant kernels; matmuls padded to {rows} rows)"
        if asked:
            raise RuntimeError(f"--deterministic asked for, but: {reason}")
        self.numerics.deterministic = False
        log.warning("deterministic mode off: %s", reason)
        return *self._pick_attention(False), f"off: {reason}"

    def _capture_graphs(self, enforce_eager: bool, max_num_seqs: int) -> cuda_graphs.DecodeGraphRunner | None:
        """Decode-only steps as CUDA graphs, captured now (see ``cuda_graphs``), where the
        backend can be captured, eager mode is off and one rank serves; else None."""
        if not self.attn_backend.capturable or enforce_eager or self.pooling is not None:
            return None  # (a pooling deployment runs no decode steps)
        if self.ranks.size > 1:
            log.info("tensor parallel: decode steps run eagerly (no CUDA graphs across ranks)")
            return None
        sizes = cuda_graphs.capture_sizes(max_num_seqs)
        graphs = self.static_decode(sizes)
        started = time.perf_counter()
        try:
            with torch.inference_mode():
                n = graphs.capture()
        except Exception:  # said loudly, and decode stays correct: it just runs eagerly
            log.exception("CUDA graph capture failed; decode-only steps run eagerly")
            return None
        log.info("captured %d decode CUDA graphs (batch sizes %s) in %.1fs", n, sizes,
                 time.perf_counter() - started)
        return graphs

    def static_decode(self, sizes: list[int]) -> cuda_graphs.DecodeGraphRunner:
        """A padded static-buffer decode path at batch ``sizes`` over this runner's model,
        cache and attention backend (see ``cuda_graphs``); assign it to ``decode_graphs``."""
        pages_per_seq = -(-self.max_model_len // self.block_size)
        return cuda_graphs.DecodeGraphRunner(
            self.model, self.kv_caches, self.attn_backend.graph_attention(sizes, pages_per_seq),
            scratch_block=self.scratch_block, block_size=self.block_size,
            hidden_size=self.config.hidden_size, dtype=self.dtype, device=self.device)

    # ------------------------------------------------------------------ state

    def _update_requests(self, plan: StepPlan) -> None:
        """Drop released rids first, then register new ones (a rid may be re-added)."""
        for rid in plan.released:
            self.sampling.pop(rid, None)
            self.generators.pop(rid, None)
            self.last_sampled.pop(rid, None)
            self.block_tables.pop(rid, None)
            self.tracker.release(rid)
            self.grammars.release(rid)
            self.failed.pop(rid, None)
            self.images.release(rid)
            if self.pooler is not None:
                self.pooler.release(rid)
            if isinstance(self.draft, Eagle3Drafter):
                self.draft.release(rid)
        for rid, params in plan.new_sampling.items():
            old = self.sampling.get(rid)
            self.sampling[rid] = params
            self.failed.pop(rid, None)  # registered afresh
            try:
                self.grammars.register(rid, params)
            except (ValueError, RuntimeError) as err:  # its own grammar: it alone fails
                self.failed[rid] = RequestFailure("grammar_error", str(err))
            # Same params again (e.g. after preemption): keep the seeded stream going.
            if old != params:
                self.generators.pop(rid, None)
                if params.seed is not None:
                    self.generators[rid] = torch.Generator(device=self.device).manual_seed(params.seed)
        if self.pooler is not None:
            for rid, pooling in plan.new_pooling.items():
                self.pooler.register(rid, pooling)
        if self.adapters is not None:
            self.adapters.track(plan)

    def _fill_placeholder(self, seq: SeqChunk) -> None:
        """A step planned before the previous one returned feeds the token sampled there
        (a request that failed meanwhile is not fed at all: see ``execute``)."""
        if seq.token_ids and seq.token_ids[-1] == PLACEHOLDER_TOKEN:
            last = self.last_sampled.pop(seq.rid, None)  # used once: never a stale token
            if last is None:
                raise ValueError(f"{seq.rid}: placeholder token but nothing sampled for it yet")
            seq.token_ids[-1] = last

    def _feed_drafts(self, seq: SeqChunk) -> None:
        """A decode chunk with drafts feeds them after its token (verified in ``_sample``),
        those its grammar allows (a constrained request's)."""
        if not seq.draft:
            return
        if not seq.sample or len(seq.token_ids) != 1:
            raise ValueError(f"{seq.rid}: drafts on a chunk that is not a decode")
        self.grammars.check_drafts(seq, self.sampling.get(seq.rid))
        seq.token_ids = [*seq.token_ids, *seq.draft]

    def _apply_blocks(self, seq: SeqChunk) -> None:
        """This rid's table := its first ``kept_blocks`` ids + ``new_blocks``."""
        table = self.block_tables.setdefault(seq.rid, [])
        if len(table) < seq.kept_blocks:
            raise ValueError(f"{seq.rid}: plan keeps {seq.kept_blocks} blocks but this worker "
                             f"holds {len(table)} for it")
        del table[seq.kept_blocks:]
        table.extend(seq.new_blocks)

    def _check(self, seq: SeqChunk) -> None:
        table = self.block_tables[seq.rid]
        n = len(seq.token_ids)
        end = seq.start_pos + n
        if n == 0:
            raise ValueError(f"{seq.rid}: empty chunk")
        if seq.start_pos < 0 or end > self.max_model_len:
            raise ValueError(
                f"{seq.rid}: positions {seq.start_pos}..{end - 1} outside max_model_len {self.max_model_len}"
            )
        needed = -(-end // self.block_size)
        if len(table) < needed:
            raise ValueError(f"{seq.rid}: block_table has {len(table)} blocks, {needed} needed")
        if any(not 0 <= b < self.num_blocks for b in table[len(table) - len(seq.new_blocks):needed]):
            raise ValueError(f"{seq.rid}: block id out of range [0, {self.num_blocks})")
        if seq.sample and seq.rid not in self.sampling:
            raise ValueError(f"{seq.rid}: no SamplingParams (missing from new_sampling)")

    # ------------------------------------------------------------------ step

    def execute(self, plan: StepPlan) -> StepResult:
        t0 = time.perf_counter()
        tm = self.timings
        inner_before = tm.forward + tm.sample + tm.grammar
        try:
            self._update_requests(plan)
            if plan.kv:
                self.load_kv(self, plan)
            for seq in plan.seqs:  # tables first: a later failure leaves them consistent
                self._apply_blocks(seq)
            live = [s for s in plan.seqs if s.rid not in self.failed] if self.failed else plan.seqs
            for seq in live:
                self._fill_placeholder(seq)
                self._feed_drafts(seq)
                self._check(seq)
                self.images.admit(seq)
            self.accepted.clear()
            self.forced.clear()
            sampled: list[int] = []
            logprobs: list[SampleLogprobs | None] = []
            pooled: list[bytes] = []
            drafts: dict[int, list[int]] = {}
            if live:
                with torch.inference_mode():
                    sampled, logprobs, failures = self._forward(live)
                    self.failed.update(failures)
                    if self.draft is not None:
                        drafts = self._propose(live, sampled)
                self.images.finish(live)
                if self.pooler is not None:
                    pooled = self.pooler.take()
        except Exception:
            for s in plan.seqs:
                self.failed.setdefault(s.rid, _IN_FAILED_STEP)
            raise
        failed = {s.rid: self.failed[s.rid] for s in plan.seqs if s.rid in self.failed
                  } if self.failed else {}
        if len(live) < len(plan.seqs):  # the sampling rows of requests not fed: no token
            rows = dict(zip((id(s) for s in live if s.sample),
                            zip(sampled, logprobs or [None] * len(sampled))))
            pairs = [rows.get(id(s), (NO_TOKEN, None)) for s in plan.seqs if s.sample]
            sampled = [token for token, _ in pairs]
            logprobs = [lp for _, lp in pairs] if logprobs else []
            if pooled:
                vectors = dict(zip((id(s) for s in live if s.sample), pooled))
                pooled = [vectors.get(id(s), b"") for s in plan.seqs if s.sample]
        accepted = ([self.accepted.get(id(s), 0) for s in plan.seqs if s.sample]
                    if self.accepted else [])
        forced = ([self.forced.get(id(s), []) for s in plan.seqs if s.sample]
                  if self.forced else [])
        proposed = [drafts.get(id(s), []) for s in plan.seqs if s.sample] if drafts else []
        total = time.perf_counter() - t0
        tm.prepare += total - (tm.forward + tm.sample + tm.grammar - inner_before)
        return StepResult(step_id=plan.step_id, sampled=sampled, forward_s=total,
                          logprobs=logprobs, timings=tm, failed=failed, pooled=pooled,
                          accepted=accepted, forced=forced, drafts=proposed)

    def _propose(self, live: list[SeqChunk], sampled: list[int]) -> dict[int, list[int]]:
        """The draft model's pass after verification (``draft_model``): every live chunk's
        real ids (its tokens, the drafts kept, and the sampled token where the chunk asks
        for proposals) fed at their positions, and ``SeqChunk.propose`` drafts after each
        sampled token (id(chunk) -> them). Requests that failed are left out."""
        t0 = time.perf_counter()
        feeds: list[DraftFeed] = []
        owners: list[SeqChunk] = []
        aux = self.model.captured if isinstance(self.draft, Eagle3Drafter) else None
        tokens = iter(sampled)  # (one per sampling chunk, plan order)
        for s in live:
            token = next(tokens) if s.sample else NO_TOKEN
            if s.rid in self.failed:
                continue
            real = s.token_ids[:len(s.token_ids) - len(s.draft) + self.accepted.get(id(s), 0)]
            at = s.start_pos + len(real)  # the sampled token's position
            want = min(s.propose, self.max_model_len - at) if token != NO_TOKEN else 0
            if aux is not None:  # eagle3: the head's rows are one id behind (eagle3.py)
                row = self.last_rows[id(s)] - len(s.token_ids) + 1
                feed = self.draft.feed(s.rid, s.start_pos, real,
                                       token if token != NO_TOKEN else None,
                                       self.block_tables[s.rid], max(0, want),
                                       aux[row:row + len(real)])
                if feed is not None:
                    feeds.append(feed)
                    owners.append(s)
                continue
            feeds.append(DraftFeed(s.start_pos, [*real, token] if want > 0 else real,
                                   self.block_tables[s.rid], max(0, want)))
            owners.append(s)
        proposals = self.draft.step(feeds)
        self.model.captured = None  # (this step's aux rows: fed)
        self.timings.forward += time.perf_counter() - t0
        return {id(s): p for s, p in zip(owners, proposals) if p}

    def _forward(self, seqs: list[SeqChunk]) -> _Sampled:
        # Flattened order: prefill chunks, then decodes (attention batches those).
        prefills = [s for s in seqs if len(s.token_ids) > 1]
        # By length: decode attention runs in groups, and a group pads to its longest.
        decodes = sorted((s for s in seqs if len(s.token_ids) == 1), key=lambda s: s.start_pos)
        ordered = prefills + decodes
        ids: list[int] = []
        positions: list[int] = []
        last_row: dict[int, int] = {}  # id(seq) -> row of its last token
        mrope = bool(self.config.rope.mrope_section)
        per_chunk: list[tuple[list[int], list[list[int]] | None]] = []
        for s in ordered:
            ids.extend(s.token_ids)
            if mrope:  # (the chunk's rope_shift; its image rows by their grids)
                per_chunk.append(mrope_positions(s))
                positions.extend(per_chunk[-1][0])
            else:
                positions.extend(range(s.start_pos, s.start_pos + len(s.token_ids)))
            last_row[id(s)] = len(ids) - 1
            self.tracker.observe(s, self.sampling.get(s.rid))
        if any(axes is not None for _, axes in per_chunk):  # [3, rows]: M-RoPE's image rows
            positions = [[p for flat, axes in per_chunk for p in (axes[a] if axes else flat)]
                         for a in range(3)]
        vocab = self.config.vocab_size
        if any(not 0 <= t < vocab for t in ids):
            raise ValueError(f"token id outside vocabulary [0, {vocab})")
        to_sample = [s for s in seqs if s.sample]  # plan order
        self.last_rows = last_row  # (the eagle3 head reads each chunk's rows after)
        rids = [s.rid for s in to_sample]
        masked = self.grammars.constrained(rids)
        batch = _Batch(ordered, prefills, decodes, ids, positions, last_row, to_sample)
        fed = [(s, self.sampling.get(s.rid)) for s in ordered]
        t0 = time.perf_counter()
        if not masked:
            refused = self.grammars.observe_all(fed)  # no row samples with a grammar
            self.timings.grammar += time.perf_counter() - t0
            sampled, logprobs, failed = self._run(batch, None)
            return sampled, logprobs, {**refused, **failed}
        # matchers advance and masks are built on their thread while the model runs
        pending = self.grammars.masks_soon(fed, [rids[i] for i in masked],
                                           [to_sample[i].draft for i in masked])
        self.timings.grammar += time.perf_counter() - t0
        try:
            return self._run(batch, (masked, pending))
        finally:
            t0 = time.perf_counter()
            concurrent.futures.wait([pending])  # never leave a matcher in use
            self.timings.grammar += time.perf_counter() - t0

    def _run(self, batch: _Batch, pending: tuple[list[int], concurrent.futures.Future] | None
             ) -> _Sampled:
        ordered, prefills, decodes = batch.ordered, batch.prefills, batch.decodes
        ids, positions = batch.ids, batch.positions
        dev = self.device
        tm = self.timings
        t_forward = time.perf_counter()
        chunks = [(s.start_pos, len(s.token_ids), self.block_tables[s.rid]) for s in ordered]
        adapted = self.adapters is not None and self.adapters.prepare(ordered)
        try:
            images = self.images.gather(ordered)
            if (not prefills and not adapted and images is None and self.decode_graphs is not None
                    and self.decode_graphs.fits(len(decodes))):
                hidden = self.decode_graphs.run(chunks, ids, positions)
            else:
                meta = self.attn_backend.build(chunks, len(decodes), spans=self._image_spans(prefills))
                extra = {}
                if self.config.encoder is not None:  # each row's segment (a pair's second text: 1)
                    extra["token_types"] = self._token_types(ordered, dev)
                if images is not None:  # the image embeddings over their placeholder rows
                    extra["images"] = images
                if adapted:  # the layers' modules, whose hooks add the adapters' deltas
                    extra["flat"] = False
                hidden = self.model(
                    torch.tensor(ids, dtype=torch.long, device=dev),
                    torch.tensor(positions, dtype=torch.long, device=dev),
                    self.kv_caches,
                    meta,
                    **extra,
                )
        finally:
            if adapted:
                self.adapters.step_done()
        t_sample = time.perf_counter()
        tm.forward += t_sample - t_forward
        try:
            if self.pooler is not None:  # no logits: each finished request's vector
                self.pooler.pool(ordered, hidden, batch.last_row, batch.to_sample)
                return [0] * len(batch.to_sample), [], {}
            return self._sample(batch, hidden, pending)
        finally:
            tm.sample += time.perf_counter() - t_sample

    def _image_spans(self, prefills: list[SeqChunk]) -> dict[int, list[tuple[int, int]]] | None:
        """Each prefill chunk's image spans, where this model's image tokens attend each
        other both ways (Gemma 3). The scheduler keeps a span in one chunk; a chunk that
        holds part of one is a plan error (``AttentionBackend.build`` raises)."""
        vision = self.config.vision
        if vision is None or not vision.bidirectional:
            return None
        return {i: [(im.offset, im.offset + im.length) for im in s.images]
                for i, s in enumerate(prefills) if s.images} or None

    def _token_types(self, ordered: list[SeqChunk], dev: torch.device) -> torch.Tensor:
        """Each row's token type: 1 from a text pair's ``second_segment`` on, else 0."""
        types: list[int] = []
        for s in ordered:
            split = self.pooler.params.get(s.rid, PoolingParams()).second_segment
            n = len(s.token_ids)
            if split is None:
                types.extend([0] * n)
            else:
                first = max(0, min(n, split - s.start_pos))
                types.extend([0] * first + [1] * (n - first))
        return torch.tensor(types, dtype=torch.long, device=dev)

    def _sample(self, batch: _Batch, hidden: torch.Tensor,
                pending: tuple[list[int], concurrent.futures.Future] | None) -> _Sampled:
        """Prompt logprobs, then the sampled rows' logits, tokens and logprobs (NO_TOKEN
        for a request that failed on its own, with why); the time spent waiting for
        grammar masks is counted as grammar, not here."""
        ordered, last_row, to_sample = batch.ordered, batch.last_row, batch.to_sample
        dev = self.device
        for s in ordered:
            params = self.sampling.get(s.rid)
            if self.tracker.wants_prompt_logprobs(s, params):
                last = last_row[id(s)]
                chunk_logits = self.model.compute_logits(hidden[last - len(s.token_ids) + 1:last + 1])
                self.tracker.add_prompt_logprobs(s, params, chunk_logits)
        if not to_sample:  # (then no mask is pending)
            return [], [], {}
        params = [self.sampling[s.rid] for s in to_sample]
        rows, row_params, row_histories, follow, first = self._verify_rows(batch, params)
        logits = self.model.compute_logits(hidden[torch.tensor(rows, dtype=torch.long, device=dev)])
        masks, failed = None, {}
        if pending is not None:  # the grammars' failures: their rows allow no token
            t0 = time.perf_counter()
            bitmask, failed = pending[1].result()
            masks = ([first[i] + j for i in pending[0] for j in range(1 + len(to_sample[i].draft))],
                     bitmask)  # (a constrained chunk: one row per verify position)
            waited = time.perf_counter() - t0
            self.timings.grammar += waited
            self.timings.sample -= waited  # _run adds the whole of _sample
        generators = [self.generators.get(s.rid) for s in to_sample]
        row_tokens, row_lps, unsampled = self.sampler.sample(
            logits,
            row_params,
            [generators[i] for i in self._owners(first, len(rows))],
            row_histories,
            masks,
            follow if len(rows) > len(to_sample) else None,
        )
        row_tokens = self.ranks.rank0_ints(row_tokens)  # rank 0's outcome, failures included
        tokens: list[int] = []
        out: list[SampleLogprobs | None] = []
        for i, (s, p) in enumerate(zip(to_sample, params)):
            r0 = first[i]
            kept = 0
            while kept < len(s.draft) and row_tokens[r0 + kept] == s.draft[kept]:
                kept += 1
            if s.draft:
                self.accepted[id(s)] = kept
            token, lp = row_tokens[r0 + kept], row_lps[r0 + kept]
            tokens.append(token)
            if token == NO_TOKEN:
                failed.setdefault(s.rid, unsampled.get(r0 + kept, _NOT_SAMPLED))
                out.append(None)
                continue
            self.last_sampled[s.rid] = token
            if self.forced_drafts and pending is not None and p.grammar is not None \
                    and s.rid not in failed:
                self.forced[id(s)] = self.grammars.advance(s.rid, [*s.draft[:kept], token],
                                                           self.forced_drafts)
            prompt = self.tracker.take_prompt_logprobs(s.rid) if p.prompt_logprobs >= 0 else None
            out.append(None if lp is None and prompt is None else
                       SampleLogprobs(lp if lp is not None else TokenLogprob(-1, None), prompt,
                                      row_lps[r0:r0 + kept] if lp is not None else []))
        return tokens, (out if any(x is not None for x in out) else []), failed

    def _verify_rows(self, batch: _Batch, params: list[SamplingParams]):
        """The hidden-state rows to sample, one per sampling chunk, or 1 + k for a chunk
        with k drafts (its last 1 + k positions, each a decode position of its own), with
        each row's params and token history (the history up to that row's position:
        penalties and min_tokens see the drafts before it as generated), ``follow`` (the
        draft the next row of a group was fed, None at a group's end) and each chunk's
        first row."""
        rows: list[int] = []
        row_params: list[SamplingParams] = []
        histories = []
        follow: list[int | None] = []
        first: list[int] = []
        for s, p in zip(batch.to_sample, params):
            last, k = batch.last_row[id(s)], len(s.draft)
            history = self.tracker.history(s.rid, p)
            first.append(len(rows))
            for j in range(k + 1):
                rows.append(last - k + j)
                row_params.append(p)
                follow.append(s.draft[j] if j < k else None)
                histories.append(history if history is None or j == k
                                 else (history[0][:len(history[0]) - k + j], history[1]))
        return rows, row_params, histories, follow, first

    @staticmethod
    def _owners(first: list[int], num_rows: int) -> list[int]:
        """For each verify row, the index of the sampling chunk it belongs to."""
        bounds = [*first, num_rows]
        return [i for i in range(len(first)) for _ in range(bounds[i + 1] - bounds[i])]
