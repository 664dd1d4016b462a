"""The machine-dependent defaults the gpu_worker settles at start-up, each with the reason
it logs: which device ``auto`` means, and how many bytes the KV cache gets when no size
was asked for. An operator's explicit flag always wins; these only fill the gaps."""

from __future__ import annotations

import torch

GiB = 2**30
MiB = 2**20
# CPU: a share of the memory free after the weights loaded, capped (vLLM's CPU backend
# takes 4 GiB unless VLLM_CPU_KVCACHE_SPACE says otherwise)
CPU_SHARE = 0.25
CPU_CAP = 4 * GiB
CPU_FLOOR = 64 * MiB
# CUDA: what --gpu-memory-utilization leaves after everything already allocated, less a
# reserve for activations and CUDA graphs (not profiled: a fixed, documented margin)
CUDA_ACTIVATION_RESERVE = 1 * GiB


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


def auto_kv_bytes(device: torch.device, needed: int, gpu_memory_utilization: float) -> \
        tuple[int, str]:
    """Bytes for the KV cache when none was asked for, and why. ``needed``: what every
    sequence of the batch at full context would take; more than that is never useful."""
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        used = total - free
        budget = int(total * gpu_memory_utilization) - used - CUDA_ACTIVATION_RESERVE
        why = (f"--gpu-memory-utilization {gpu_memory_utilization:g} of {total / GiB:.1f} GiB, "
               f"less {used / GiB:.1f} GiB in use after loading and "
               f"{CUDA_ACTIVATION_RESERVE / GiB:g} GiB for activations")
        if budget <= 0:
            raise ValueError(f"no GPU memory left for the KV cache: {why}; raise "
                             "--gpu-memory-utilization or lower --max-model-len")
    else:
        available = _mem_available()
        if available is None:
            budget, why = 512 * MiB, "MemAvailable unknown: 512 MiB"
        else:
            budget = max(CPU_FLOOR, min(int(available * CPU_SHARE), CPU_CAP))
            why = (f"{CPU_SHARE:.0%} of {available / GiB:.1f} GiB free memory, at most "
                   f"{CPU_CAP / GiB:g} GiB (--kv-cache-memory to choose)")
    if needed < budget:
        return needed, (f"{needed / MiB:.0f} MiB: enough for --max-num-seqs sequences at "
                        f"the full context ({why})")
    return budget, f"{budget / MiB:.0f} MiB: {why}"
