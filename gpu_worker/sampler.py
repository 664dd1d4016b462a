"""Token sampling for one step: greedy, temperature, top-k, top-p, per-request seeds.

Filtering is vectorised over rows. Drawing uses the exponential race
(argmax p_i / E_i with E_i ~ Exp(1), equivalent to sampling from p), so a row's draw
consumes a fixed amount of randomness from its own generator regardless of what else is
in the batch: a seeded request reproduces its tokens alone or batched.
"""

from __future__ import annotations

import torch

from protocol.ipc import SamplingParams


class Sampler:
    def __init__(self, device: torch.device | str = "cpu", seed: int = 0) -> None:
        self.device = torch.device(device)
        # Shared by every unseeded request.
        self.generator = torch.Generator(device=self.device).manual_seed(seed)

    def __call__(
        self,
        logits: torch.Tensor,
        params: list[SamplingParams],
        generators: list[torch.Generator | None],
    ) -> list[int]:
        """logits: [rows, vocab]. ``generators[i]`` is row i's own generator, or None."""
        tokens = logits.argmax(dim=-1)
        rand_rows = [i for i, p in enumerate(params) if p.temperature > 0]
        if rand_rows:
            sub = [params[i] for i in rand_rows]
            probs = self._probs(logits[rand_rows].float(), sub)
            tokens[rand_rows] = self._draw(probs, [generators[i] for i in rand_rows])
        return tokens.tolist()

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
        return torch.softmax(logits, dim=-1)

    def _draw(self, probs: torch.Tensor, generators: list[torch.Generator | None]) -> torch.Tensor:
        noise = torch.empty_like(probs)
        shared = [i for i, g in enumerate(generators) if g is None]
        if shared:
            noise[shared] = torch.empty(len(shared), probs.shape[1], device=probs.device).exponential_(
                generator=self.generator
            )
        for i, g in enumerate(generators):
            if g is not None:
                noise[i].exponential_(generator=g)
        # An exact 0 draw would turn a filtered-out p=0 into 0/0 = NaN, which argmax picks.
        noise.clamp_(min=torch.finfo(noise.dtype).tiny)
        return (probs / noise).argmax(dim=-1)


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
