"""The scheduler's view of one request."""

from __future__ import annotations

from dataclasses import dataclass, field

from protocol.ipc import TokenizedReq


@dataclass(eq=False)
class SchedRequest:
    req: TokenizedReq
    arrival_seq: int
    token_ids: list[int] = field(default_factory=list)  # prompt + generated so far
    num_computed: int = 0      # tokens whose KV is in the cache
    block_table: list[int] = field(default_factory=list)
    num_generated: int = 0
    seen_by_worker: bool = False
    preemptions: int = 0

    def __post_init__(self) -> None:
        if not self.token_ids:
            self.token_ids = list(self.req.prompt_token_ids)

    @property
    def rid(self) -> str:
        return self.req.rid

    @property
    def num_pending(self) -> int:
        """Tokens still to feed before the next sample (whole prompt, or the last token)."""
        return len(self.token_ids) - self.num_computed

    def blocks_needed(self, num_new_tokens: int, block_size: int) -> int:
        total = self.num_computed + num_new_tokens
        return max(0, -(-total // block_size) - len(self.block_table))

    def finish_reason_after(self, token_id: int) -> str | None:
        """Why generation ends after this newly sampled token, if it does."""
        req = self.req
        if self.num_generated >= req.min_tokens:
            if not req.ignore_eos and token_id in req.eos_token_ids:
                return "stop"
            if token_id in req.stop_token_ids:
                return "stop"
        if self.num_generated >= req.max_tokens:
            return "length"
        return None
