"""KV block accounting for the paged cache, with a prefix cache over full blocks.

The scheduler owns block ids; the gpu_worker owns the tensors they index. Each block has
a reference count (several running requests may share a cached prefix block). A block
whose count drops to zero goes back to the pool:

- blocks that hold no registered content go to the plain free list;
- blocks registered in the prefix cache stay findable, in LRU order, and are only
  evicted (their content forgotten) when an allocation finds the plain list empty.

So ``num_free`` (plain + evictable) returning to ``total`` after a load proves that no
request leaked a block, whether or not the prefix cache kept their content.

A cached block's key is ``(parent_hash, salt, token_ids)``: the parent's chained hash
(for a prompt's first block: its LoRA adapter's id, ``ROOT_HASH`` for the base model),
the request's ``cache_salt`` and the block's own token ids. The dict lookup compares the
full key (the actual token ids, not only a hash), and the block must also record the
parent block the lookup walked through, so a hash collision cannot alias two prefixes.
"""

from __future__ import annotations

from collections import OrderedDict, deque

# (parent hash, cache salt, the block's token ids then the content hash of each image
# whose placeholder span the block overlaps: two images behind the same ids never alias)
BlockKey = tuple[int, str | None, tuple[int | bytes, ...]]

ROOT_HASH = 0  # the "parent" of a base-model prompt's first block (adapter n: n)


def chain_hash(key: BlockKey) -> int:
    """Chained hash of a full block, from its key (process-local: Python's tuple hash)."""
    return hash(key)


class BlockAllocator:
    def __init__(self, num_blocks: int) -> None:
        self.total = num_blocks
        self._free: deque[int] = deque(range(num_blocks))
        self._ref = [0] * num_blocks
        self._key: list[BlockKey | None] = [None] * num_blocks
        self._parent: list[int] = [-1] * num_blocks  # parent block id when registered
        self._cached: dict[BlockKey, int] = {}
        self._evictable: OrderedDict[int, None] = OrderedDict()  # ref 0, still cached; LRU first
        self.evictions = 0

    @property
    def num_free(self) -> int:
        """Blocks an allocation could take now (plain free + evictable cached)."""
        return len(self._free) + len(self._evictable)

    @property
    def num_cached(self) -> int:
        return len(self._cached)

    def _evict_one(self) -> int:
        block, _ = self._evictable.popitem(last=False)
        key = self._key[block]
        if key is not None and self._cached.get(key) == block:
            del self._cached[key]
        self._key[block] = None
        self._parent[block] = -1
        self.evictions += 1
        return block

    def allocate(self, n: int) -> list[int] | None:
        """n fresh blocks (ref count 1), or None (and nothing taken) if fewer are free."""
        if n > self.num_free:
            return None
        out = []
        for _ in range(n):
            block = self._free.popleft() if self._free else self._evict_one()
            self._ref[block] = 1
            out.append(block)
        return out

    def free(self, blocks: list[int]) -> None:
        """Drop one reference to each block; unreferenced blocks return to the pool.

        Tail first: a sequence's last blocks become least recently used, so eviction
        eats prefixes from their ends and the shared heads survive longest."""
        for block in reversed(blocks):
            ref = self._ref[block] - 1
            if ref < 0:
                raise RuntimeError(f"block {block} freed more often than allocated")
            self._ref[block] = ref
            if ref == 0:
                if self._key[block] is not None:
                    self._evictable[block] = None  # most recently used end
                else:
                    self._free.append(block)

    # ------------------------------------------------------------------ prefix cache
    def lookup(self, key: BlockKey, parent_block: int) -> int | None:
        """The cached block holding exactly this content after ``parent_block``, if any."""
        block = self._cached.get(key)
        if block is None or self._parent[block] != parent_block:
            return None
        return block

    def acquire(self, block: int) -> None:
        """Take a reference to a cached block found by ``lookup``."""
        if self._ref[block] == 0:
            self._evictable.pop(block, None)
        self._ref[block] += 1

    def register(self, block: int, key: BlockKey, parent_block: int) -> None:
        """Make a full, written block findable. A duplicate of content that is already
        cached stays private (freed normally), so one key maps to one block."""
        if self._key[block] is not None or key in self._cached:
            return
        self._cached[key] = block
        self._key[block] = key
        self._parent[block] = parent_block
