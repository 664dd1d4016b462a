"""The attention backends, in order of preference, and the start-up choice among them.

``select_backend`` takes the first backend that can serve this rank's ``AttentionSpec``
(``unavailable``; a spec asking for batch invariance only those declaring it), builds it
and lets it check itself (``check``); the torch backend serves any spec but a
batch-invariant one, so the choice ends there unless the spec asks for that. Each skipped backend's reason is
logged: an expected one (a CPU is not a CUDA device) as info, a failure (a kernel that
did not build, a self-check that disagreed with SDPA) as a warning.

Backends are named as ``module:Class`` and imported only when considered, so a CPU-only
install never imports flashinfer's module, and naming one (``names=``) picks it.
"""

from __future__ import annotations

import importlib
import logging

from gpu_worker.attention.base import AttentionBackend, AttentionSpec

log = logging.getLogger(__name__)

BACKENDS: dict[str, str] = {
    "flashinfer": "gpu_worker.attention.flashinfer_backend:FlashInferBackend",
    "cpu_kernel": "gpu_worker.attention.cpu_kernel_backend:CpuKernelBackend",
    "torch": "gpu_worker.attention.torch_backend:TorchBackend",
    # encoders only (declines every causal spec; the others serve causal specs only)
    "bidirectional": "gpu_worker.attention.bidirectional:BidirectionalBackend",
}


def backend_class(name: str) -> type[AttentionBackend]:
    if name not in BACKENDS:
        raise ValueError(f"unknown attention backend {name!r} (known: {', '.join(BACKENDS)})")
    module, cls = BACKENDS[name].split(":")
    return getattr(importlib.import_module(module), cls)


def select_backend(spec: AttentionSpec, names: list[str] | None = None) -> AttentionBackend:
    """The first of ``names`` (default: every backend, in the table's order) that serves
    ``spec``; the reasons the others did not are logged."""
    declined: list[str] = []
    failed = False
    for name in names or list(BACKENDS):
        cls = backend_class(name)
        reason = "not batch-invariant" if spec.batch_invariant and not cls.batch_invariant else None
        if spec.image_spans and not cls.spans:
            reason = reason or "cannot attend an image's tokens both ways (Gemma 3)"
        reason = reason or cls.unavailable(spec)
        if reason is None:
            try:
                backend = cls(spec)
                reason = backend.check()
            except Exception as exc:  # a JIT build failure, an unsupported GPU, API drift
                reason = f"failed at start-up: {type(exc).__name__}: {exc}"
            failed = failed or reason is not None
        if reason is None:
            skipped = f" (skipped {'; '.join(declined)})" if declined else ""
            log.log(logging.WARNING if failed else logging.INFO, "attention: %s on %s%s",
                    name, spec.device, skipped)
            return backend
        declined.append(f"{name}: {reason}")
    raise ValueError(f"no attention backend serves this model: {'; '.join(declined)}")
