"""Token sampling for one step: logit processors, greedy, temperature, top-k/p, min-p, seeds.

Order (as vLLM): raw logprobs are taken from the model's logits first; then logit_bias,
the min_tokens stop-id suppression and the penalties rewrite the logits, and a grammar's
mask removes disallowed tokens; then greedy rows take the argmax, and sampled rows go
through temperature, top-k, top-p and min-p.

Every processor touches only the rows that use it: penalties count token ids with one
index_put over the rows that have penalties, logit_bias adds its (row, id, bias) triples
with one index_put (cost proportional to the number of entries, never batch x vocab).

A row with no finite logit left (everything masked, or NaN/inf from the model) cannot be
sampled: its token is -1 and ``sample`` says why, so that request alone fails and every
other row of the step goes on. The check rides on the reduction greedy decoding does
anyway (``max`` gives the value with the index) and one sum on the host: ~1 us a step.

Drawing uses the exponential race (argmax p_i / E_i with E_i ~ Exp(1), equivalent to
sampling from p), so a row's draw consumes a fixed amount of randomness from its own
generator regardless of what else is in the batch: a seeded request reproduces its tokens
alone or batched.

Speculative decoding verifies a request's drafts on consecutive rows (``follow``: the
draft the next row of the group was fed, which that row's token must equal for the next
row to count). A drafter that is deterministic proposes a point mass q, and rejection
sampling against a point mass is exactly this: draw the row's token from p as without
drafts; accept the draft iff it is that token (probability p(d) = min(1, p/q)); on a
mismatch the drawn token is a draw from p without d, the residual distribution. A seeded
row draws its noise from its own generator row by row and stops at the first mismatch,
so the generator is consumed exactly as many times as tokens are kept: the same noise at
the same generated position as a run without drafts, hence the same tokens.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from gpu_worker.grammar import MaskApplier, apply_masks
from gpu_worker.models import row_ops
from protocol.ipc import RequestFailure, SamplingParams, SampleLogprobs, TokenLogprob

# (all token ids fed so far, number of those that are prompt) for one row
History = tuple[Sequence[int], int]
# A row that could not be sampled gets this id (never a vocabulary id).
NO_TOKEN = -1


class Sampler:
    def __init__(self, device: torch.device | str = "cpu", seed: int = 0,
                 apply_masks: MaskApplier = apply_masks) -> None:
        self.device = torch.device(device)
        self.apply_masks = apply_masks  # grammar masks (the worker's compiled one on CPU)
        # Shared by every unseeded request.
        self.generator = torch.Generator(device=self.device).manual_seed(seed)

    def sample(
        self,
        logits: torch.Tensor,
        params: list[SamplingParams],
        generators: list[torch.Generator | None],
        histories: list[History | None] | None = None,
        masks: tuple[list[int], torch.Tensor] | None = None,
        follow: list[int | None] | None = None,
    ) -> tuple[list[int], list[TokenLogprob | None], dict[int, RequestFailure]]:
        """logits: [rows, vocab], modified in place (bias, masks, penalties): the caller
        must not reuse them. ``generators[i]`` is row i's own generator, or None;
        ``histories[i]`` row i's token history (needed only where ``needs_history``);
        ``masks``: (rows, packed allowed-token bitmasks) of constrained rows, applied
        after every other processor so nothing can re-allow a disallowed token.
        ``follow[i]``: the draft row i+1 was fed (speculative decoding; see the module
        docstring): a seeded row after a row whose token differs from its ``follow`` is
        not drawn (its id is then meaningless, and its generator untouched).
        Returns the sampled ids, per row its logprobs (None where not asked for), and
        why each row that could not be sampled (id ``NO_TOKEN``) failed."""
        histories = histories or [None] * len(params)
        lp_rows = [i for i, p in enumerate(params) if p.logprobs >= 0]
        raw_logprobs = torch.log_softmax(logits[lp_rows].float(), dim=-1) if lp_rows else None
        logits = self._process(logits.float(), params, histories)
        if masks is not None:
            self.apply_masks(logits, *masks)
        best, tokens = _row_max(logits)
        rand_rows = [i for i, p in enumerate(params) if p.temperature > 0]
        if rand_rows:
            sub = [params[i] for i in rand_rows]
            probs = self._probs(logits[rand_rows], sub)
            tokens[rand_rows] = self._draw(probs, [generators[i] for i in rand_rows],
                                           [follow[i] for i in rand_rows] if follow else None)
        out_lp: list[TokenLogprob | None] = [None] * len(params)
        if lp_rows:
            chosen = tokens[lp_rows]
            for j, entry in enumerate(top_logprobs(raw_logprobs, chosen,
                                                   [params[i].logprobs for i in lp_rows])):
                out_lp[lp_rows[j]] = entry
        ids = tokens.tolist()
        if math.isfinite(sum(best.tolist())):  # (an overflow only costs the scan below)
            return ids, out_lp, {}
        bests = best.tolist()
        constrained = set(masks[0]) if masks is not None else set()
        failed = {i: _why_no_token(logits[i], params[i], histories[i], i in constrained)
                  for i, b in enumerate(bests) if not math.isfinite(b)}
        for i in failed:
            ids[i] = NO_TOKEN
        return ids, out_lp, failed

    # ------------------------------------------------------------------ processors

    def _process(self, logits: torch.Tensor, params: list[SamplingParams],
                 histories: list[History | None]) -> torch.Tensor:
        dev = logits.device
        # In place: a copy would cost B x V per step whenever one row has a bias, and the
        # raw log-softmax the logprobs need was taken before processing.
        bias = [(i, t, b) for i, p in enumerate(params) for t, b in p.logit_bias]
        if bias:
            rows, ids, values = zip(*bias)
            logits.index_put_((torch.tensor(rows, device=dev), torch.tensor(ids, device=dev)),
                              torch.tensor(values, dtype=logits.dtype, device=dev), accumulate=True)
        suppress = []
        for i, p in enumerate(params):
            if _holds_back_the_end(p, histories[i]):
                suppress.extend((i, t) for t in p.min_tokens_stop_ids)
        if suppress:
            rows, ids = zip(*suppress)
            logits[torch.tensor(rows, device=dev), torch.tensor(ids, device=dev)] = float("-inf")
        pen_rows = [i for i, p in enumerate(params)
                    if p.has_penalties() and histories[i] is not None]
        if pen_rows:
            logits[pen_rows] = _penalize(logits[pen_rows], [params[i] for i in pen_rows],
                                         [histories[i] for i in pen_rows])
        return logits

    def _probs(self, logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
        dev = logits.device
        temps = torch.tensor([p.temperature for p in params], dtype=torch.float32, device=dev)
        # Shift so the max is 0 before dividing: tiny temperatures then push the rest
        # towards -inf instead of overflowing to +inf (which would give NaN).
        logits = (logits - logits.amax(dim=-1, keepdim=True)) / temps[:, None]
        vocab = logits.shape[-1]
        top_k = [p.top_k if 0 < p.top_k < vocab else vocab for p in params]
        top_p = [p.top_p if p.top_p < 1.0 else float("inf") for p in params]
        if any(k < vocab for k in top_k) or any(p != float("inf") for p in top_p):
            logits = _filter(logits, top_k, top_p)
        probs = torch.softmax(logits, dim=-1)
        if any(p.min_p > 0 for p in params):
            min_p = torch.tensor([p.min_p for p in params], dtype=torch.float32, device=dev)
            keep = probs >= min_p[:, None] * probs.amax(dim=-1, keepdim=True)
            probs = probs.masked_fill(~keep, 0.0)  # the race needs no renormalisation
        return probs

    def _draw(self, probs: torch.Tensor, generators: list[torch.Generator | None],
              follow: list[int | None] | None = None) -> torch.Tensor:
        noise = torch.empty_like(probs)
        shared = [i for i, g in enumerate(generators) if g is None]
        if shared:
            noise[shared] = torch.empty(len(shared), probs.shape[1], device=probs.device).exponential_(
                generator=self.generator
            )
        stopped = False  # a seeded group's draft was refused: its later rows are not drawn
        tiny = torch.finfo(noise.dtype).tiny
        for i, g in enumerate(generators):
            if g is None:
                continue
            if stopped:
                noise[i] = 1.0
            else:
                noise[i].exponential_(generator=g)
            if follow is not None:  # decide now whether the group's next row is drawn
                stopped = follow[i] is not None and (stopped or int(
                    (probs[i] / noise[i].clamp(min=tiny)).argmax()) != follow[i])
        # An exact 0 draw would turn a filtered-out p=0 into 0/0 = NaN, which argmax picks.
        noise.clamp_(min=tiny)
        return (probs / noise).argmax(dim=-1)


def _row_max(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's max and the index of its first occurrence, as ``logits.max(dim=-1)``:
    fp32 on CPU through the compiled two-pass kernel (torch's indexed max is one scalar
    pass: ~58 µs for 32 x 2048 logits, 0.85 ms at a 32k vocabulary, ~10x the kernel)."""
    if logits.dim() == 2 and logits.shape[1] > 0 and logits.stride(-1) == 1 and row_ops.applies(logits):
        return row_ops.load().row_argmax(logits)
    return logits.max(dim=-1)


def _holds_back_the_end(p: SamplingParams, history: History | None) -> bool:
    """min_tokens still suppresses this row's end-of-sequence and stop ids."""
    return p.min_tokens > 0 and history is not None and len(history[0]) - history[1] < p.min_tokens


def _why_no_token(row: torch.Tensor, p: SamplingParams, history: History | None,
                  constrained: bool) -> RequestFailure:
    """The failure of a row with no finite logit (the rare path: worth a look at it)."""
    if not (row.isnan().any() or row.isposinf().any()):
        if constrained and _holds_back_the_end(p, history):
            made = len(history[0]) - history[1]
            return RequestFailure(
                "constraint_conflict",
                f"after {made} generated tokens the output constraint allows only tokens "
                f"that end the sequence (end-of-sequence or a stop_token_ids id), but "
                f"min_tokens ({p.min_tokens}) holds them back: the constraint and min_tokens "
                "cannot both hold; lower min_tokens or widen the constraint", 400, "min_tokens")
        return RequestFailure("no_token_allowed", "no token could be sampled for this request: "
                              "its processors and constraint ruled out every token")
    return RequestFailure("invalid_logits", "the model produced non-finite logits (NaN or inf) "
                          "for this request, so nothing could be sampled")


def top_logprobs(logprobs: torch.Tensor, chosen: torch.Tensor, ks: list[int],
                 with_rank: bool = False) -> list[TokenLogprob]:
    """Per row: the chosen id's logprob and the row's ``k`` most likely ids; with
    ``with_rank``, also the chosen id's rank (ids at least as likely, itself included)."""
    chosen_col = logprobs.gather(1, chosen[:, None])
    chosen_lp = chosen_col[:, 0].tolist()
    ranks = (logprobs >= chosen_col).sum(dim=-1).tolist() if with_rank else None
    # One top-k per distinct k: which of several equally likely ids make a row's list must
    # not depend on the largest k another row of the batch asked for.
    tops: dict[int, tuple[dict[int, list[int]], dict[int, list[float]]]] = {}
    for k in set(ks) - {0}:
        rows = [r for r, kr in enumerate(ks) if kr == k]
        values, indices = logprobs[rows].topk(k, dim=-1)
        tops[k] = (dict(zip(rows, indices.tolist())), dict(zip(rows, values.tolist())))
    ids = chosen.tolist()
    out = []
    for r, k in enumerate(ks):
        rank = ranks[r] if ranks is not None else None
        if k > 0:
            out.append(TokenLogprob(ids[r], chosen_lp[r], tops[k][0][r], tops[k][1][r], rank))
        else:
            out.append(TokenLogprob(ids[r], chosen_lp[r], rank=rank))
    return out


def _counts(lists: list[Sequence[int]], vocab: int, dev: torch.device) -> torch.Tensor:
    """[rows, vocab] occurrence counts, built with one index_put."""
    counts = torch.zeros(len(lists), vocab, dtype=torch.float32, device=dev)
    lengths = [len(x) for x in lists]
    if sum(lengths):
        flat = torch.tensor([t for x in lists for t in x], dtype=torch.long, device=dev)
        rows = torch.repeat_interleave(torch.arange(len(lists), device=dev),
                                       torch.tensor(lengths, device=dev))
        counts.index_put_((rows, flat), torch.ones_like(flat, dtype=torch.float32), accumulate=True)
    return counts


def _penalize(logits: torch.Tensor, params: list[SamplingParams], histories: list[History]) -> torch.Tensor:
    """repetition_penalty over prompt + generated (HF: divide positive logits, multiply
    negative ones); presence/frequency over generated tokens only (OpenAI's definition)."""
    dev, vocab = logits.device, logits.shape[-1]
    generated = _counts([h[0][h[1]:] for h in histories], vocab, dev)
    rep = torch.tensor([p.repetition_penalty for p in params], dtype=torch.float32, device=dev)[:, None]
    if (rep != 1.0).any():
        seen = (_counts([h[0] for h in histories], vocab, dev) > 0)
        logits = torch.where(seen, torch.where(logits > 0, logits / rep, logits * rep), logits)
    freq = torch.tensor([p.frequency_penalty for p in params], dtype=torch.float32, device=dev)[:, None]
    pres = torch.tensor([p.presence_penalty for p in params], dtype=torch.float32, device=dev)[:, None]
    return logits - freq * generated - pres * (generated > 0).float()


def _filter(logits: torch.Tensor, top_k: list[int], top_p: list[float]) -> torch.Tensor:
    """Set logits outside each row's top-k, then outside its top-p nucleus, to -inf."""
    dev = logits.device
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    ranks = torch.arange(logits.shape[-1], device=dev)
    k = torch.tensor(top_k, device=dev)
    mask = ranks[None, :] >= k[:, None]
    sorted_logits = sorted_logits.masked_fill(mask, float("-inf"))
    p = torch.tensor(top_p, dtype=torch.float32, device=dev)
    probs = torch.softmax(sorted_logits, dim=-1)
    mass_before = probs.cumsum(dim=-1) - probs
    mask = mass_before >= p[:, None]
    mask[:, 0] = False  # always keep the most likely token
    sorted_logits = sorted_logits.masked_fill(mask, float("-inf"))
    return torch.empty_like(logits).scatter_(-1, order, sorted_logits)


__all__ = ["NO_TOKEN", "Sampler", "SampleLogprobs", "top_logprobs"]
