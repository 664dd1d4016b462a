"""The tensor-parallel process group of one engine replica's gpu_worker ranks.

Activations travel on the default group (NCCL on CUDA, gloo on CPU); small host-side
agreements (the KV block count, the sampled token ids) travel on a gloo group, so they
need no device copies. The rendezvous address comes from the topology
(``addresses.tp_rendezvous``): a file store in the launcher's private run directory when
the ranks share a node (their collectives then bind to loopback), a TCP store when they
span machines (whose traffic the topology must declare protected: CURVE does not cover it).
"""

from __future__ import annotations

import logging
import os
from datetime import timedelta

import torch

from gpu_worker.batch_invariant import Numerics
from gpu_worker.models.parallel import TPGroup
from gpu_worker.tp_shard import TPShard

log = logging.getLogger(__name__)
# A collective waits this long for a peer: past it a stuck or dead rank fails the step.
COLLECTIVE_TIMEOUT = timedelta(seconds=120)


class Ranks:
    """This process's place in the group, and the host-side collectives the runner uses."""

    def __init__(self, rank: int = 0, size: int = 1, cpu_group=None) -> None:
        self.rank, self.size, self.cpu_group = rank, size, cpu_group

    def tp_group(self, shard: TPShard, numerics: Numerics | None = None) -> TPGroup:
        return TPGroup(shard, group=None, numerics=numerics)

    def min_int(self, value: int) -> int:
        """The smallest ``value`` over the ranks (KV capacity: the scarcest rank's)."""
        if self.size == 1:
            return value
        import torch.distributed as dist
        t = torch.tensor([value], dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.cpu_group)
        return int(t.item())

    def rank0_ints(self, values: list[int]) -> list[int]:
        """Rank 0's ``values`` on every rank (same length everywhere): the sampled ids,
        so run-ahead placeholders are filled identically on every rank."""
        if self.size == 1 or not values:
            return values
        import torch.distributed as dist
        t = torch.tensor(values, dtype=torch.int64)
        dist.broadcast(t, src=0, group=self.cpu_group)
        return t.tolist()


    def gather_texts(self, text: str, limit: int = 1024) -> list[str]:
        """Every rank's ``text`` (its first ``limit`` UTF-8 bytes), in rank order: how the
        ranks agree on whether a step of their own (loading an adapter) worked, and say
        why not."""
        if self.size == 1:
            return [text]
        import torch.distributed as dist
        data = text.encode()[:limit]
        mine = torch.zeros(limit + 2, dtype=torch.uint8)
        mine[0], mine[1] = len(data) >> 8, len(data) & 0xFF
        mine[2:2 + len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else mine[2:2]
        parts = [torch.empty_like(mine) for _ in range(self.size)]
        dist.all_gather(parts, mine, group=self.cpu_group)
        out = []
        for part in parts:
            n = (int(part[0]) << 8) | int(part[1])
            out.append(bytes(part[2:2 + n].tolist()).decode(errors="replace"))
        return out


def init_ranks(rank: int, size: int, address: str, device: torch.device,
               interface: str | None = None) -> Ranks:
    """Join the group at ``address``; the collectives' sockets bind to ``interface``
    (gloo and NCCL read it from their variables; an operator's own setting wins)."""
    if size == 1:
        return Ranks()
    import torch.distributed as dist
    if interface is not None:
        for var in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME"):
            os.environ.setdefault(var, interface)
    backend = "nccl" if device.type == "cuda" else "gloo"
    log.info("rank %d of %d: joining the %s group at %s", rank, size, backend, address)
    dist.init_process_group(backend, init_method=address, rank=rank, world_size=size,
                            timeout=COLLECTIVE_TIMEOUT)
    cpu_group = dist.new_group(backend="gloo") if backend != "gloo" else None
    return Ranks(rank, size, cpu_group)
