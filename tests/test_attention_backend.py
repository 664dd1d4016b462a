"""Backend selection: CPU (and CUDA without flashinfer) uses the torch path, and the
flashinfer module imports without CUDA or flashinfer installed."""

import torch

from gpu_worker import flashinfer_backend
from gpu_worker.attention import select_backend


def test_cpu_selects_the_torch_path_and_flashinfer_module_imports_lazily():
    assert select_backend(4, 2, 16, 16, torch.float32, torch.device("cpu")) is None
    assert flashinfer_backend.available(torch.device("cpu")) is False
