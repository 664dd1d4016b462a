"""Every rank runs every plan, in order, or stops.

Plans reach the ranks over PUB/SUB, which drops messages for a subscriber while it
reconnects. A rank that silently skipped plan N would run N+1 while the others run N:
its collectives would pair with theirs from another step (wrong sums, mismatched
shapes, or a hang until the collective timeout). Plans are numbered from 1 without gaps,
and while steps are in flight the scheduler also publishes the newest number it sent
(``PlanMark``), so a rank that lost the last plan before a pause notices too. A rank that
sees a gap exits with ``PLAN_GAP_EXIT``: the launcher names the dead rank, /health turns
503 and the topology stops (or the replica is taken out), instead of computing on.
"""

from __future__ import annotations

from protocol import ipc

PLAN_GAP_EXIT = 76  # EX_PROTOCOL: a message this rank needed never arrived


class PlanGap(RuntimeError):
    pass


class PlanOrder:
    def __init__(self) -> None:
        self.expected = 1  # the scheduler numbers its plans from 1

    def accept(self, plan: ipc.StepPlan) -> None:
        """Take ``plan`` if it is the next one; PlanGap names the ones missed."""
        if plan.step_id != self.expected:
            raise PlanGap(f"missed step plan {self.expected}"
                          + (f" (up to {plan.step_id - 1})" if plan.step_id - 1 > self.expected
                             else "") + f": the next plan seen is {plan.step_id}")
        self.expected += 1

    def check(self, mark: ipc.PlanMark) -> None:
        """The scheduler has published plans up to ``mark.step_id``: none may be missing."""
        if mark.step_id >= self.expected:
            raise PlanGap(f"missed step plan {self.expected}"
                          + (f" (up to {mark.step_id})" if mark.step_id > self.expected
                             else "") + f": the scheduler has published up to {mark.step_id}")
