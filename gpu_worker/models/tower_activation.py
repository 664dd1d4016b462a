"""A vision tower's activation by its HF config name (CLIP's quick_gelu, SigLIP's
gelu_tanh, Qwen2-VL's tower): one table for every tower module."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def tower_activation(name: str):
    if name == "quick_gelu":  # HF's QuickGELUActivation
        return lambda x: x * torch.sigmoid(1.702 * x)
    if name == "gelu":
        return F.gelu
    if name == "gelu_tanh":
        return lambda x: F.gelu(x, approximate="tanh")
    if name == "silu":
        return F.silu
    raise ValueError(f"unknown activation {name!r}")
