"""The machine-dependent defaults the gpu_worker settles at start-up, each with the reason
it logs: which device ``auto`` means, and how many bytes the KV cache gets when no size
was asked for. An operator's explicit flag always wins; these only fill the gaps."""

from __future__ import annotations

from dataclasses import dataclass

import torch

GiB = 2**30
MiB = 2**20
# CPU: what the model and its traffic can use, at most a share of the memory free after
# the weights loaded. Decode is memory-bound there and every step reads the whole live
# cache besides the weights, so live KV of c x the weights' bytes brings throughput to
# c / (1 + c) of what unbounded batching of those contexts could reach: 4x is 80%, and a
# bigger cache mostly makes every step slower. One full-context sequence always fits.
KV_PER_WEIGHT = 4
CPU_SHARE = 0.25
CPU_FLOOR = 64 * MiB
# CUDA: what --gpu-memory-utilization leaves after everything already allocated, less a
# reserve for activations and CUDA graphs (not profiled: a fixed, documented margin)
CUDA_ACTIVATION_RESERVE = 1 * GiB


@dataclass(frozen=True)
class KvDemand:
    """What the model and its traffic ask of the cache: blocks of ``block_bytes`` (every
    layer's K and V on this rank), one extra scratch block, ``max_num_seqs`` sequences of
    up to ``max_model_len`` tokens, beside ``weight_bytes`` of weights on this rank."""
    block_bytes: int
    block_size: int
    max_num_seqs: int
    max_model_len: int
    weight_bytes: int

    def _seq_bytes(self, seqs: int) -> int:
        return (seqs * -(-self.max_model_len // self.block_size) + 1) * self.block_bytes

    @property
    def full_batch(self) -> int:
        """Every sequence of the batch at the full context: more is never used."""
        return self._seq_bytes(self.max_num_seqs)

    @property
    def one_sequence(self) -> int:
        """One sequence at the full context: less would refuse the longest requests."""
        return self._seq_bytes(1)

    @property
    def model_share(self) -> int:
        return KV_PER_WEIGHT * self.weight_bytes


def resident_bytes(module: torch.nn.Module) -> int:
    """Bytes of a module's parameters and buffers, each storage once (tied weights)."""
    storages = {}
    for t in [*module.parameters(), *module.buffers()]:
        storage = t.untyped_storage()
        storages[storage.data_ptr()] = storage.nbytes()
    return sum(storages.values())


def resolve_device(requested: str) -> tuple[str, str]:
    """``auto``: the first CUDA device when torch sees one, else the CPU."""
    if requested != "auto":
        return requested, f"--device {requested}"
    if torch.cuda.is_available():
        return "cuda", f"auto: CUDA is available ({torch.cuda.get_device_name(0)})"
    return "cpu", "auto: no CUDA device visible to torch"


def _mem_available() -> int | None:
    try:
        with open("/proc/meminfo") as fh:
            for line in fh:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def auto_kv_bytes(device: torch.device, demand: KvDemand, gpu_memory_utilization: float,
                  available: int | None = None) -> tuple[int, str]:
    """Bytes for the KV cache when none was asked for, and why. ``available``: the CPU's
    free memory (default: MemAvailable now)."""
    if device.type == "cuda":
        return _cuda_kv_bytes(device, demand, gpu_memory_utilization)
    batch = f"{demand.max_num_seqs} sequences x {demand.max_model_len} tokens"
    full = f"{batch} would take {_size(demand.full_batch)}"
    if demand.full_batch <= max(demand.model_share, demand.one_sequence, CPU_FLOOR):
        want, why = demand.full_batch, f"enough for {batch}"
    elif demand.model_share >= max(demand.one_sequence, CPU_FLOOR):
        want, why = demand.model_share, (
            f"{KV_PER_WEIGHT}x the weights' {_size(demand.weight_bytes)} (decode reads the "
            f"live cache every step: a bigger one mostly slows each step); {full}")
    elif demand.one_sequence >= CPU_FLOOR:
        want, why = demand.one_sequence, (
            f"one sequence at the full {demand.max_model_len}-token context, above "
            f"{KV_PER_WEIGHT}x the weights' {_size(demand.weight_bytes)}; {full}")
    else:
        want, why = CPU_FLOOR, f"the {_size(CPU_FLOOR)} floor; {full}"
    available = _mem_available() if available is None else available
    if available is None:
        limit, limit_why = 512 * MiB, "MemAvailable unknown: at most 512 MiB"
    else:
        limit = max(CPU_FLOOR, int(available * CPU_SHARE))
        limit_why = f"at most {CPU_SHARE:.0%} of {available / GiB:.1f} GiB free memory"
    if want > limit:
        return limit, f"{_size(limit)}: {limit_why}; wanted {_size(want)}, {why} (--kv-cache-memory to choose)"
    return want, f"{_size(want)}: {why}; {limit_why} (--kv-cache-memory to choose)"


def _cuda_kv_bytes(device: torch.device, demand: KvDemand, gpu_memory_utilization: float) -> \
        tuple[int, str]:
    """What --gpu-memory-utilization leaves, at most every sequence at the full context."""
    free, total = torch.cuda.mem_get_info(device)
    used = total - free
    budget = int(total * gpu_memory_utilization) - used - CUDA_ACTIVATION_RESERVE
    why = (f"--gpu-memory-utilization {gpu_memory_utilization:g} of {total / GiB:.1f} GiB, "
           f"less {used / GiB:.1f} GiB in use after loading and "
           f"{CUDA_ACTIVATION_RESERVE / GiB:g} GiB for activations")
    if budget <= 0:
        raise ValueError(f"no GPU memory left for the KV cache: {why}; raise "
                         "--gpu-memory-utilization or lower --max-model-len")
    if demand.full_batch < budget:
        return demand.full_batch, (f"{_size(demand.full_batch)}: enough for --max-num-seqs "
                                   f"sequences at the full context ({why})")
    return budget, f"{_size(budget)}: {why}"


def _size(n: int) -> str:
    if n >= GiB:
        return f"{n / GiB:.1f} GiB"
    return f"{n / MiB:.0f} MiB" if n >= MiB else f"{n / 1024:.0f} KiB"
