"""Backend selection: CPU (and CUDA without flashinfer) uses the torch path, and the
flashinfer module imports without CUDA or flashinfer installed. Every backend of the
registry's table loads under its name, and selection takes the first that serves."""

import pytest
import torch

from gpu_worker.attention import flashinfer_backend
from gpu_worker.attention.base import AttentionBackend, AttentionSpec
from gpu_worker.attention.registry import BACKENDS, backend_class, select_backend


def _spec(dtype=torch.float32, device="cpu", **kinds) -> AttentionSpec:
    return AttentionSpec(4, 2, 16, 16, dtype, torch.device(device), 16**-0.5, **kinds)


def test_cpu_selects_the_torch_path_and_flashinfer_module_imports_lazily():
    assert select_backend(_spec()).name in ("cpu_kernel", "torch")
    assert flashinfer_backend.available(torch.device("cpu")) is False


def test_every_registered_backend_loads_under_its_name():
    for name in BACKENDS:
        cls = backend_class(name)
        assert issubclass(cls, AttentionBackend) and cls.name == name
    with pytest.raises(ValueError, match="unknown attention backend 'nope'"):
        backend_class("nope")


def test_selection_skips_what_cannot_serve_and_says_why(monkeypatch, caplog):
    caplog.set_level("INFO", logger="gpu_worker.attention.registry")
    monkeypatch.setenv("CANDOR_CPU_DECODE_KERNEL", "0")
    assert select_backend(_spec()).name == "torch"
    assert "CANDOR_CPU_DECODE_KERNEL=0" in caplog.text and "not a CUDA device" in caplog.text
    assert select_backend(_spec(torch.bfloat16), ["cpu_kernel", "torch"]).name == "torch"
    with pytest.raises(ValueError, match="flashinfer: not a CUDA device"):
        select_backend(_spec(), ["flashinfer"])


def test_a_backend_failing_its_check_is_skipped_with_a_warning(monkeypatch, caplog):
    from gpu_worker.attention import cpu_kernel_backend

    monkeypatch.setattr(cpu_kernel_backend, "load", lambda: None)  # as where no compiler exists
    assert select_backend(_spec()).name == "torch"
    warned = [r for r in caplog.records if r.levelname == "WARNING"]
    assert warned and "could not be built" in warned[0].getMessage()


def test_a_batch_invariant_spec_is_served_only_by_a_backend_that_declares_it(monkeypatch):
    """The deterministic mode asks the registry for batch invariance: the torch backend
    (SDPA splits keys as the chunk does) declines it, the CPU kernel serves it, and where
    no backend can the selection fails, naming each reason."""
    spec = _spec(batch_invariant=True)
    assert not backend_class("torch").batch_invariant and backend_class("cpu_kernel").batch_invariant
    if cpu_kernel_load_ok():
        assert select_backend(spec).name == "cpu_kernel"
    monkeypatch.setenv("CANDOR_CPU_DECODE_KERNEL", "0")
    with pytest.raises(ValueError, match="torch: not batch-invariant"):
        select_backend(spec)
    assert select_backend(_spec()).name == "torch"


def cpu_kernel_load_ok() -> bool:
    from gpu_worker.attention import cpu_kernel_backend

    return cpu_kernel_backend.load() is not None
