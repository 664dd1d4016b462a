"""Bytes on the wire per decode step (the scheduler's StepPlan), by context length.

    python -m bench.plan_size [--seqs 1 32] [--contexts 2048 32768]

Builds a Planner, prefills ``seqs`` requests of ``context`` tokens each, then plans one
decode step and msgpack-encodes the StepPlan exactly as the scheduler sends it (the
steady state: every request decoding, nothing new). Runs without a model or processes.
"""

from __future__ import annotations

import argparse

import msgspec

from protocol.ipc import DetokParams, SamplingParams, StepPlan, TokenizedReq
from scheduler.block_manager import BlockAllocator
from scheduler.planner import Planner
from scheduler.request import SchedRequest


def _decode_plan_bytes(num_seqs: int, context: int, block_size: int = 16) -> int:
    blocks = num_seqs * (context // block_size + 2)
    planner = Planner(BlockAllocator(blocks), block_size, max_num_seqs=num_seqs,
                      max_num_batched_tokens=num_seqs * context, enable_prefix_caching=False)
    for i in range(num_seqs):
        tok = TokenizedReq(rid=f"req-{i:04d}", reply_to="ipc://x",
                           prompt_token_ids=[(7 * i + j) % 32000 + 1 for j in range(context)],
                           max_tokens=16, sampling=SamplingParams(temperature=0.0),
                           detok=DetokParams())
        planner.waiting.push(SchedRequest(tok, i))
    encoder = msgspec.msgpack.Encoder()
    step_id = 0
    size = 0
    for _ in range(3):  # prefill, then two decode steps (the second is the steady state)
        step = planner.plan()
        step_id += 1
        plan = StepPlan(step_id, step.chunks, step.new_sampling, [])
        size = len(encoder.encode(plan))
        postprocess = getattr(planner, "postprocess", None)
        if postprocess is not None:
            postprocess(step, [11] * sum(c.sample for c in step.chunks))
        else:  # the engine loop's bookkeeping before the planner owned it
            planner.step_returned(step)
            for (req, n), chunk in zip(step.members, step.chunks):
                req.step_returned(n, chunk.sample)
                if chunk.sample:
                    req.token_ids.append(11)
                    req.num_generated += 1
    return size


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seqs", type=int, nargs="+", default=[1, 32])
    parser.add_argument("--contexts", type=int, nargs="+", default=[2048, 32768])
    args = parser.parse_args(argv)
    print("seqs  context  plan_bytes_per_decode_step")
    for n in args.seqs:
        for ctx in args.contexts:
            print(f"{n:4d}  {ctx:7d}  {_decode_plan_bytes(n, ctx):10d}")


if __name__ == "__main__":
    main()
