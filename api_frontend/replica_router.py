"""Which engine replica serves a request: prefix-cache affinity, bounded by load.

A request's affinity keys are chained hashes of its prompt text in fixed-size chunks
(chat: the tools and messages as JSON), rooted in its ``cache_salt``; with a salt, the
root alone is a key too, so requests sharing a salt meet on one replica. The router
remembers which replica each key was last sent to (LRU-bounded). A request goes to the
replica holding its longest known prefix, unless that replica is overloaded (its load
exceeds the least loaded one's by more than ``balance_abs`` and ``balance_rel`` times,
SGLang's cache-aware rule); otherwise, and without a match, to the least loaded (ties in
turn). Text is hashed rather than token ids because the frontend never tokenizes; a
shared text prefix is a shared token prefix up to the chunk boundary.
"""

from __future__ import annotations

from collections import OrderedDict

import msgspec

from cluster.topology import RouterSpec
from protocol import ipc

MAX_KEY_CHUNKS = 64  # prefixes longer than this many chunks route by their head


def affinity_text(req: ipc.GenerateReq) -> str:
    """The text a request's prefix keys hash; a LoRA adapter's name leads it (its prefix
    cache is its own, and its requests meet where it is loaded on the device)."""
    head = f"lora:{req.lora}\n" if req.lora is not None else ""
    if req.messages is not None:
        tools = msgspec.json.encode(req.tools).decode() if req.tools else ""
        return head + tools + msgspec.json.encode(req.messages).decode()
    if isinstance(req.prompt, list):
        return head + ",".join(map(str, req.prompt))
    return head + (req.prompt or "")


class ReplicaRouter:
    def __init__(self, replicas: int, spec: RouterSpec) -> None:
        self.replicas = replicas
        self.spec = spec
        self._owner: OrderedDict[int, int] = OrderedDict()  # prefix key -> replica
        self._turn = 0

    def keys(self, text: str, salt: str | None) -> list[int]:
        """Chained hashes of the text's chunks (the last one may be partial)."""
        h = hash(("candor-salt", salt))
        out = [h] if salt is not None else []
        size = self.spec.prefix_chunk_chars
        for start in range(0, min(len(text), size * MAX_KEY_CHUNKS), size):
            h = hash((h, text[start:start + size]))
            out.append(h)
        return out

    def _next_in_turn(self, among: list[int]) -> int:
        for _ in range(self.replicas):
            r = self._turn % self.replicas
            self._turn += 1
            if r in among:
                return r
        return among[0]

    def _overloaded(self, load: float, least: float) -> bool:
        return load - least > self.spec.balance_abs and load > least * self.spec.balance_rel

    def pick(self, keys: list[int], loads: list[float], alive: list[int]) -> tuple[int, str]:
        """(replica, why: affinity | load | round_robin); ``alive`` must not be empty."""
        if self.spec.policy == "round_robin":
            return self._next_in_turn(alive), "round_robin"
        least = min(loads[r] for r in alive)
        chosen, why = None, "load"
        for key in reversed(keys):
            owner = self._owner.get(key)
            if owner is not None and owner in alive:
                if not self._overloaded(loads[owner], least):
                    chosen, why = owner, "affinity"
                break
        if chosen is None:
            chosen = self._next_in_turn([r for r in alive if loads[r] == least])
        self._remember(keys, chosen)
        return chosen, why

    def _remember(self, keys: list[int], replica: int) -> None:
        owner = self._owner
        for key in keys:
            owner[key] = replica
            owner.move_to_end(key)
        while len(owner) > self.spec.max_prefix_entries:
            owner.popitem(last=False)
