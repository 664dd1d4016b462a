"""The scheduler's view of one request."""

from __future__ import annotations

from dataclasses import dataclass, field

import msgspec

from protocol.ipc import ImageInput, TokenizedReq
from scheduler.block_manager import ROOT_HASH, BlockKey, chain_hash


@dataclass(eq=False)
class SchedRequest:
    req: TokenizedReq
    arrival_seq: int
    token_ids: list[int] = field(default_factory=list)  # prompt + generated so far
    num_computed: int = 0      # tokens whose KV is in the cache
    num_scheduled: int = 0     # tokens handed to the worker: computed, or in a step in flight
    samples_in_flight: int = 0  # tokens being sampled by steps in flight (0 or 1)
    steps_in_flight: int = 0   # steps in flight that include this request
    block_table: list[int] = field(default_factory=list)
    num_generated: int = 0
    seen_by_worker: bool = False
    preemptions: int = 0
    cached_tokens: int | None = None  # prefix-cache hit at first admission
    block_hashes: list[int] = field(default_factory=list)  # chained hash per full block
    store_chains: list[bytes] = field(default_factory=list)  # the KV store's (kv_connectors/kv_store.py)
    num_registered: int = 0  # leading blocks of block_table offered to the prefix cache
    blocks_sent: int = 0  # leading blocks of block_table the worker already holds
    finished: bool = False  # finished or aborted: later samples for it are dropped
    adapter: int = 0  # LoRA adapter id (scheduler.adapters); 0: the base model
    # speculative decoding: a step in flight feeds drafts after this request's last token
    # (until it returns, where the request stands is unknown: no run-ahead for it)
    speculating: bool = False
    # its drafter's index of its ids (scheduler.speculation.NgramIndex, suffix.SuffixIndex)
    draft_index: object | None = None
    spec_drafted: int = 0  # draft tokens verified for it, and those accepted (its report)
    spec_accepted: int = 0
    spec_refusals: int = 0  # its drafting steps that did not keep every draft (dynamic k)
    # the tokens its grammar forces after its last token (the worker's latest word on it:
    # StepResult.forced), drafted next; empty for an unconstrained request
    forced: list[int] = field(default_factory=list)
    # speculative method draft_model: its latest planned chunk asked the worker's draft
    # model for proposals (then it sits out the run-ahead step behind it, to draft), and
    # the latest proposals (StepResult.drafts), valid while its ids number proposed_at
    proposing: bool = False
    proposed: list[int] = field(default_factory=list)
    proposed_at: int = -1
    # leading prompt images whose pixels went to the worker since it was (re)admitted
    images_sent: int = 0

    def __post_init__(self) -> None:
        if not self.token_ids:
            self.token_ids = list(self.req.prompt_token_ids)

    @property
    def rid(self) -> str:
        return self.req.rid

    @property
    def sort_key(self) -> tuple[bool, int, int]:
        """Waiting-queue order: health probes first, then lower priority value, then
        arrival (FCFS)."""
        return (not self.req.probe, self.req.priority, self.arrival_seq)

    def full_block_hashes(self, num_blocks: int, block_size: int) -> list[int]:
        """Chained hashes of the first ``num_blocks`` full blocks (memoised: token ids
        of a full block never change)."""
        hashes = self.block_hashes
        while len(hashes) < num_blocks:
            hashes.append(chain_hash(self.block_key(len(hashes), block_size)))
        return hashes

    def block_key(self, i: int, block_size: int) -> BlockKey:
        """The prefix-cache key of full block ``i``: its parent's chained hash (the
        hashes of blocks before ``i`` must be computed), the salt and its token ids. The
        first block's parent is the request's LoRA adapter id (ROOT_HASH, 0, for the
        base model), so every block of the chain is the adapter's own: a block computed
        under one adapter never serves another adapter or the base model."""
        parent = self.block_hashes[i - 1] if i else ROOT_HASH + self.adapter
        start, end = i * block_size, (i + 1) * block_size
        tokens = tuple(self.token_ids[start:end])
        images = tuple(im.content_hash for im in self.req.images
                       if im.offset < end and im.offset + im.length > start)
        return parent, self.req.cache_salt, tokens + images

    @property
    def num_pending(self) -> int:
        """Tokens still to feed before the next sample (the rest of the prompt, or the
        last token). A token a step in flight is sampling counts: the next step can feed
        it as a placeholder the worker fills in, unless that token is the last one
        ``max_tokens`` allows."""
        if self.speculating:
            return 0
        if self.samples_in_flight and self.num_generated + self.samples_in_flight >= self.req.max_tokens:
            return 0
        return len(self.token_ids) + self.samples_in_flight - self.num_scheduled

    def blocks_needed(self, num_new_tokens: int, block_size: int) -> int:
        total = self.num_scheduled + num_new_tokens
        return max(0, -(-total // block_size) - len(self.block_table))

    def scheduled(self, n: int, sample: bool) -> None:
        """``n`` more tokens went into a step (sampling one more when ``sample``)."""
        self.num_scheduled += n
        self.samples_in_flight += sample
        self.steps_in_flight += 1

    def step_returned(self, n: int, sampled: bool) -> None:
        """A step in flight came back: its ``n`` tokens are in the cache now."""
        self.num_computed += n
        self.samples_in_flight -= sampled
        self.steps_in_flight -= 1
        self.speculating = False

    def drafts_accepted(self, n: int) -> None:
        """``n`` drafts fed after the last token were kept: their KV is in the cache."""
        self.num_computed += n
        self.num_scheduled += n

    def reset_computed(self, num_computed: int = 0) -> None:
        """Back to ``num_computed`` cached tokens (preemption, prefix match); only with
        no step in flight."""
        assert self.steps_in_flight == 0, "cannot rewind a request a step in flight is computing"
        self.num_computed = self.num_scheduled = num_computed
        self.images_sent = 0  # a recompute needs them again (the worker may have dropped them)

    def chunk_images(self, start: int, end: int) -> list[ImageInput]:
        """The prompt images whose placeholder span positions ``start..end-1`` overlap,
        each with its pixels the first time since (re)admission, without them after (the
        worker's encoder cache holds its embeddings until the span is fed)."""
        out: list[ImageInput] = []
        for k, im in enumerate(self.req.images):
            if im.offset >= end:
                break
            if im.offset + im.length <= start:
                continue
            if k < self.images_sent:
                out.append(msgspec.structs.replace(im, pixels=b""))
            else:
                out.append(im)
                self.images_sent = k + 1
        return out

    def rope_shift(self, start: int) -> int:
        """M-RoPE's shift of the positions from ``start`` on (``SeqChunk.rope_shift``): the
        gains of the prompt images that end at or before it."""
        return sum(im.rope_gain for im in self.req.images if im.offset + im.length <= start)

    def chunk_size(self, start: int, n: int) -> int:
        """``n``, or fewer so that a chunk from ``start`` never ends inside a ``whole``
        image (Gemma 3: its tokens attend each other both ways, so all of them must be in
        the step that computes any); 0 when the chunk would begin with such an image and
        ``n`` cannot hold it (the request waits for a step with room)."""
        end = start + n
        for im in self.req.images:
            if im.whole and im.offset < end < im.offset + im.length:
                return max(0, im.offset - start)
        return n

    def whole_blocks(self, blocks: int, block_size: int) -> int:
        """The most of ``blocks`` leading full blocks a prefix hit may take: never ending
        inside a ``whole`` image, whose later rows would then be computed without the
        earlier ones they attend (and the cached rows without the later ones)."""
        for im in reversed(self.req.images):
            if im.whole and im.offset < blocks * block_size < im.offset + im.length:
                blocks = im.offset // block_size
        return blocks

    def finish_reason_after(self, token_id: int) -> str | None:
        """Why generation ends after this newly sampled token, if it does. ``min_tokens``
        is the sampler's: it never samples eos or a stop id before then."""
        req = self.req
        if not req.ignore_eos and token_id in req.eos_token_ids:
            return "stop"
        if token_id in req.stop_token_ids:
            return "stop"
        if self.num_generated >= req.max_tokens:
            return "length"
        return None
