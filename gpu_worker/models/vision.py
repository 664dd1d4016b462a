"""The image path of a vision-language model: a vision tower and the projector that maps
its features onto the text model's embedding space (``VisionSpec``).

LLaVA: op for op as HF's ``CLIPVisionModel`` and ``LlavaMultiModalProjector`` (conv
patches + CLS + learned positions, ``pre_layrnorm``, pre-LN encoder layers with biased
q/k/v/out and SDPA attention, the tower's activation). Gemma 3: as HF's
``SiglipVisionModel`` (biased conv patches + learned positions, no class token, the same
encoder layers, ``post_layernorm``) and ``Gemma3MultiModalProjector`` (the patch grid
average-pooled to ``mm_tokens`` tokens, Gemma's ``1 + w`` RMS norm, one matrix). Both run
in the model's dtype. The tower is small
next to the text model, so every tensor-parallel rank holds all of it (plain
``nn.Linear``s, replicated): each rank computes the same embeddings and splices them into
its own copy of the step's input embeddings. One image is encoded at a time, alone, so
its embeddings never depend on what else is in the step (the deterministic mode's promise)
and are computed once per image (``gpu_worker/image_cache.py`` keeps them). Qwen2-VL's
and Qwen2.5-VL's tower, whose images come in any size, is ``qwen2_vl_vision.py``; every
image path answers the cache's ``input_problem`` and ``embed``.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from gpu_worker.architectures.hf_config import VisionSpec
from gpu_worker.models.qwen2_vl_vision import QwenVision
from gpu_worker.models.tower_activation import MLP, tower_activation
from protocol.ipc import ImageInput


class Embeddings(nn.Module):
    """CLIP's (a class token first, bias-free patches) or, ``siglip``, SigLIP's (biased
    patches, no class token)."""

    def __init__(self, v: VisionSpec, siglip: bool = False) -> None:
        super().__init__()
        self.siglip = siglip
        if not siglip:
            self.class_embedding = nn.Parameter(torch.empty(v.hidden_size))
        self.patch_embedding = nn.Conv2d(v.num_channels, v.hidden_size, kernel_size=v.patch_size,
                                         stride=v.patch_size, bias=siglip)
        self.position_embedding = nn.Embedding((v.image_size // v.patch_size) ** 2 + (not siglip),
                                               v.hidden_size)

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        patches = self.patch_embedding(pixels.to(self.patch_embedding.weight.dtype))
        patches = patches.flatten(2).transpose(1, 2)
        if self.siglip:
            return patches + self.position_embedding.weight
        cls = self.class_embedding.expand(pixels.shape[0], 1, -1)
        return torch.cat([cls, patches], dim=1) + self.position_embedding.weight


class SelfAttention(nn.Module):
    def __init__(self, v: VisionSpec) -> None:
        super().__init__()
        d = v.hidden_size
        self.heads, self.head_dim = v.num_heads, d // v.num_heads
        self.q_proj, self.k_proj = nn.Linear(d, d), nn.Linear(d, d)
        self.v_proj, self.out_proj = nn.Linear(d, d), nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, _ = x.shape
        shape = (b, n, self.heads, self.head_dim)
        q = self.q_proj(x).view(shape).transpose(1, 2)
        k = self.k_proj(x).view(shape).transpose(1, 2)
        v = self.v_proj(x).view(shape).transpose(1, 2)
        out = F.scaled_dot_product_attention(q, k, v, scale=self.head_dim**-0.5)
        return self.out_proj(out.transpose(1, 2).reshape(b, n, -1))


class EncoderLayer(nn.Module):
    def __init__(self, v: VisionSpec) -> None:
        super().__init__()
        self.self_attn = SelfAttention(v)
        self.layer_norm1 = nn.LayerNorm(v.hidden_size, eps=v.layer_norm_eps)
        self.mlp = MLP(v)
        self.layer_norm2 = nn.LayerNorm(v.hidden_size, eps=v.layer_norm_eps)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.layer_norm1(x))
        return x + self.mlp(self.layer_norm2(x))


class Encoder(nn.Module):
    def __init__(self, v: VisionSpec) -> None:
        super().__init__()
        self.layers = nn.ModuleList(EncoderLayer(v) for _ in range(v.layers_run))


class ClipVisionTower(nn.Module):
    """Only the layers the features are read from are built (and loaded)."""

    def __init__(self, v: VisionSpec) -> None:
        super().__init__()
        self.embeddings = Embeddings(v)
        self.pre_layrnorm = nn.LayerNorm(v.hidden_size, eps=v.layer_norm_eps)  # (HF's spelling)
        self.encoder = Encoder(v)
        self.feature_layers = v.feature_layers

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        """The hidden states at ``feature_layers`` (0: after ``pre_layrnorm``), concatenated
        along the channels: [images, 1 + patches, hidden * len(feature_layers)]."""
        x = self.pre_layrnorm(self.embeddings(pixels))
        states = [x]
        for layer in self.encoder.layers:
            x = layer(x)
            states.append(x)
        picked = [states[k] for k in self.feature_layers]
        return picked[0] if len(picked) == 1 else torch.cat(picked, dim=-1)


class Projector(nn.Module):
    def __init__(self, v: VisionSpec, text_hidden: int) -> None:
        super().__init__()
        self.linear_1 = nn.Linear(v.hidden_size * len(v.feature_layers), text_hidden,
                                  bias=v.projector_bias)
        self.act = tower_activation(v.projector_act)
        self.linear_2 = nn.Linear(text_hidden, text_hidden, bias=v.projector_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_2(self.act(self.linear_1(x)))


class FixedSizeVision(nn.Module):
    """An image path whose images all have the tower's one size and give
    ``spec.tokens_per_image`` embeddings (LLaVA, Gemma 3): what ``ImageCache`` asks of an
    image path (``input_problem``, ``embed``), over ``forward`` [images, C, H, W]."""

    spec: VisionSpec

    @property
    def pixel_shape(self) -> list[int]:
        v = self.spec
        return [v.num_channels, v.image_size, v.image_size]

    def input_problem(self, im: ImageInput) -> str | None:
        if im.length != self.spec.tokens_per_image:
            return (f"an image spans {im.length} positions; this model gives one "
                    f"{self.spec.tokens_per_image} embeddings")
        if im.shape != self.pixel_shape or im.dtype != "float32":
            return (f"image pixels of shape {im.shape} ({im.dtype}); this model's tower takes "
                    f"{self.pixel_shape} float32")
        return None

    def embed(self, pixels: torch.Tensor, im: ImageInput) -> torch.Tensor:
        return self(pixels.unsqueeze(0))[0]


class LlavaVision(FixedSizeVision):
    """pixels [images, channels, H, W] -> embeddings [images, tokens_per_image, text hidden]."""

    def __init__(self, v: VisionSpec, text_hidden: int) -> None:
        super().__init__()
        self.spec = v
        self.tower = ClipVisionTower(v)
        self.projector = Projector(v, text_hidden)

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        features = self.tower(pixels)
        if self.spec.drop_cls:
            features = features[:, 1:]
        return self.projector(features)


class SiglipVisionTower(nn.Module):
    """SigLIP's tower as Gemma 3 runs it: every layer, then ``post_layernorm`` (HF's
    ``last_hidden_state``); [images, patches, hidden]."""

    def __init__(self, v: VisionSpec) -> None:
        super().__init__()
        self.embeddings = Embeddings(v, siglip=True)
        self.encoder = Encoder(v)
        self.post_layernorm = nn.LayerNorm(v.hidden_size, eps=v.layer_norm_eps)

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        x = self.embeddings(pixels)
        for layer in self.encoder.layers:
            x = layer(x)
        return self.post_layernorm(x)


class Gemma3Projector(nn.Module):
    """The patch grid average-pooled to ``mm_tokens`` (a square), Gemma's zero-centred RMS
    norm (``x * (1 + w)`` in float32, eps the tower's), then one matrix
    ``mm_input_projection_weight`` [vision hidden, text hidden]."""

    def __init__(self, v: VisionSpec, text_hidden: int) -> None:
        super().__init__()
        self.side = v.image_size // v.patch_size
        self.kernel = self.side // math.isqrt(v.mm_tokens)
        self.eps = v.layer_norm_eps
        self.mm_soft_emb_norm = nn.Module()
        self.mm_soft_emb_norm.weight = nn.Parameter(torch.empty(v.hidden_size))
        self.mm_input_projection_weight = nn.Parameter(torch.empty(v.hidden_size, text_hidden))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, _, d = x.shape
        grid = x.transpose(1, 2).reshape(b, d, self.side, self.side).contiguous()
        pooled = F.avg_pool2d(grid, self.kernel, self.kernel).flatten(2).transpose(1, 2)
        f = pooled.float()
        normed = f * torch.rsqrt(f.pow(2).mean(-1, keepdim=True) + self.eps)
        normed = (normed * (1.0 + self.mm_soft_emb_norm.weight.float())).type_as(pooled)
        return torch.matmul(normed, self.mm_input_projection_weight).type_as(x)


class Gemma3Vision(FixedSizeVision):
    """pixels [images, channels, H, W] -> embeddings [images, mm_tokens, text hidden]."""

    def __init__(self, v: VisionSpec, text_hidden: int) -> None:
        super().__init__()
        self.spec = v
        self.tower = SiglipVisionTower(v)
        self.projector = Gemma3Projector(v, text_hidden)

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        return self.projector(self.tower(pixels))


def build_vision(v: VisionSpec, text_hidden: int) -> nn.Module:
    """The image path ``v.family`` names."""
    if v.family in ("qwen2_vl", "qwen2_5_vl"):
        return QwenVision(v, text_hidden)
    return Gemma3Vision(v, text_hidden) if v.family == "gemma3" else LlavaVision(v, text_hidden)
