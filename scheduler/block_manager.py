"""Free-block accounting for the paged KV cache.

The scheduler owns block ids; the gpu_worker owns the tensors they index. A block is
either free or owned by exactly one request, so ``num_free`` returning to ``total``
after a load proves nothing leaked.
"""

from __future__ import annotations

from collections import deque


class BlockAllocator:
    def __init__(self, num_blocks: int) -> None:
        self.total = num_blocks
        self._free: deque[int] = deque(range(num_blocks))

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self, n: int) -> list[int] | None:
        """n blocks, or None (and nothing taken) if fewer are free."""
        if n > len(self._free):
            return None
        return [self._free.popleft() for _ in range(n)]

    def free(self, blocks: list[int]) -> None:
        self._free.extend(blocks)
