"""Runs one model's layers as flat programs and as modules over the same steps, for the
tests that hold programs (``gpu_worker/models/layer_program.py``) to the modules' bits."""

from __future__ import annotations

import torch


def steps() -> list[list[tuple[int, int, int]]]:
    """A schedule of steps, each a list of (sequence, first position, tokens): two prompts
    prefilled together (one in two chunks), then decodes of both with a chunk beside
    them, then decodes alone (each decode row its own sequence's next position)."""
    return [[(0, 0, 7), (1, 0, 12)], [(0, 7, 5), (1, 12, 1)], [(0, 12, 1), (1, 13, 1)],
            [(2, 0, 9), (0, 13, 1), (1, 14, 1)], *[[(0, p, 1), (1, p + 1, 1)] for p in range(14, 20)],
            [(0, 20, 1)]]


def hidden_states(runner, flat: bool) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Every step's hidden states through ``runner``'s model (programs where ``flat``),
    on a cache of its own, and that cache's K blocks after the last step."""
    cfg = runner.config
    gen = torch.Generator().manual_seed(3)
    tokens = [torch.randint(6, cfg.vocab_size, (32,), generator=gen).tolist() for _ in range(3)]
    per_seq = 4  # blocks of 16 positions
    tables = [list(range(s * per_seq, (s + 1) * per_seq)) for s in range(3)]
    caches = [(torch.zeros_like(k), torch.zeros_like(v)) for k, v in runner.kv_caches]
    out = []
    for step in steps():
        chunks = [(start, n, tables[s]) for s, start, n in step]
        decodes = sum(1 for _, _, n in step if n == 1)
        ids = [t for s, start, n in step for t in tokens[s][start:start + n]]
        positions = [p for _, start, n in step for p in range(start, start + n)]
        meta = runner.attn_backend.build(chunks, decodes)
        with torch.inference_mode():
            out.append(runner.model(torch.tensor(ids), torch.tensor(positions), caches, meta, flat=flat).clone())
    return out, [k.clone() for k, _ in caches]


def assert_same_bits(runner) -> int:
    """Programs (from Python, and in the C++ loop where the model has one) and modules
    give every step the same hidden states and cache, bit for bit; returns how many layers
    ran as programs."""
    model = runner.model
    programs = sum(1 for p, m in zip(model.programs, model.model.layers) if p is not m)
    modules, module_cache = hidden_states(runner, False)
    ways = {"programs": None}
    if model.loop is not None:
        ways["the C++ loop"] = model.loop
    loop = model.loop
    try:
        for way, model.loop in ways.items():
            flat, flat_cache = hidden_states(runner, True)
            for i, (a, b) in enumerate(zip(flat, modules)):
                assert torch.equal(a, b), f"{way}: step {i} differs from the modules by {(a - b).abs().max()}"
            for layer, (a, b) in enumerate(zip(flat_cache, module_cache)):
                assert torch.equal(a, b), f"{way}: layer {layer}'s keys differ"
    finally:
        model.loop = loop
    return programs
