"""A vision tower's activation by its HF config name (CLIP's quick_gelu, SigLIP's
gelu_tanh, Qwen2-VL's tower) and the fc1 / act / fc2 MLP they share: one of each for
every tower module."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from gpu_worker.architectures.hf_config import VisionSpec


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


class MLP(nn.Module):
    def __init__(self, v: VisionSpec) -> None:
        super().__init__()
        self.act = tower_activation(v.act)
        self.fc1 = nn.Linear(v.hidden_size, v.intermediate_size)
        self.fc2 = nn.Linear(v.intermediate_size, v.hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))
