"""Where one decode step of a model goes (batch 1, or ``--batch`` streams): wall time per module kind (every layer's
modules summed, their own time apart from their children's), the step's parts outside
the forward, and what is left for Python between modules.

    python -m bench.decode_profile [--model FILE.gguf|DIR] [--context 64] [--steps 64] [--batch 1]

A ``ModelRunner`` in this process (float32, as the gpu_worker builds it, ``--threads``
threads) prefills ``--batch`` prompts of ``--context`` tokens (each its own blocks), then
runs ``--steps`` decode steps of all of them
three times: untimed (the step's own wall time, the fastest and the median), then the
same through the layers' modules instead of their flat programs (``layer_program``, in one
C++ loop where ``layer_loop`` runs them), then
through the modules with forward hooks on every module (perf_counter on entry and exit: about 1 us per module call, which
the hooked step's extra time shows). Module names are folded over layers
(``layers.*.mlp.down_proj``); a module's self time is its total less its children's, so
``self_attn`` self is the attention kernel, RoPE and the reshapes between its
projections. On a shared box, read the fastest steps and the shares, not the totals.
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import time
from collections import defaultdict


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="a GGUF file or checkpoint directory "
                   "(default: make serve's GGUF)")
    p.add_argument("--context", type=int, default=64)
    p.add_argument("--steps", type=int, default=64)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--batch", type=int, default=1, help="streams decoded together (r16: 16)")
    a = p.parse_args(argv)
    os.environ.setdefault("MKL_CBWR", "AUTO,STRICT")  # as gpu_worker/__main__ does
    import torch

    from gpu_worker.model_runner import ModelRunner
    from launcher.gguf_checkpoint import is_gguf, prepare
    from protocol.ipc import SamplingParams, SeqChunk, StepPlan

    torch.set_num_threads(a.threads)
    model = a.model
    if model is None:
        from launcher.default_model import default_gguf
        model = str(default_gguf())
    path = str(prepare(model)) if is_gguf(model) else model
    per_seq = (a.context + 3 * a.steps) // 16 + 2
    runner = ModelRunner(path, num_blocks=per_seq * a.batch, max_model_len=a.context + 3 * a.steps + 16)
    rids = [f"r{i}" for i in range(a.batch)]
    tables = [list(range(i * per_seq, (i + 1) * per_seq)) for i in range(a.batch)]
    last: list[int] = []
    for i, rid in enumerate(rids):  # one prefill step per prompt
        prompt = [(7 * j + 13 * i) % 1000 + 3 for j in range(a.context)]
        res = runner.execute(StepPlan(i + 1, [SeqChunk(rid, prompt, 0, tables[i], True)],
                                      {rid: SamplingParams(temperature=0.0)}))
        last.append(res.sampled[0])
    pos, step_id = a.context, a.batch

    def decode(n: int) -> list[float]:
        nonlocal last, pos, step_id
        walls = []
        for _ in range(n):
            step_id += 1
            t0 = time.perf_counter()
            out = runner.execute(StepPlan(step_id, [SeqChunk(rid, [tok], pos, [], True, kept_blocks=per_seq)
                                                    for rid, tok in zip(rids, last)], {}))
            walls.append(time.perf_counter() - t0)
            last, pos = list(out.sampled), pos + 1
        return walls

    decode(4)  # first calls
    t = runner.timings
    before = (t.prepare, t.forward, t.sample)
    plain = decode(a.steps)
    parts = [(x - y) / a.steps for x, y in zip((t.prepare, t.forward, t.sample), before)]
    # hooks see modules only: the layers' modules from here on, not their flat programs
    # (nor the C++ loop of them)
    flat = runner.model.programs, runner.model.loop
    runner.model.programs = runner.model.loop = None
    modules = decode(a.steps)

    totals: dict[str, float] = defaultdict(float)
    child: dict[str, float] = defaultdict(float)  # time of a module's children, by its name
    calls: dict[str, int] = defaultdict(int)
    stack: list[tuple[str, float, list[float]]] = []
    fold = re.compile(r"\.\d+(?=\.|$)")

    def pre(name):
        def hook(_module, _inputs):
            stack.append((name, time.perf_counter(), [0.0]))
        return hook

    def post(name):
        def hook(_module, _inputs, _output):
            own, start, kids = stack.pop()
            spent = time.perf_counter() - start
            totals[own] += spent
            child[own] += kids[0]
            calls[own] += 1
            if stack:
                stack[-1][2][0] += spent
        return hook

    handles = []
    for name, module in runner.model.named_modules():
        folded = fold.sub(".*", name) or "(model)"
        handles.append(module.register_forward_pre_hook(pre(folded)))
        handles.append(module.register_forward_hook(post(folded)))
    hooked = decode(a.steps)
    for h in handles:
        h.remove()

    ms = lambda s: f"{1e3 * s:7.2f}"  # noqa: E731
    fast, med = min(plain), statistics.median(plain)
    print(f"model {model}: batch-{a.batch} decode at context {a.context}..{pos}, {a.threads} thread(s)")
    print(f"step wall: fastest {ms(fast)} ms, median {ms(med)} ms (the layers' modules, not "
          f"their programs: fastest {ms(min(modules))}, median {ms(statistics.median(modules))}; hooked: "
          f"fastest {ms(min(hooked))}, median {ms(statistics.median(hooked))})")
    print(f"  of which (mean): prepare {ms(parts[0])}  forward {ms(parts[1])}  sample "
          f"{ms(parts[2])} ms")
    runner.model.programs, runner.model.loop = flat
    n = a.steps
    top = totals.get("(model)", 0.0) / n
    print(f"\nhooked forward (the layers' modules), ms per step (mean of {n}); self = total less children")
    print(f"  {'module':<44}{'calls':>6}{'total':>9}{'self':>9}{'self share':>12}")
    for name in sorted(totals, key=lambda k: -(totals[k] - child[k])):
        own = (totals[name] - child[name]) / n
        if own * 1e3 < 0.005:
            continue
        print(f"  {name:<44}{calls[name] // n:>6}{ms(totals[name] / n):>9}{ms(own):>9}"
              f"{own / top if top else 0:>12.1%}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
