"""Tensor-parallel ranks inside one test: ``mp.spawn``'d processes joined over gloo.

A rank that returns with gloo's threads still running can be aborted at interpreter exit
("terminate called without an active exception", seen once in CI), so every rank
function ends with ``leave_group``: all ranks meet, then tear the group down in order."""

from __future__ import annotations


def leave_group() -> None:
    """Wait for every rank, then destroy the process group (call on the success path
    only: a rank that failed leaves the others in a collective, and mp.spawn ends them)."""
    import torch.distributed as dist

    dist.barrier()
    dist.destroy_process_group()
