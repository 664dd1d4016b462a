"""Qwen2-VL's and Qwen2.5-VL's vision tower, op for op as HF's
``Qwen2VisionTransformerPretrainedModel`` / ``Qwen2_5_VisionTransformerPretrainedModel``,
for one image at a time (``ImageCache`` encodes each alone, so its embeddings never depend
on what else is in the step).

An image arrives as HF's image processor leaves it: its patches flattened to rows of
``channels x temporal_patch_size x patch x patch`` values, ordered so that each
``merge_size x merge_size`` block of neighbouring patches is consecutive, and its
``ImageInput.grid`` (the text model's token grid, one token per block). The tower embeds
each patch (a Conv3d whose kernel is the patch: one matmul), rotates q and k by the patch's
(row, column) (2-D rotary: half the rotary frequencies take the row, half the column), runs
pre-norm blocks whose attention spans the image (Qwen2.5-VL: only the patch's window, except
in ``full_attention_blocks``), and the merger maps each block's norm'd patches, concatenated,
through a two-layer GELU MLP to one text embedding.

Qwen2-VL's blocks: LayerNorm, ``fc1 -> act -> fc2``; Qwen2.5-VL's: RMSNorm, a gated MLP
(``down(act(gate(x)) * up(x))``, biased), and its patches reordered window by window before
the first block (and the merged tokens put back after the merger), as HF does.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from gpu_worker.architectures.hf_config import VisionSpec
from gpu_worker.models.tower_activation import MLP, tower_activation
from protocol.ipc import ImageInput


class _RMSNorm(nn.Module):
    """Qwen2's RMS norm: in float32, then ``weight * x`` in the input's dtype."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        f = x.float()
        f = f * torch.rsqrt(f.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * f.to(x.dtype)


def _norm(v: VisionSpec, dim: int) -> nn.Module:
    return (_RMSNorm(dim, v.layer_norm_eps) if v.family == "qwen2_5_vl"
            else nn.LayerNorm(dim, eps=v.layer_norm_eps))


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class PatchEmbed(nn.Module):
    def __init__(self, v: VisionSpec) -> None:
        super().__init__()
        self.shape = (v.num_channels, v.temporal_patch_size, v.patch_size, v.patch_size)
        self.proj = nn.Conv3d(v.num_channels, v.hidden_size, kernel_size=self.shape[1:],
                              stride=self.shape[1:], bias=False)

    def forward(self, patches: torch.Tensor) -> torch.Tensor:
        x = patches.view(-1, *self.shape).to(self.proj.weight.dtype)
        return self.proj(x).view(x.shape[0], -1)


class Attention(nn.Module):
    def __init__(self, v: VisionSpec) -> None:
        super().__init__()
        self.heads, self.head_dim = v.num_heads, v.hidden_size // v.num_heads
        self.qkv = nn.Linear(v.hidden_size, 3 * v.hidden_size)
        self.proj = nn.Linear(v.hidden_size, v.hidden_size)

    def forward(self, x: torch.Tensor, cos_sin: tuple[torch.Tensor, torch.Tensor],
                segments: list[int]) -> torch.Tensor:
        """``segments``: the lengths of the runs of rows that attend each other (one: the
        whole image; Qwen2.5-VL's windowed blocks: one per window)."""
        n = x.shape[0]
        q, k, v = self.qkv(x).view(n, 3, self.heads, self.head_dim).unbind(1)
        cos, sin = cos_sin  # [n, 1, head_dim], float32
        q = (q.float() * cos + _rotate_half(q.float()) * sin).to(x.dtype)
        k = (k.float() * cos + _rotate_half(k.float()) * sin).to(x.dtype)
        q, k, v = (t.transpose(0, 1).unsqueeze(0) for t in (q, k, v))  # [1, heads, n, d]
        outs = [F.scaled_dot_product_attention(qs, ks, vs, scale=self.head_dim**-0.5)
                for qs, ks, vs in zip(q.split(segments, 2), k.split(segments, 2), v.split(segments, 2))]
        out = torch.cat(outs, dim=2)[0].transpose(0, 1).reshape(n, -1)
        return self.proj(out)


class GatedMLP(nn.Module):
    def __init__(self, v: VisionSpec) -> None:
        super().__init__()
        self.act = tower_activation(v.act)
        self.gate_proj = nn.Linear(v.hidden_size, v.intermediate_size)
        self.up_proj = nn.Linear(v.hidden_size, v.intermediate_size)
        self.down_proj = nn.Linear(v.intermediate_size, v.hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))


class Block(nn.Module):
    def __init__(self, v: VisionSpec) -> None:
        super().__init__()
        self.norm1, self.norm2 = _norm(v, v.hidden_size), _norm(v, v.hidden_size)
        self.attn = Attention(v)
        self.mlp = GatedMLP(v) if v.family == "qwen2_5_vl" else MLP(v)

    def forward(self, x, cos_sin, segments):
        x = x + self.attn(self.norm1(x), cos_sin, segments)
        return x + self.mlp(self.norm2(x))


class Merger(nn.Module):
    """Each merge block's patches, norm'd and concatenated, to one text embedding."""

    def __init__(self, v: VisionSpec, text_hidden: int) -> None:
        super().__init__()
        self.width = v.hidden_size * v.merge_size**2
        self.ln_q = _norm(v, v.hidden_size)
        self.mlp = nn.Sequential(nn.Linear(self.width, self.width), nn.GELU(),
                                 nn.Linear(self.width, text_hidden))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.mlp(self.ln_q(x).view(-1, self.width))


class QwenVision(nn.Module):
    """One image's patches [patches, patch values] and token grid -> its embeddings
    [tokens, text hidden]; parameter names as HF's ``visual.*``."""

    def __init__(self, v: VisionSpec, text_hidden: int) -> None:
        super().__init__()
        self.spec = v
        self.patch_embed = PatchEmbed(v)
        self.blocks = nn.ModuleList(Block(v) for _ in range(v.layers_run))
        self.merger = Merger(v, text_hidden)
        spatial = (v.hidden_size // v.num_heads) // 2
        with torch.device("cpu"):  # (computed on CPU even while the model is built on meta)
            self.inv_freq = 1.0 / (v.rope_theta ** (torch.arange(0, spatial, 2, dtype=torch.float32) / spatial))
        self.patch_values = v.num_channels * v.temporal_patch_size * v.patch_size**2

    def input_problem(self, im: ImageInput) -> str | None:
        """Why ``im`` cannot be encoded (None: it can): a token grid its span and pixels
        do not match."""
        if len(im.grid) != 3 or im.grid[0] != 1 or min(im.grid) < 1:
            return f"an image's token grid {im.grid} is not [1, rows, columns]"
        tokens = im.grid[1] * im.grid[2]
        if im.length != tokens:
            return f"an image spans {im.length} positions; its {im.grid} grid gives {tokens}"
        want = [tokens * self.spec.merge_size**2, self.patch_values]
        if im.shape != want or im.dtype != "float32":
            return f"image pixels of shape {im.shape} ({im.dtype}); its grid needs {want} float32"
        return None

    def embed(self, patches: torch.Tensor, im: ImageInput) -> torch.Tensor:
        m = self.spec.merge_size
        rows, cols = im.grid[1], im.grid[2]
        x = self.patch_embed(patches)
        cos_sin = self._rotary(rows * m, cols * m, x.device)
        whole = [x.shape[0]]
        windowed = order = None
        if self.spec.family == "qwen2_5_vl":
            order, windowed = self._windows(rows, cols, x.device)
            x = self._by_token(x, order)
            cos_sin = tuple(self._by_token(t, order) for t in cos_sin)
        for i, block in enumerate(self.blocks):
            full = windowed is None or i in self.spec.full_attention_blocks
            x = block(x, cos_sin, whole if full else windowed)
        out = self.merger(x)
        if order is not None:
            out = out[torch.argsort(order)]
        return out

    def _by_token(self, rows: torch.Tensor, order: torch.Tensor) -> torch.Tensor:
        """Patch rows regrouped token by token in ``order`` (a token's m x m patches stay
        together, as the merger reads them)."""
        group = self.spec.merge_size**2
        return rows.view(-1, group, *rows.shape[1:])[order].reshape(rows.shape)

    def _rotary(self, height: int, width: int, device) -> tuple[torch.Tensor, torch.Tensor]:
        """Each patch's (row, column) rotation, patches in the processor's block order:
        cos and sin [patches, 1, head_dim] in float32."""
        m = self.spec.merge_size
        r = torch.arange(height).view(height // m, m, 1, 1).expand(-1, -1, width // m, m)
        c = torch.arange(width).view(1, 1, width // m, m).expand(height // m, m, -1, -1)
        r, c = (t.transpose(1, 2).reshape(-1) for t in (r, c))
        inv = self.inv_freq
        freqs = torch.cat([r[:, None].float() * inv, c[:, None].float() * inv], dim=-1)
        emb = torch.cat([freqs, freqs], dim=-1)
        return emb.cos()[:, None].to(device), emb.sin()[:, None].to(device)

    def _windows(self, rows: int, cols: int, device) -> tuple[torch.Tensor, list[int]]:
        """Qwen2.5-VL's windows over the token grid: the tokens in window order (windows
        row by row, tokens row by row inside each) and each window's patch count."""
        v = self.spec
        side = v.window_size // v.merge_size // v.patch_size
        grid = torch.arange(rows * cols).view(rows, cols)
        order, sizes = [], []
        for top in range(0, rows, side):
            for left in range(0, cols, side):
                window = grid[top:top + side, left:left + side].reshape(-1)
                order.append(window)
                sizes.append(window.numel() * v.merge_size**2)
        return torch.cat(order).to(device), sizes
