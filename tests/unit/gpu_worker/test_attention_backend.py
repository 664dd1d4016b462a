"""Backend selection: CPU (and CUDA without flashinfer) uses the torch path, and the
flashinfer module imports without CUDA or flashinfer installed. Every backend of the
registry's table loads under its name, and selection takes the first that serves."""

import inspect

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


def test_every_backend_takes_the_base_build_signature():
    """The runner calls ``build`` the one way the base declares (an override that missed a
    new keyword, ``spans``, failed every encoder step once the image spans arrived)."""
    want = inspect.signature(AttentionBackend.build)
    for name in BACKENDS:
        got = inspect.signature(backend_class(name).build)
        assert list(got.parameters) == list(want.parameters), name


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


def test_an_image_spans_spec_is_served_only_by_a_backend_that_honours_spans(monkeypatch):
    """Gemma 3's bidirectional image spans: flashinfer (no such mask) declines them, so
    on CUDA the torch path serves; on CPU the kernel and the torch path both do."""
    assert backend_class("torch").spans and backend_class("cpu_kernel").spans
    assert not backend_class("flashinfer").spans
    with pytest.raises(ValueError, match="flashinfer: cannot attend an image's tokens both ways"):
        select_backend(_spec(image_spans=True), ["flashinfer"])
    monkeypatch.setenv("CANDOR_CPU_DECODE_KERNEL", "0")
    assert select_backend(_spec(image_spans=True)).name == "torch"


def _reference(q, k, v, spans, window, scale):
    """HF Gemma 3's mask written out per pair: key j for query i when (j <= i or both in one
    span) and j > i - window; eager softmax in float64."""
    n = q.shape[0]
    allow = torch.zeros(n, n, dtype=torch.bool)
    for i in range(n):
        for j in range(n):
            same = any(lo <= i < hi and lo <= j < hi for lo, hi in spans)
            allow[i, j] = (j <= i or same) and (window is None or j > i - window)
    rep = q.shape[1] // k.shape[1]
    kk, vv = k.repeat_interleave(rep, 1).double(), v.repeat_interleave(rep, 1).double()
    scores = torch.einsum("ihd,jhd->hij", q.double(), kk) * scale
    scores = scores.masked_fill(~allow, float("-inf"))
    return torch.einsum("hij,jhd->ihd", scores.softmax(-1), vv).float()


@pytest.mark.parametrize("window", [None, 5])
@pytest.mark.parametrize("name,invariant", [("torch", False), ("cpu_kernel", False),
                                            ("cpu_kernel", True)])
def test_bidirectional_spans_match_the_reference_mask_and_chunks(name, invariant, window):
    """One 20-token prompt with spans 6..9 and 12..15, prefilled whole and in two chunks
    (0..10, 11..19: spans inside chunks), beside another sequence in the same step; the
    rows equal the reference mask's; the batch-invariant path's are the same bits either
    way."""
    from gpu_worker.attention.cpu_kernel_backend import load

    if name == "cpu_kernel" and load() is None:
        pytest.skip("the CPU kernel cannot be built here")
    spec = _spec(image_spans=True, batch_invariant=invariant,
                 layer_kinds=((window, None),))
    backend = backend_class(name)(spec)
    gen = torch.Generator().manual_seed(0)
    n, spans = 20, [(6, 10), (12, 16)]
    q, k, v = (torch.randn(n, h, 16, generator=gen) for h in (4, 2, 2))
    want = _reference(q, k, v, spans, window, spec.scale)
    outs = []
    for pieces in ([(0, 20)], [(0, 11), (11, 20)]):
        cache = [torch.zeros(8, 16, 2, 16) for _ in range(2)]
        table = [0, 1]
        got = torch.empty_like(q)
        for lo, hi in pieces:
            other = (3, 5, [4])  # another sequence's prefill beside it
            ko, vo = torch.randn(5, 2, 16, generator=gen), torch.randn(5, 2, 16, generator=gen)
            qo = torch.randn(5, 4, 16, generator=gen)
            inside = [(a, b) for a, b in spans if lo <= a and b <= hi]
            meta = backend.build([other, (lo, hi - lo, table)], 0, spans={1: inside})
            out = meta.attend(torch.cat([qo, q[lo:hi]]), torch.cat([ko, k[lo:hi]]), torch.cat([vo, v[lo:hi]]),
                              cache[0], cache[1], window)
            got[lo:hi] = out[5:]
        assert torch.allclose(got, want, atol=1e-5), (got - want).abs().max()
        outs.append(got)
    if invariant:
        assert torch.equal(outs[0], outs[1])


def test_a_span_outside_its_chunk_is_refused():
    backend = backend_class("torch")(_spec(image_spans=True))
    with pytest.raises(ValueError, match="not inside prefill chunk 0"):
        backend.build([(0, 8, [0])], 0, spans={0: [(6, 10)]})
