"""Speculative decoding (n-gram) on vs off on the default model (SmolLM2-135M, its GGUF):
a copy-heavy workload (repeat a paragraph, edit code: the prompt holds what the answer
copies) and plain chat, each at batch 1 and 16, the two servers in alternating rounds
(bench.rounds). Prints per side tok/s, TTFT and the per-token decode time (streamed
chunks carry several tokens when drafts are kept, so the chunk gap is not the ITL),
their round-pair ratios, and the acceptance the on side's spec_decode counters measured.

  python -m bench.spec [--rounds 3] [--k 4] [--workloads copy1,copy16,chat1,chat16]
                      [--spec JSON]

``--spec``: the speculative config instead of n-gram's (``num_speculative_tokens`` from
``--k`` unless given); a ``model`` of ``default`` is the default GGUF itself, so
``--spec '{"method": "draft_model", "model": "default"}'`` drafts with the target as its
own draft model (every greedy draft kept: a smoke test of the draft path's cost, not a
speedup).
"""

from __future__ import annotations

import argparse
import json
import sys
import urllib.request
from dataclasses import dataclass

from bench.rounds import add_round_args, policy_from, run_rounds
from bench.servers import candor_server, start_warm
from bench.stats import Metric, Spread, ratio_text, summary_table, values
from bench.workloads import Bench
from launcher.default_model import SERVED_NAME, default_gguf
from launcher.loadgen import Workload

PARAGRAPH = ("The library opens at nine in the morning and closes at six in the evening. "
             "Visitors may borrow up to five books at a time, and each loan lasts three "
             "weeks. Books returned late are charged ten cents a day, and lost books are "
             "replaced at the reader's cost.")
CODE = ("def total(items):\n    result = 0\n    for item in items:\n        result += "
        "item.price * item.count\n    return result\n")
COPY_ASKS = [f"Repeat this paragraph verbatim, word for word:\n\n{PARAGRAPH}",
             f"Rename the function to grand_total and repeat the rest unchanged:\n\n{CODE}",
             f"Copy this text exactly, then stop:\n\n{PARAGRAPH}"]
CHAT_ASKS = ["Write a short poem about the sea.", "What are three good habits for sleep?",
             "Explain what a rainbow is to a child.", "Give me a recipe idea for dinner."]
SPEC = {"method": "ngram", "prompt_lookup_min": 2, "prompt_lookup_max": 4}
SPEC_COUNTERS = ("vllm:spec_decode_num_drafts_total",
                 "vllm:spec_decode_num_draft_tokens_total",
                 "vllm:spec_decode_num_accepted_tokens_total")


@dataclass
class FixedPrompts(Workload):
    """The loadgen's workload over given prompts (token ids), cycled."""

    fixed: tuple[tuple[int, ...], ...] = ()
    max_tokens: int = 96

    def prompts(self) -> list[tuple[list[int], int]]:
        return [(list(self.fixed[i % len(self.fixed)]), self.max_tokens)
                for i in range(self.num_requests)]


def _post(url: str, body: dict) -> dict:
    req = urllib.request.Request(url, json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as resp:
        return json.loads(resp.read())


def chat_ids(server_url: str, asks: list[str]) -> tuple[tuple[int, ...], ...]:
    """Each ask as its chat-templated prompt's ids (the server's own /tokenize)."""
    return tuple(tuple(_post(server_url + "/tokenize", {
        "model": SERVED_NAME, "messages": [{"role": "user", "content": a}],
        "add_generation_prompt": True})["tokens"]) for a in asks)


def spec_totals(server_url: str) -> dict[str, float]:
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(server_url + "/metrics", timeout=10) as resp:
        text = resp.read().decode()
    out = dict.fromkeys(SPEC_COUNTERS, 0.0)
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name in out:
                out[s.name] += s.value
    return out


def per_token_s(r: dict) -> float:
    """Mean decode seconds per generated token after the first, of one round."""
    per_request = r["output_tokens"] / max(1, r["requests"] - r["errors"])
    return (r["e2e_s_mean"] - r["ttft_s_mean"]) / max(1.0, per_request - 1)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.spec", description=__doc__.split("\n\n")[0])
    add_round_args(p, 3, 6)
    p.add_argument("--k", type=int, default=4, help="num_speculative_tokens")
    p.add_argument("--workloads", default="copy1,copy16,chat1,chat16")
    p.add_argument("--max-tokens", type=int, default=96)
    p.add_argument("--spec", type=json.loads, default=None,
                   help="the --speculative-config JSON (default: n-gram, lookup 2..4)")
    a = p.parse_args(argv)
    model = default_gguf()
    chosen = {"num_speculative_tokens": a.k, **(a.spec if a.spec is not None else SPEC)}
    if chosen.get("model") == "default":
        chosen["model"] = str(model)
    spec = json.dumps(chosen)
    servers = [candor_server(model, SERVED_NAME, name="spec-off"),
               candor_server(model, SERVED_NAME, extra=["--speculative-config", spec],
                             name="spec-on")]
    off, on = servers
    try:
        start_warm(servers, SERVED_NAME)
        asks = {"copy": chat_ids(on.url, COPY_ASKS), "chat": chat_ids(on.url, CHAT_ASKS)}
        report = []
        for name in a.workloads.split(","):
            kind, batch = name[:4], int(name[4:])
            w = FixedPrompts(num_requests=max(4, 2 * batch), concurrency=batch,
                             extra_body={"ignore_eos": False}, fixed=asks[kind],
                             max_tokens=a.max_tokens)
            before = spec_totals(on.url)
            per_side = run_rounds(servers, Bench(SERVED_NAME, w), policy_from(a), name)
            after = spec_totals(on.url)
            d = {k: after[k] - before[k] for k in SPEC_COUNTERS}
            drafts, tokens, accepted = (d[k] for k in SPEC_COUNTERS)
            for side in per_side.values():
                for r in side:
                    r["per_token_s"] = per_token_s(r)
            m = Metric("decode ms / token", "per_token_s", "ms", False)
            on_t, off_t = values(per_side["spec-on"], m.key), values(per_side["spec-off"], m.key)
            lines = [f"== {name}: {kind} prompts, batch {batch}, {w.num_requests} requests, "
                     f"<= {a.max_tokens} tokens, {spec}",
                     summary_table(per_side, ("spec-on", "spec-off")),
                     f"{m.label:<20}" + "".join(f"{' / '.join(m.fmt(v) for v in (s.lo, s.median, s.hi)):>28}"
                                                for s in (Spread.of(off_t), Spread.of(on_t)))
                     + "   " + ratio_text(on_t, off_t, False),
                     f"acceptance (spec-on, warm-up included): {drafts:.0f} drafting steps, "
                     f"{tokens:.0f} draft tokens, {accepted:.0f} accepted "
                     f"({accepted / tokens if tokens else 0:.0%}); mean acceptance length "
                     f"{1 + accepted / drafts if drafts else 1:.2f} tokens per drafting step"]
            print("\n".join(lines), flush=True)
            report.append("\n".join(lines))
        print("\n\n".join(report))
    finally:
        for s in servers:
            s.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
