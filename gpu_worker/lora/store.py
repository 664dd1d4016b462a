"""The worker's adapters: which are registered, which are in host memory and which on
the device, which adapter each request uses, and this step's rows per adapter.

- **Registered** (id -> name, files): every adapter the scheduler may put in a plan. The
  scheduler numbers them (the ``--lora-modules`` first, 1..n, then runtime loads) and
  tells every rank of each load and drop on the plan socket, so a plan never names an
  adapter a rank has not registered.
- **Host cache** (``max_cpu_loras``, least recently used out): this rank's slice of the
  adapter, scaled and packed (``weights``). An evicted adapter is read again from its
  files when a step needs it.
- **Device** (``max_loras``, least recently used out): the copies the forward pass reads
  (on CPU, the host copy itself). The scheduler never puts more than ``max_loras``
  adapters in one step, so a step's adapters always fit.
- **Batch invariance**: in the deterministic mode each adapter has its delta's padded row
  count measured (``batch.measure_delta_rows``, at every thread count the governor may
  choose): the ``--lora-modules`` once the runner has settled the mode (``settle``), the
  others as they are read; one whose rows no padding makes independent of the batch is
  refused like any unreadable adapter.

Every rank runs the same messages in the same order, so their caches hold the same
adapters and they read files at the same points; whenever one reads (a registration, a
cache miss), the ranks exchange what went wrong (``Ranks.gather_texts``) and all succeed
or all fail, never some.
"""

from __future__ import annotations

import logging
import os
from collections import OrderedDict
from dataclasses import dataclass

import torch
from torch import nn

from cluster.topology import LoraSpec
from gpu_worker.batch_invariant import Numerics
from gpu_worker.distributed import Ranks
from gpu_worker.lora.batch import LoraBatch, attach_sites, measure_delta_rows
from gpu_worker.lora.peft_files import AdapterError, read_adapter
from gpu_worker.lora.weights import AdapterWeights, load_adapter
from gpu_worker.model_config import ModelConfig
from gpu_worker.thread_governor import usable_cpus
from protocol.ipc import SeqChunk, StepPlan

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Registered:
    name: str
    path: str


def inside(path: str, roots: list[str]) -> bool:
    """Whether ``path``, symlinks resolved, lies under one of ``roots`` (also resolved)."""
    real = os.path.realpath(path)
    return any(os.path.commonpath([real, os.path.realpath(root)]) == os.path.realpath(root)
               for root in roots)


class AdapterStore:
    def __init__(self, model: nn.Module, spec: LoraSpec, base: ModelConfig, dtype: torch.dtype,
                 device: torch.device, ranks: Ranks, numerics: Numerics) -> None:
        self.model, self.spec, self.base = model, spec, base
        self.dtype, self.device, self.ranks = dtype, device, ranks
        self.numerics = numerics
        self.batch = LoraBatch()
        attach_sites(model, self.batch)
        self.registered: dict[int, Registered] = {}
        self.host: OrderedDict[int, AdapterWeights] = OrderedDict()
        self.on_device: OrderedDict[int, AdapterWeights] = OrderedDict()
        self.of_request: dict[str, int] = {}  # rid -> adapter id (base-model rids absent)
        self.settled = False  # the runner settled its numerics: adapters read are measured
        for i, module in enumerate(spec.modules, start=1):
            self.register(i, module.name, module.resolved_path(), check_dirs=False)

    # ------------------------------------------------------------------ registry

    def _read(self, name: str, path: str, check_dirs: bool) -> AdapterWeights | None:
        """This rank's slice of the adapter at ``path``, agreed on by every rank; raises
        AdapterError (the first failing rank's reason) when any rank cannot read it."""
        weights, why = None, ""
        try:
            if check_dirs and not inside(path, self.spec.allowed_roots()):
                raise AdapterError(f"{path} is outside the directories runtime loads may read "
                                   f"({', '.join(self.spec.allowed_roots()) or 'none'})")
            layout = read_adapter(path, self.base, self.spec.max_lora_rank)
            weights = load_adapter(self.model, layout, self.dtype)
            if self.settled:
                self._measure(weights)
        except Exception as err:  # noqa: BLE001 - a rank that raised here would leave the others waiting
            why = " ".join(str(err).split()) or type(err).__name__
        self._agree(name, why)
        return weights

    def _agree(self, name: str, why: str) -> None:
        """Every rank says what went wrong for adapter ``name`` (nothing: ""); raises
        AdapterError with the first failing rank's reason when any failed."""
        reasons = self.ranks.gather_texts(why)
        failed = [(rank, text) for rank, text in enumerate(reasons) if text]
        if failed:
            rank, text = failed[0]
            where = f" (tensor-parallel rank {rank})" if self.ranks.size > 1 else ""
            raise AdapterError(f"LoRA adapter {name!r}: {text}{where}")

    def _measure(self, weights: AdapterWeights) -> None:
        """In the deterministic mode, the row count its row groups are padded to."""
        if not self.numerics.deterministic:
            return
        rows, why = measure_delta_rows(list(weights.pairs.values()),
                                       range(1, len(usable_cpus()) + 1))
        if rows is None:
            raise AdapterError(why)
        weights.min_rows = rows

    def settle(self) -> None:
        """The runner settled its numerics (deterministic or not): measure the adapters
        read before, and from now on each one as it is read (every rank agrees)."""
        self.settled = True
        for adapter_id, weights in self.host.items():
            why = ""
            try:
                self._measure(weights)
            except AdapterError as err:
                why = str(err)
            self._agree(self.registered[adapter_id].name, why)

    def register(self, adapter_id: int, name: str, path: str, check_dirs: bool = True) -> None:
        """Read and check the adapter on every rank and keep it in the host cache."""
        weights = self._read(name, path, check_dirs)
        self.registered[adapter_id] = Registered(name, path)
        self._keep(adapter_id, weights)
        log.info("LoRA adapter %r (id %d) loaded from %s: %.1f MiB on this rank", name,
                 adapter_id, path, weights.nbytes / 2**20)

    def drop(self, adapter_id: int) -> None:
        """Forget an adapter no request uses any more (the scheduler's word)."""
        self.registered.pop(adapter_id, None)
        self.host.pop(adapter_id, None)
        self.on_device.pop(adapter_id, None)

    def _keep(self, adapter_id: int, weights: AdapterWeights) -> None:
        self.host[adapter_id] = weights
        self.host.move_to_end(adapter_id)
        while len(self.host) > self.spec.host_capacity:
            self.host.popitem(last=False)

    # ------------------------------------------------------------------ steps

    def track(self, plan: StepPlan) -> None:
        """Released rids first, then the adapters of rids new to this worker."""
        for rid in plan.released:
            self.of_request.pop(rid, None)
        for rid, adapter_id in plan.new_adapters.items():
            if adapter_id not in self.registered:
                raise ValueError(f"{rid}: LoRA adapter id {adapter_id} is not registered here")
            self.of_request[rid] = adapter_id

    def _resident(self, adapter_id: int, in_step: set[int]) -> AdapterWeights:
        weights = self.on_device.get(adapter_id)
        if weights is not None:
            self.on_device.move_to_end(adapter_id)
            return weights
        host = self.host.get(adapter_id)
        if host is None:  # evicted from host memory: read its files again (every rank)
            entry = self.registered[adapter_id]
            host = self._read(entry.name, entry.path, check_dirs=False)
            self._keep(adapter_id, host)
        else:
            self.host.move_to_end(adapter_id)
        while len(self.on_device) >= self.spec.max_loras:
            victim = next((a for a in self.on_device if a not in in_step), None)
            if victim is None:
                raise ValueError(f"a step uses more than max_loras={self.spec.max_loras} adapters")
            del self.on_device[victim]
        weights = self.on_device[adapter_id] = host.to(self.device)
        return weights

    def prepare(self, ordered: list[SeqChunk]) -> bool:
        """Group this step's rows (``ordered``: the flattened batch's sequence order) by
        adapter for the adapted layers; False when no row uses one."""
        if not self.of_request:
            return False
        runs: dict[int, list[tuple[int, int]]] = {}
        row = 0
        for seq in ordered:
            n = len(seq.token_ids)
            adapter_id = self.of_request.get(seq.rid)
            if adapter_id is not None:
                mine = runs.setdefault(adapter_id, [])
                if mine and mine[-1][0] + mine[-1][1] == row:
                    mine[-1] = (mine[-1][0], mine[-1][1] + n)
                else:
                    mine.append((row, n))
            row += n
        if not runs:
            return False
        in_step = set(runs)
        self.batch.set([(self._resident(a, in_step), r) for a, r in runs.items()], self.device)
        return True

    def step_done(self) -> None:
        self.batch.clear()
