"""Building blocks the decoder switches between: norms, activations, RoPE tables.

Numerics follow HF's classes op for op (fp32 norm statistics, fp32 RoPE tables, the same
order of multiplications) so greedy decoding matches transformers token for token.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from gpu_worker.model_config import ModelConfig, RopeConfig, rope_attention_factor
from gpu_worker.models import row_ops


class RMSNorm(nn.Module):
    """Llama's ``w * norm(x)``; ``one_plus`` is Gemma's ``norm(x) * (1 + w)`` in fp32."""

    def __init__(self, size: int, eps: float, one_plus: bool = False) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps, self.one_plus = eps, one_plus

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.one_plus:
            x32 = x.float()
            x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
            return (x32 * (1.0 + self.weight.float())).type_as(x)
        if x.dtype == torch.float32:
            if x.dim() in (2, 3) and x.stride(-1) == 1 and row_ops.applies(x):  # one call, not ~10
                return row_ops.load().rms_norm(x, self.weight, self.eps).view(x.shape)
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)  # the HF form's bits

        dtype = x.dtype
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(dtype)


def add_then_norm(norm: nn.Module, x: torch.Tensor, h: torch.Tensor, scale: float) -> torch.Tensor:
    """``x += h * scale`` in place (``x``: the residual stream, this step's own), then
    ``norm(x)``: a single kernel call for a plain fp32 RMS norm on CPU (the same bits)."""
    if (type(norm) is RMSNorm and not norm.one_plus and x.dim() == 2 and x.is_contiguous()
            and h.stride(-1) == 1 and row_ops.applies(x)):
        return row_ops.load().add_rms_norm(x, h, scale, norm.weight, norm.eps)
    x.add_(h if scale == 1.0 else h.mul_(scale))
    return norm(x)


def make_norm(cfg: ModelConfig, size: int | None = None) -> nn.Module:
    size = cfg.hidden_size if size is None else size
    if cfg.norm == "layer":
        return nn.LayerNorm(size, eps=cfg.rms_norm_eps)
    return RMSNorm(size, cfg.rms_norm_eps, one_plus=cfg.norm == "rms_1p")


def activation(name: str):
    if name == "silu":
        return F.silu
    if name == "gelu":
        return F.gelu
    if name == "gelu_tanh":
        return lambda x: F.gelu(x, approximate="tanh")
    raise ValueError(f"unknown activation {name!r}")


def rope_inv_freq(head_dim: int, rope: RopeConfig, max_positions: int, long: bool = False) -> torch.Tensor:
    """Inverse frequencies, computed exactly as HF does (same fp32 ops, same order).
    ``long``: longrope's long factors (positions past the original context)."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
    inv_freq = 1.0 / (rope.theta**exponents)
    if rope.type == "linear":
        inv_freq = inv_freq / rope.factor
    elif rope.type == "llama3":
        old_len = rope.original_max_position_embeddings
        low_freq_wavelen = old_len / rope.low_freq_factor
        high_freq_wavelen = old_len / rope.high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / rope.factor, inv_freq)
        smooth = (old_len / wavelen - rope.low_freq_factor) / (rope.high_freq_factor - rope.low_freq_factor)
        smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
        is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
        inv_freq = torch.where(is_medium, smoothed, scaled)
    elif rope.type == "yarn":
        inv_freq = _yarn_inv_freq(head_dim, rope, max_positions)
    elif rope.type == "longrope":
        factors = torch.tensor(rope.long_factor if long else rope.short_factor, dtype=torch.float32)
        inv_freq = 1.0 / (factors * rope.theta**exponents)
    # "default" and "dynamic" (identical below max_position_embeddings) need nothing.
    return inv_freq


def _yarn_inv_freq(dim: int, rope: RopeConfig, max_positions: int) -> torch.Tensor:
    factor = rope.factor if rope.factor_given else max_positions / rope.original_max_position_embeddings
    orig = rope.original_max_position_embeddings

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(orig / (rotations * 2 * math.pi))) / (2 * math.log(rope.theta))

    low, high = correction_dim(rope.beta_fast), correction_dim(rope.beta_slow)
    if rope.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    pos_freqs = rope.theta ** (torch.arange(0, dim, 2).float() / dim)
    extrapolation = 1.0 / pos_freqs
    interpolation = 1.0 / (factor * pos_freqs)
    keep = 1 - ramp
    return interpolation * (1 - keep) + extrapolation * keep


class RotaryEmbedding:
    """Precomputed cos/sin tables for positions [0, max_positions), indexed per token.

    yarn and longrope scale cos and sin by their attention factor (as HF). longrope uses
    its short factors below the original context and its long ones from there on (vLLM's
    choice; HF switches a whole forward pass once the sequence passes it, so the two agree
    whenever the prompt fits the original context)."""

    def __init__(self, head_dim: int, rope: RopeConfig, max_positions: int, device, dtype,
                 config_max_positions: int | None = None) -> None:
        config_max = config_max_positions or max_positions
        with torch.device("cpu"):  # computed on CPU even while the model is built on meta
            pos = torch.arange(max_positions, dtype=torch.float32)[:, None]
            freqs = pos * rope_inv_freq(head_dim, rope, config_max)[None, :]
            if rope.type == "longrope" and max_positions > rope.original_max_position_embeddings:
                start = rope.original_max_position_embeddings
                freqs[start:] = pos[start:] * rope_inv_freq(head_dim, rope, config_max, long=True)[None, :]
            emb = torch.cat((freqs, freqs), dim=-1)
            scale = rope_attention_factor(rope, config_max)
            cos, sin = emb.cos(), emb.sin()
            if scale != 1.0:
                cos, sin = cos * scale, sin * scale
        self.cos = cos.to(device=device, dtype=dtype)
        self.sin = sin.to(device=device, dtype=dtype)
        # M-RoPE: which of the (temporal, height, width) positions each column rotates by
        # (column j is frequency j mod head_dim / 2; mrope_section counts them in order)
        self.section = None
        if rope.mrope_section:
            per_freq = [k for k, n in enumerate(rope.mrope_section) for _ in range(n)]
            self.section = torch.tensor(per_freq + per_freq, device="cpu").to(device)

    def tables(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """This step's [num_tokens, 1, head_dim] cos and sin, looked up once for all layers.
        ``positions`` [3, num_tokens] (M-RoPE: each token's temporal, height and width
        position): each column from the position its section names (as HF's Qwen2-VL; a
        token whose three positions agree gets the plain table's row)."""
        if positions.dim() == 1:
            return self.cos[positions].unsqueeze(1), self.sin[positions].unsqueeze(1)
        pick = self.section.view(1, 1, -1).expand(1, positions.shape[1], -1)
        return (self.cos[positions].gather(0, pick)[0].unsqueeze(1),
                self.sin[positions].gather(0, pick)[0].unsqueeze(1))

    @staticmethod
    def rotate(x: torch.Tensor, cos_sin: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        """x: [num_tokens, heads, head_dim] rotated by each token's position (a new,
        contiguous tensor where the CPU kernel computes it: the same bits, one call)."""
        cos, sin = cos_sin
        if x.stride(-1) == 1 and row_ops.applies(x):
            return row_ops.load().rope(x, cos, sin)
        half = x.shape[-1] // 2
        rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
        return x * cos + rotated * sin
