"""Workload (a)'s shape driven straight through a ``ModelRunner`` with hand-made plans,
for the runner-level benches (``deterministic_cost``, ``step_bench``, ``moe_runner``):
``seqs`` sequences of ``prompt`` seed-fixed tokens each, prefilled ``step_tokens`` tokens
a step, then decoded together. No scheduler: each sequence owns consecutive blocks
(``tables``), so a bench sizes the runner with ``num_blocks``.

Imports nothing heavy (``protocol.ipc`` is msgspec only): a bench may set ``MKL_CBWR``
before torch loads, as the worker does.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from protocol.ipc import SamplingParams, SeqChunk, StepPlan

GREEDY = SamplingParams(temperature=0.0)


@dataclass
class RunnerBatch:
    seqs: int = 32
    prompt: int = 128
    decodes: int = 32  # decode steps the tables must hold
    step_tokens: int = 1024
    salt: int = 0  # another value gives other prompts and request ids (a fresh round)
    block_size: int = 16
    last: dict[str, int] = field(default_factory=dict)  # rid -> its latest sampled token

    @property
    def blocks_per_seq(self) -> int:
        return -(-(self.prompt + self.decodes + 1) // self.block_size)

    @property
    def num_blocks(self) -> int:
        return self.seqs * self.blocks_per_seq + 1

    @property
    def rids(self) -> list[str]:
        return [f"r{self.salt}-{i}" for i in range(self.seqs)]

    def table(self, i: int) -> list[int]:
        return list(range(i * self.blocks_per_seq, (i + 1) * self.blocks_per_seq))

    def prefill_plans(self, first_step: int, released: list[str] = ()) -> list[StepPlan]:
        """The prompts' steps, numbered from ``first_step``; the first also releases
        ``released`` (an earlier round's requests, whose blocks these reuse)."""
        per_step, rids = self.step_tokens // self.prompt, self.rids
        plans = []
        for lo in range(0, self.seqs, per_step):
            batch = range(lo, min(self.seqs, lo + per_step))
            seqs = [SeqChunk(rids[i], [(7 * i + j + self.salt) % 250 + 3 for j in range(self.prompt)], 0,
                             self.table(i), True) for i in batch]
            plans.append(StepPlan(first_step + len(plans), seqs, {rids[i]: GREEDY for i in batch},
                                  list(released) if lo == 0 else []))
        return plans

    def decode_plan(self, step_id: int, n: int) -> StepPlan:
        """Decode step ``n`` (from 0) of every sequence, feeding each its latest token (its
        table, sent whole with the prompt, is kept as it is)."""
        return StepPlan(step_id, [SeqChunk(rid, [self.last[rid]], self.prompt + n, [], True,
                                           kept_blocks=self.blocks_per_seq) for rid in self.rids])

    def took(self, plan: StepPlan, sampled: list[int]) -> None:
        """Record the tokens a step sampled for its sequences."""
        self.last.update(zip((s.rid for s in plan.seqs), sampled))
