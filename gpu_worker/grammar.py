"""Constrained decoding in the worker: one llguidance matcher per constrained request.

The scheduler plans step N+1 before step N's token is known, so masks are built here,
where every sampled token is known: a matcher advances with the generated tokens the
plan feeds (the placeholder, once filled, is the token sampled last step), and the mask
for a row is computed right before that row is sampled. Recompute after preemption
re-feeds the same tokens (skipped), and anything that differs rolls the matcher back, so
the matcher always equals the tokens the KV cache holds.

A matcher that rejects a fed token, errs, or allows nothing is that request's own bad
state: it is reported (``Failures``), its mask row allows no token (so the sampler
cannot draw one), and only that request fails; the step goes on for the others.

Speculative decoding: a constrained chunk's drafts are checked against its matcher before
the forward pass (``check_drafts``: cut at the first one the grammar refuses, which the
model could never have sampled there), its verify rows get one mask each (``masks``: the
matcher walks the drafts and is rolled back to the chunk's fed tokens), and after
sampling the matcher takes the kept drafts and the sampled token at once
(``advance``), which tells the tokens the grammar now forces (llguidance's fast-forward
tokens): the scheduler drafts them next, free drafts whose rows can sample nothing else.
A matcher may so run one token ahead of the KV cache; the next chunk feeds that token
again, and ``observe`` skips what it already holds.

The vocabulary view is built on a thread at start-up (about a second on a large
vocabulary) so the first constrained request does not stall the step loop; matchers are
copied from a prototype per grammar text (compiled once, cached).
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Callable

import numpy as np

import llguidance
import torch

from protocol.ipc import RequestFailure, SamplingParams, SeqChunk

log = logging.getLogger(__name__)
_PROTOTYPES = 64
_BITMASK_SOURCE = Path(__file__).with_name("bitmask.cpp")
# (logits [rows, vocab], constrained rows, their packed bitmasks) -> None, in place
MaskApplier = Callable[[torch.Tensor, list[int], torch.Tensor], None]
# rid -> why its grammar failed it
Failures = dict[str, RequestFailure]


def build_bitmask_kernel():
    """The compiled CPU bitmask module (``apply_bitmask``), or None (``cpu_extension``)."""
    from gpu_worker.cpu_extension import build
    return build(_BITMASK_SOURCE, ["apply_bitmask"])


def _grammar_failure(message: str) -> RequestFailure:
    return RequestFailure("grammar_error", message)


class _State:
    def __init__(self, matcher: llguidance.LLMatcher) -> None:
        self.matcher = matcher
        self.consumed: list[int] = []  # generated tokens the matcher has accepted


class GrammarStates:
    def __init__(self, model_path: str, vocab_size: int,
                 device: torch.device = torch.device("cpu")) -> None:
        self.vocab_size = vocab_size
        self._tokenizer: llguidance.LLTokenizer | None = None
        self._error: BaseException | None = None
        self._kernel = None  # the compiled CPU bitmask kernel, once built
        self._ready = threading.Thread(target=self._build, args=(model_path,), daemon=True,
                                       name="grammar-vocab")
        if device.type == "cpu":  # until it is built (once per machine), the torch path
            threading.Thread(target=self._build_kernel, daemon=True,
                             name="grammar-kernel").start()
        self._ready.start()
        self._prototypes: OrderedDict[str, llguidance.LLMatcher] = OrderedDict()
        self._states: dict[str, _State] = {}
        self._special: np.ndarray | None = None  # special ids other than end-of-sequence
        # masks are computed here while the model runs the step's forward pass (the
        # engine releases the GIL); one thread, so matchers are never used concurrently
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="grammar-mask")

    def _build_kernel(self) -> None:
        module = build_bitmask_kernel()
        if module is not None:
            self._kernel = module.apply_bitmask

    def _build(self, model_path: str) -> None:
        try:
            from tokenization.grammar_vocab import build_tokenizer
            from tokenization.tokenizer_files import CheckpointTokenizer
            tok = CheckpointTokenizer(model_path)
            self._tokenizer = build_tokenizer(tok.backend.to_str(), self.vocab_size,
                                              tok.eos_token_ids)
        except BaseException as exc:  # reported when a constrained request needs it
            self._error = exc

    def tokenizer(self) -> llguidance.LLTokenizer:
        self._ready.join()
        if self._tokenizer is None:
            raise RuntimeError(f"constrained decoding is unavailable: {self._error}")
        if self._special is None:
            tok = self._tokenizer
            eos = set(tok.eos_tokens)
            self._special = np.array([i for i in range(min(tok.vocab_size, self.vocab_size))
                                      if tok.is_special_token(i) and i not in eos],
                                     dtype=np.int64)
        return self._tokenizer

    def register(self, rid: str, params: SamplingParams) -> None:
        """A request the worker sees for the first time (again after preemption: kept)."""
        if params.grammar is None or rid in self._states:
            return
        proto = self._prototypes.get(params.grammar)
        if proto is None:
            proto = llguidance.LLMatcher(self.tokenizer(), params.grammar)
            if proto.is_error():
                raise ValueError(f"{rid}: grammar does not compile: {proto.get_error()}")
            self._prototypes[params.grammar] = proto
            if len(self._prototypes) > _PROTOTYPES:
                self._prototypes.popitem(last=False)
        self._states[rid] = _State(proto.deep_copy())

    def release(self, rid: str) -> None:
        self._states.pop(rid, None)

    def observe(self, seq: SeqChunk, params: SamplingParams | None) -> None:
        """Advance ``seq.rid``'s matcher over the generated tokens this chunk feeds (not
        its drafts: they are verified, not known)."""
        state = self._states.get(seq.rid)
        if state is None or params is None:
            return
        first = seq.start_pos - params.num_prompt_tokens  # index among generated tokens
        fed = seq.token_ids[:len(seq.token_ids) - len(seq.draft)] if seq.draft else seq.token_ids
        for k, token in enumerate(fed):
            i = first + k
            if i < 0:
                continue
            if i < len(state.consumed):
                if state.consumed[i] == token:
                    continue
                self._rollback(seq.rid, state, len(state.consumed) - i)
            if i > len(state.consumed):
                raise ValueError(f"{seq.rid}: generated token {i} fed before token "
                                 f"{len(state.consumed)}")
            if not state.matcher.consume_token(token):
                raise ValueError(f"{seq.rid}: token {token} breaks its grammar: "
                                 f"{state.matcher.get_error()}")
            state.consumed.append(token)

    def check_drafts(self, seq: SeqChunk, params: SamplingParams) -> None:
        """Cut ``seq.draft`` before the first token its grammar refuses after the chunk's
        fed tokens (the matcher advanced over them now: the mask thread then finds them
        consumed). A matcher that refuses a fed token keeps no drafts: the step's own
        ``observe`` reports it."""
        state = self._states.get(seq.rid)
        if state is None or not seq.draft:
            return
        try:
            self.observe(seq, params)
        except ValueError:
            seq.draft = []
            return
        seq.draft = seq.draft[:state.matcher.validate_tokens(seq.draft)]

    def advance(self, rid: str, tokens: list[int], limit: int) -> list[int]:
        """After sampling: the matcher takes ``tokens`` (the kept drafts and the sampled
        token) and returns up to ``limit`` tokens its grammar forces next. Refused: none
        (the next chunk feeds them again, and its ``observe`` fails the request)."""
        state = self._states[rid]
        for token in tokens:
            if not state.matcher.consume_token(token):  # its error state stays for the
                return []                                 # next observe to report
            state.consumed.append(token)
        return state.matcher.compute_ff_tokens()[:limit] if limit else []

    @staticmethod
    def _rollback(rid: str, state: _State, n: int) -> None:
        if not state.matcher.rollback(n):
            raise ValueError(f"{rid}: grammar state cannot roll back {n} tokens")
        del state.consumed[len(state.consumed) - n:]

    def constrained(self, rids: list[str]) -> list[int]:
        """Indexes of ``rids`` that have a grammar."""
        return [i for i, rid in enumerate(rids) if rid in self._states]

    def observe_all(self, fed: list[tuple[SeqChunk, SamplingParams | None]]) -> Failures:
        """Advance every fed request's matcher; a request whose matcher rejects its
        tokens is returned (its matcher is left as it is: the request ends)."""
        failed: Failures = {}
        if self._states:
            for seq, params in fed:
                try:
                    self.observe(seq, params)
                except ValueError as err:
                    failed[seq.rid] = _grammar_failure(str(err))
        return failed

    def masks_soon(self, fed: list[tuple[SeqChunk, SamplingParams | None]],
                   rids: list[str], drafts: list[list[int]] | None = None) -> Future:
        """On the mask thread: advance the matchers over this step's ``fed`` chunks, then
        ``masks(rids, drafts)``: the future's result is (bitmasks, failures)."""
        def job() -> tuple[torch.Tensor, Failures]:
            failed = self.observe_all(fed)
            return self.masks(rids, failed, drafts), failed
        return self._pool.submit(job)

    def masks(self, rids: list[str], failed: Failures,
              drafts: list[list[int]] | None = None) -> torch.Tensor:
        """Packed allowed-token bitmasks ([rows, ceil(vocab/32)] int32) from each
        matcher's current state: one row per rid, or 1 + k for a rid whose chunk verifies
        k ``drafts`` (row j: the mask after its first j drafts; the matcher walks them
        and is rolled back). A rid that ``failed``, or whose matcher errs or allows
        nothing at its first row (added to ``failed``), allows no token. A later verify
        row that allows nothing (never seen: the drafts were checked) only cannot be
        sampled: its request fails only if the verification reaches it."""
        drafts = drafts or [[] for _ in rids]
        bitmask = all_allowed(sum(1 + len(d) for d in drafts), self.vocab_size)
        row_bytes = bitmask.shape[1] * 4
        base = bitmask.data_ptr()
        words = bitmask.numpy()
        heads: list[int] = []  # each rid's first row (the one a decode would have)
        plain: list[int] = []  # rows whose special ids are checked together, and theirs
        plain_rids: list[str] = []
        row = 0
        for rid, draft in zip(rids, drafts):  # the engine writes each row in place
            heads.append(row)
            if rid in failed:
                bitmask[row:row + 1 + len(draft)] = 0
                row += 1 + len(draft)
                continue
            matcher = self._states[rid].matcher
            if not draft:
                matcher.unsafe_compute_mask_ptr(base + row * row_bytes, row_bytes)
                plain.append(row)
                plain_rids.append(rid)
                row += 1
                continue
            walked = 0
            for j in range(len(draft) + 1):
                matcher.unsafe_compute_mask_ptr(base + row * row_bytes, row_bytes)
                self._check_special([rid], words, [row])
                row += 1
                if j < len(draft):
                    if not matcher.consume_token(draft[j]):
                        bitmask[row:row + len(draft) - j] = 0
                        row += len(draft) - j
                        break
                    walked += 1
            matcher.rollback(walked)
        if plain:
            self._check_special(plain_rids, words, plain)
        empty = set(np.flatnonzero(~words.any(axis=1)).tolist())
        for rid, head in zip(rids, heads):
            if rid in failed or (head not in empty and not self._states[rid].matcher.is_error()):
                continue
            # cannot happen for a grammar that compiled
            error = self._states[rid].matcher.get_error() or "no token allowed"
            log.error("%s: grammar allows no token: %s", rid, error)
            failed[rid] = _grammar_failure(f"the output constraint allows no token: {error}")
            bitmask[head] = 0
        return bitmask

    def _check_special(self, rids: list[str], words: np.ndarray, rows: list[int]) -> None:
        """The engine's mask can allow a special token where the grammar spells its text,
        which the matcher then refuses: such bits are cleared (cheap: few special ids).
        ``words``: the bitmask's int32 words, written in place; ``rows`` the rows to
        check, ``rids`` theirs, each matcher at its row's state."""
        special = self._special
        if special is None or not len(special):
            return
        bits = (words[rows][:, special // 32] >> (special % 32).astype(np.int32)) & 1
        for i, k in zip(*np.nonzero(bits)):
            token = int(special[k])
            if self._states[rids[i]].matcher.validate_tokens([token]) == 0:
                words[rows[i], token // 32] &= np.int32(_int32(~(1 << (token % 32))))

    def apply_masks(self, logits: torch.Tensor, rows: list[int], bitmask: torch.Tensor) -> None:
        """``apply_masks`` with the compiled kernel where it applies (CPU fp32 logits):
        a masked fill over a bool view of every token costs about 20x more."""
        kernel = self._kernel
        if kernel is None or logits.device.type != "cpu" or logits.dtype != torch.float32 \
                or not logits.is_contiguous():
            apply_masks(logits, rows, bitmask)
            return
        kernel(logits, bitmask, torch.tensor(rows, dtype=torch.int64))


def all_allowed(rows: int, vocab: int) -> torch.Tensor:
    """``rows`` bitmasks allowing every token: [rows, ceil(vocab / 32)] int32 words of -1,
    llguidance's layout. Made here, not by ``llguidance.torch.allocate_token_bitmask``:
    importing that module imports torch.compile's stack (dynamo, inductor), about 120 MiB
    of the worker's RSS and a second of its start, for what is one ``torch.full``."""
    return torch.full((rows, (vocab + 31) // 32), -1, dtype=torch.int32)


def _int32(value: int) -> int:
    """``value``'s low 32 bits as a signed int32 (bitmask words are int32)."""
    return (value + 2**31) % 2**32 - 2**31


def disallowed(bitmask: torch.Tensor, vocab: int) -> torch.Tensor:
    """Packed int32 words -> [rows, vocab] bool, True where the token is NOT allowed
    (bit j of word w is token 32 w + j). numpy's unpackbits and a bool view of its 0/1
    bytes cost microseconds where shifting int32 tensors or ``.bool()`` cost milliseconds."""
    bits = np.unpackbits(~bitmask.numpy().view(np.uint8), axis=1, bitorder="little")
    return torch.from_numpy(bits).view(torch.bool)[:, :vocab]


def apply_masks(logits: torch.Tensor, rows: list[int], bitmask: torch.Tensor) -> None:
    """Disallowed tokens of ``rows`` to -inf, in place."""
    drop = disallowed(bitmask, logits.shape[1]).to(logits.device)
    if len(rows) == logits.shape[0]:
        logits.masked_fill_(drop, float("-inf"))
        return
    index = torch.tensor(rows, device=logits.device)
    logits[index] = logits[index].masked_fill(drop, float("-inf"))
