"""Continuous batching: decide which tokens run in the next step.

Policy, in order:
1. Running requests first, in arrival order; each gets its pending tokens (one for a
   decode, a chunk of its prompt while prefill is unfinished), within the step's token
   budget. If KV blocks run out, the most recently arrived running request is preempted
   (recompute: its blocks are freed and it re-queues at the head of the waiting line
   with its generated tokens kept, so it resumes where it stopped).
2. Then waiting requests join in (priority, arrival) order while there is budget, a free
   slot and KV blocks for their first chunk. A long prompt is chunked by the budget, so
   running streams keep decoding while it prefills.

Running ahead: while a step is in flight the loop plans the next one (``lookahead``), so
the worker never waits for the scheduler. A request whose token is still being sampled
feeds ``PLACEHOLDER_TOKEN`` (the worker substitutes the token it sampled for it last),
and a lookahead plan never preempts: it only takes blocks that are free. If the sampled
token ends the request, the step already sent computes one wasted token; the request's
blocks are freed at once all the same, because the worker runs steps in order: any later
step that reuses them writes after the stray write, and the stray position is never in a
full (prefix-cached) block.

Prefix caching: when a request is admitted (fresh, or again after preemption) its leading
full blocks are looked up in the allocator's cache and shared instead of recomputed. At
least one prompt token is always left to compute, because sampling needs its logits. The
worker never sees a hit's ids, so a request whose sampling reads its token history
(penalties, min_tokens) gets them once, as its first chunk's ``context``. A
request that asks for prompt logprobs needs the logits of every prompt position, so it
never takes a hit (as vLLM); its blocks are still offered to the cache for others.
A pooling request (``TokenizedReq.pooling``: a prefill whose one output, its "sample", is
the pooled hidden state) neither reads nor fills the cache: mean and cls pooling need the
hidden state of positions a hit would skip, and last-token pooling's equality under a hit
is not proven, so every pooling prompt is computed whole.
Blocks that planned steps are still filling are shared too (``Planner.filling``): the
worker runs steps in order and, within a step, writes every chunk's K/V before any chunk
attends, so a request planned after the chunk that fills a block (in the same step or a
later one) reads it written. A burst of requests with one long prefix therefore computes
the prefix once and all of them get their first token in the same step, where a request
had to wait for the filling step to return. The filler must be one the worker surely
feeds: a request with a grammar lends nothing (its grammar may fail to compile, and then
the worker skips it). If the filling step fails, or the filler fails on its own, the
requests that borrowed its blocks fail with it (``PlannedStep.lent``); a filler that
finishes (an abort) lends nothing more, since its freed blocks may be handed out again.
Such blocks enter the prefix cache when a holder's step returns (``commit``).

LoRA: at most ``max_loras`` distinct adapters run at once (the ranks hold that many on
the device). A waiting request for another adapter lets the requests behind it in the
queue go first until one of the running adapters has no request left; the base model
counts as no adapter. A request's adapter roots its blocks' keys (see ``request``).

Images (``TokenizedReq.images``): a chunk names the images its positions overlap, and an
image's pixels go with the first of them since the request was (re)admitted (a prefix hit
may start it inside a span; a preempted request's recompute sends them again): the worker
encodes each whole image once and keeps its embeddings until the span is fed. A block's
prefix-cache key holds the content hash of every image it overlaps (``request``).
A ``whole`` image (Gemma 3, whose image tokens attend each other both ways) is never
split: a chunk that would end inside it stops before it (``SchedRequest.chunk_size``; one
that would start with it and cannot hold it waits for a step with room, which the
launcher makes sure ``max_num_batched_tokens`` gives), and a prefix hit that would end
inside it is cut back to the block holding its first token (``whole_blocks``): the rows
after the cut would attend the rows before it, which that step does not compute, and a
split would make the image's KV depend on where the chunk ended.

Plans are diffs: a chunk names only the blocks the worker has not been sent for that
request yet (``SeqChunk.kept_blocks`` / ``new_blocks``), so a decode step's message stays
the same size at any context length. After a step returns, ``postprocess`` appends the
sampled tokens, decides which requests finished and frees them; the engine loop only
moves messages.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from cluster.topology import SpeculativeSpec
from protocol.ipc import (PLACEHOLDER_TOKEN, PoolingParams, RequestFailure, SamplingParams,
                          SeqChunk)
from scheduler.block_manager import BlockAllocator, BlockKey
from scheduler.request import SchedRequest
from scheduler.speculation import Drafts
from scheduler.waiting import WaitQueue


# a request whose shared prefix blocks were never written: its filler failed first
BORROWED_FROM_FAILED = RequestFailure(
    "engine_error", "the request computing this request's shared prompt prefix failed, so "
    "the prefix this request was to reuse was not computed")


@dataclass
class PlannedStep:
    chunks: list[SeqChunk] = field(default_factory=list)
    members: list[tuple[SchedRequest, int]] = field(default_factory=list)  # (req, n tokens)
    new_sampling: dict[str, SamplingParams] = field(default_factory=dict)
    preempted: list[SchedRequest] = field(default_factory=list)
    writing: list[BlockKey] = field(default_factory=list)  # full blocks it fills, lendable at once
    released: list[str] = field(default_factory=list)  # rids the worker may forget
    new_pooling: dict[str, PoolingParams] = field(default_factory=dict)
    new_adapters: dict[str, int] = field(default_factory=dict)  # rid -> LoRA adapter id
    # filler rid -> requests that share blocks this step fills for it (they fail with it)
    lent: dict[str, list[SchedRequest]] = field(default_factory=dict)


@dataclass
class FillingBlock:
    """A full block a planned step is filling: its id, the block before it in the filler's
    table (checked as the allocator checks a cached block's parent) and who fills it."""

    block: int
    parent: int
    filler: SchedRequest
    step: PlannedStep


@dataclass
class Sampled:
    """One token a returned step sampled for a live request. ``row`` indexes the
    StepResult's ``sampled``/``logprobs``; ``finish_reason`` set means it was the last.
    A request that failed on its own has ``failure`` (finish_reason "error", no token).
    ``drafted``: the drafts the worker kept before ``token`` (speculative decoding): the
    request's new ids are ``drafted + [token]``."""

    req: SchedRequest
    token: int
    row: int
    finish_reason: str | None
    failure: RequestFailure | None = None
    drafted: list[int] = field(default_factory=list)


class Planner:
    def __init__(self, allocator: BlockAllocator, block_size: int, max_num_seqs: int,
                 max_num_batched_tokens: int, enable_prefix_caching: bool = True,
                 max_loras: int = 0, speculative: SpeculativeSpec | None = None,
                 whole_prompts: bool = False) -> None:
        self.allocator = allocator
        self.drafts = Drafts(speculative) if speculative is not None else None
        # a bidirectional encoder's prompt is never split: it waits for a step with room
        # for all of it (the launcher makes max_num_batched_tokens cover the context)
        self.whole_prompts = whole_prompts
        self.max_loras = max_loras  # distinct adapters running at once (0: LoRA off)
        self.block_size = block_size
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.enable_prefix_caching = enable_prefix_caching
        self.waiting = WaitQueue()
        self.running: list[SchedRequest] = []
        # prompt tokens looked up in / served from the prefix cache, cumulative
        self.prefix_queried_tokens = 0
        self.prefix_hit_tokens = 0
        self.prefix_hit_blocks = 0  # cached blocks admitted requests took, every admission
        # full blocks that planned steps are still filling, lent to requests admitted
        # meanwhile (see the module docstring)
        self.filling: dict[BlockKey, FillingBlock] = {}
        self.released: list[str] = []  # finished rids the worker has seen, for the next plan

    def free(self, req: SchedRequest) -> None:
        if self.filling:  # its blocks may go to others now: lend none of them any more
            for key in [k for k, entry in self.filling.items() if entry.filler is req]:
                del self.filling[key]
        self.allocator.free(req.block_table)
        req.block_table = []
        req.num_registered = 0
        req.blocks_sent = 0

    def finish(self, req: SchedRequest) -> None:
        """Take ``req`` out of the queues and free its blocks (idempotent). Safe while a
        step that includes it is in flight: the worker runs steps in order, so a later
        step reusing the blocks writes after it."""
        if req.finished:
            return
        req.finished = True
        if self.drafts is not None:
            self.drafts.finished(req)
        self.free(req)
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        if req.seen_by_worker:
            self.released.append(req.rid)

    def _returned(self, step: PlannedStep) -> None:
        self.step_returned(step)
        for (req, n), chunk in zip(step.members, step.chunks):
            req.step_returned(n, chunk.sample)

    def postprocess(self, step: PlannedStep, sampled: list[int],
                    failed: dict[str, RequestFailure] | None = None,
                    accepted: list[int] | None = None,
                    forced: list[list[int]] | None = None,
                    proposed: list[list[int]] | None = None) -> list[Sampled]:
        """A step came back with ``sampled`` (one id per sampling chunk, plan order):
        commit written blocks to the prefix cache, append each live request's token and
        finish those it ends. Requests finished meanwhile (aborts) are skipped; those
        that ``failed`` on their own are finished, their blocks never offered to the
        cache (the worker may not have written them). ``accepted``: per sampling chunk,
        how many of its drafts were kept before its token (speculative decoding); they
        are appended first, each checked for the end as a sampled token is. ``forced``:
        per sampling chunk, the tokens a constrained request's grammar forces next (its
        next drafts). ``proposed``: per sampling chunk, the draft model's guesses after its
        token (``draft_model``; its next drafts while no later token came in)."""
        self._returned(step)
        failed = failed or {}
        accepted = accepted or []
        forced = forced or []
        out: list[Sampled] = []
        row = 0
        for (req, _), chunk in zip(step.members, step.chunks):
            row += chunk.sample
            if req.finished:
                continue
            failure = failed.get(req.rid)
            if failure is not None:
                self.finish(req)
                out.append(Sampled(req, -1, -1, "error", failure))
                lent = failure if failure.recompute else BORROWED_FROM_FAILED
                out.extend(Sampled(b, -1, -1, "error", lent)
                           for b in self._fail_borrowers(step, req.rid))
                continue
            kept = chunk.draft[:accepted[row - 1]] if chunk.draft and accepted else []
            if chunk.draft:
                req.drafts_accepted(len(kept))
                req.spec_drafted += len(chunk.draft)
                req.spec_accepted += len(kept)
                req.spec_refusals += len(kept) < len(chunk.draft)
                if self.drafts is not None:
                    self.drafts.counts.add(len(chunk.draft), len(kept))
            if not chunk.sample:
                self.commit(req)
                continue
            req.forced = forced[row - 1] if forced else []
            reason = None
            new = [*kept, sampled[row - 1]]
            for i, token in enumerate(new):
                req.token_ids.append(token)
                req.num_generated += 1
                reason = req.finish_reason_after(token)
                if reason is not None:
                    del new[i + 1:]
                    break
            self.commit(req)  # (after the kept drafts' ids: a block they fill is keyed by them)
            if proposed:
                req.proposed, req.proposed_at = proposed[row - 1], len(req.token_ids)
            if reason is not None:
                self.finish(req)
            out.append(Sampled(req, new[-1], row - 1, reason, drafted=new[:-1]))
        return out

    def step_failed(self, step: PlannedStep) -> list[SchedRequest]:
        """A step failed on the worker: its live requests, finished here (they fail)."""
        self._returned(step)
        failed = [req for req, _ in step.members if not req.finished]
        for req in failed:
            self.finish(req)
        for rid in step.lent:
            failed.extend(self._fail_borrowers(step, rid))
        return failed

    def _fail_borrowers(self, step: PlannedStep, filler_rid: str) -> list[SchedRequest]:
        """Finish the live requests that share blocks ``step`` was to fill for a request
        that failed (the worker may not have written them)."""
        out = [b for b in step.lent.get(filler_rid, ()) if not b.finished]
        for borrower in out:
            self.finish(borrower)
        return out

    def commit(self, req: SchedRequest) -> None:
        """After a step returned: offer the request's newly completed full blocks to the
        prefix cache (their KV is written now)."""
        if not self.enable_prefix_caching or not req.block_table or req.req.pooling is not None:
            return
        # blocks whose KV is written and whose ids are known (a run of kept drafts cut
        # short by the request's end computed KV past its last id)
        full = min(min(req.num_computed, len(req.token_ids)) // self.block_size, len(req.block_table))
        if full <= req.num_registered:
            return
        req.full_block_hashes(full, self.block_size)
        table = req.block_table
        for i in range(req.num_registered, full):
            self.allocator.register(table[i], req.block_key(i, self.block_size),
                                    table[i - 1] if i else -1)
        req.num_registered = full

    def step_returned(self, step: PlannedStep) -> None:
        """A planned step came back (or failed): its blocks are no longer being filled
        (the fillers' ``commit`` caches them)."""
        for key in step.writing:
            if (entry := self.filling.get(key)) is not None and entry.step is step:
                del self.filling[key]

    def _note_writes(self, step: PlannedStep, req: SchedRequest, start: int, n: int) -> None:
        """Offer the full blocks of known tokens that this chunk completes to requests
        admitted before it returns (unless the worker might skip ``req``'s chunk)."""
        bs = self.block_size
        end = min(start + n, len(req.token_ids)) // bs  # a placeholder's block is unknown
        if (not self.enable_prefix_caching or end <= start // bs
                or req.req.sampling.grammar is not None or req.req.pooling is not None):
            return
        req.full_block_hashes(end, bs)
        table = req.block_table
        for i in range(start // bs, end):
            key = req.block_key(i, bs)
            if key not in self.filling:
                self.filling[key] = FillingBlock(table[i], table[i - 1] if i else -1, req, step)
                step.writing.append(key)

    def _borrow_filling(self, req: SchedRequest, limit: int) -> None:
        """Extend ``req``'s prefix match with blocks planned steps are filling (never to
        the inside of a whole image: ``SchedRequest.whole_blocks``)."""
        bs = self.block_size
        table = req.block_table
        entries: list[FillingBlock] = []
        for i in range(len(table), limit):
            entry = self.filling.get(req.block_key(i, bs))
            parent = entries[-1].block if entries else table[-1] if table else -1
            if entry is None or entry.parent != parent:
                break
            entries.append(entry)
        for entry in entries[:req.whole_blocks(len(table) + len(entries), bs) - len(table)]:
            self.allocator.acquire(entry.block)
            table.append(entry.block)
            borrowers = entry.step.lent.setdefault(entry.filler.rid, [])
            if not borrowers or borrowers[-1] is not req:  # once per filler and step
                borrowers.append(req)

    def _reads_cache(self, req: SchedRequest) -> bool:
        """Whether ``req`` may be served from the prefix cache."""
        return (self.enable_prefix_caching and req.req.sampling.prompt_logprobs < 0
                and req.req.pooling is None)

    def cached_run(self, req: SchedRequest, limit: int) -> list[int]:
        """The prefix cache's blocks for ``req``'s leading full blocks (at most ``limit``),
        in order, up to the first it lacks; nothing is taken."""
        bs = self.block_size
        req.full_block_hashes(limit, bs)
        run: list[int] = []
        parent = -1
        for i in range(limit):
            block = self.allocator.lookup(req.block_key(i, bs), parent)
            if block is None:
                break
            run.append(block)
            parent = block
        return run

    def _match_prefix(self, req: SchedRequest) -> int:
        """Share the longest run of leading full blocks that are cached or being filled
        (never the whole prompt); returns how many were found."""
        if not self._reads_cache(req) or req.num_computed or req.block_table:
            return 0
        limit = (len(req.token_ids) - 1) // self.block_size
        run = self.cached_run(req, limit)
        for block in run[:req.whole_blocks(len(run), self.block_size)]:
            self.allocator.acquire(block)
            req.block_table.append(block)
        req.num_registered = len(req.block_table)  # borrowed ones: it may register them too
        if self.filling:
            self._borrow_filling(req, limit)
        req.reset_computed(len(req.block_table) * self.block_size)
        return len(req.block_table)

    def _unmatch(self, req: SchedRequest) -> None:
        """Admission failed after matching: give the shared blocks back (and the lent
        ones: a later admission borrows them again)."""
        self.free(req)
        req.reset_computed()
        for entry in self.filling.values():
            borrowers = entry.step.lent.get(entry.filler.rid)
            if borrowers and borrowers[-1] is req:  # its borrowings were its filler's last
                borrowers.pop()

    def _preempt(self, victim: SchedRequest, step: PlannedStep) -> None:
        self.running.remove(victim)
        self.free(victim)
        victim.reset_computed()
        victim.preemptions += 1
        self.waiting.push(victim)
        step.preempted.append(victim)

    def _grow(self, req: SchedRequest, n: int) -> bool:
        need = req.blocks_needed(n, self.block_size)
        if need == 0:
            return True
        blocks = self.allocator.allocate(need)
        if blocks is None:
            return False
        req.block_table.extend(blocks)
        return True

    def _speculates(self, req: SchedRequest) -> bool:
        sreq = req.req
        return (self.drafts is not None and bool(req.num_generated) and sreq.pooling is None
                and self.drafts.allowed(len(self.running)) and not self.drafts.gave_up(req))

    def _waits_to_draft(self, req: SchedRequest) -> bool:
        """Whether ``req``, its next token still being sampled, skips running ahead so
        that its next step can carry drafts (they must follow the real token): only
        while the drafter finds a match for its known tail (copying), or its grammar
        forced tokens last time (a structured stretch), so a request with nothing to
        copy keeps the run-ahead step. With a draft model: while the step in flight asks
        it for proposals for ``req`` (``SeqChunk.propose``)."""
        if not req.samples_in_flight:
            return False
        if self.drafts is not None and self.drafts.by_model and req.proposing:
            return True
        if not self._speculates(req):
            return False
        if req.forced:
            return True
        if self.drafts.by_model:
            return False
        return (self.drafts.depth(req, self.drafts.spec.num_speculative_tokens,
                                  len(self.running)) > 0
                and self.drafts.worth_waiting(req, req.token_ids))

    def _draft(self, req: SchedRequest, n: int, budget: int) -> list[int]:
        """Speculative drafts for ``req``'s next decode (see ``scheduler.speculation``):
        only for a decode whose last token is known (no placeholder), never past
        ``max_tokens`` (one token of the step is the worker's own) or the step's budget,
        never for a pooling request. A constrained request drafts the tokens its grammar
        forces (free: its rows can sample nothing else) where there are any, else what
        the drafter proposes (the worker drops those its grammar refuses)."""
        sreq = req.req
        if n != 1 or req.samples_in_flight or not self._speculates(req):
            return []
        room = min(sreq.max_tokens - req.num_generated - 1, budget - n)
        if req.forced:  # kept for sure: as many as k allows
            return req.forced[:max(0, min(room, self.drafts.spec.num_speculative_tokens))]
        room = min(room, self.drafts.depth(req, self.drafts.spec.num_speculative_tokens,
                                           len(self.running)))
        if self.drafts.by_model:
            return self.drafts.proposals(req, room)
        req.draft_index, draft = self.drafts.propose(req.draft_index, req.token_ids, room)
        return draft

    def _add(self, step: PlannedStep, req: SchedRequest, n: int,
             draft: list[int] | None = None) -> None:
        start = req.num_scheduled
        tokens = req.token_ids[start:start + n]
        if len(tokens) < n:  # the token a step in flight samples
            tokens.append(PLACEHOLDER_TOKEN)
        sample = start + n == len(req.token_ids) + req.samples_in_flight
        kept = req.blocks_sent
        sampling = req.req.sampling
        # a hit the worker never saw, for a request whose sampling reads its history
        context = (req.token_ids[:start] if start and not req.seen_by_worker
                   and sampling.needs_history() else [])
        images = req.chunk_images(start, start + n) if req.req.images else []
        # a draft model proposes after decodes only: after the prompt its k - 1 passes
        # would add to the time to first token (its prefill of the prompt still runs)
        propose = (self.drafts.propose_count(req, len(self.running))
                   if sample and n == 1 and self.drafts is not None else 0)
        req.proposing = propose > 0
        shift = req.rope_shift(start) if req.req.images else 0
        step.chunks.append(SeqChunk(req.rid, tokens, start, req.block_table[kept:], sample, kept,
                                    context, draft or [], images, propose, shift))
        req.blocks_sent = len(req.block_table)
        self._note_writes(step, req, start, n)
        req.scheduled(n, sample)
        req.speculating = bool(draft)
        step.members.append((req, n))
        if not req.seen_by_worker:
            step.new_sampling[req.rid] = sampling
            if req.req.pooling is not None:
                step.new_pooling[req.rid] = req.req.pooling
            if req.adapter:
                step.new_adapters[req.rid] = req.adapter
            req.seen_by_worker = True

    def plan(self, lookahead: bool = False) -> PlannedStep:
        """The next step. ``lookahead``: a step is still in flight, so plan around its
        tokens and never preempt (requests in it cannot be rewound)."""
        step = PlannedStep()
        budget = self.max_num_batched_tokens
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            n = req.chunk_size(req.num_scheduled, min(req.num_pending, budget))
            if n == 0 or (lookahead and self._waits_to_draft(req)) or \
                    (self.whole_prompts and n < req.num_pending):
                i += 1
                continue
            draft = self._draft(req, n, budget)
            if draft and not self._grow(req, n + len(draft)):
                draft = []  # no blocks for the drafts: a plain decode
            while not self._grow(req, n):
                if lookahead:
                    return step  # out of blocks: preempt later, with nothing in flight
                victim = self.running[-1]
                self._preempt(victim, step)
                if victim is req:
                    break
            else:
                self._add(step, req, n, draft)
                budget -= n + len(draft)
                i += 1
                continue
            # req itself was preempted; the loop index now points at the next one
        adapters: set[int] | None = None  # running adapters, once a waiting request has one
        at = 0  # the queue position admitted next: past requests whose adapter must wait
        while at < len(self.waiting) and budget > 0 and len(self.running) < self.max_num_seqs:
            req = self.waiting[at]
            if step.preempted and req in step.preempted:
                break  # do not re-admit what this very step had to evict
            if req.adapter:
                if adapters is None:
                    adapters = {r.adapter for r in self.running if r.adapter}
                if req.adapter not in adapters and len(adapters) >= self.max_loras:
                    at += 1
                    continue
            if self.whole_prompts and req.num_pending > budget:
                break  # FCFS: it runs first in a step with room for its whole prompt
            matched = self._match_prefix(req)
            n = req.chunk_size(req.num_scheduled, min(req.num_pending, budget))
            if n == 0 or not self._grow(req, n):
                self._unmatch(req)
                break
            if req.cached_tokens is None:
                req.cached_tokens = req.num_computed
                if self._reads_cache(req):
                    self.prefix_queried_tokens += len(req.req.prompt_token_ids)
                    self.prefix_hit_tokens += req.num_computed
            self.prefix_hit_blocks += matched  # counted once admitted, not per attempt
            self.waiting.pop(at)
            self.running.append(req)
            if adapters is not None and req.adapter:
                adapters.add(req.adapter)
            self._add(step, req, n)
            budget -= n
        if step.chunks:
            step.released, self.released = self.released, []
        return step
