"""No-server reference: HF transformers static-batch ``generate`` on the same prompts.

Prints one JSON object: output tokens/s over the whole batch (all prompts in one padded
batch, exactly ``output_len`` new tokens each, greedy), and the time to the first token of
the batch (a prefill plus one step), which is every request's TTFT in a static batch.
"""

from __future__ import annotations

import argparse
import json
import time


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--model", required=True)
    p.add_argument("--prompts", required=True, help="JSON file: list of [token ids, n]")
    p.add_argument("--threads", type=int, default=1)
    a = p.parse_args(argv)

    import torch
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(a.threads)
    prompts = json.load(open(a.prompts))
    model = AutoModelForCausalLM.from_pretrained(a.model, dtype=torch.float32).eval()
    width = max(len(ids) for ids, _ in prompts)
    n_new = max(n for _, n in prompts)
    pad = 0
    ids = torch.tensor([[pad] * (width - len(x)) + x for x, _ in prompts])  # left padding
    mask = torch.tensor([[0] * (width - len(x)) + [1] * len(x) for x, _ in prompts])
    kw = dict(attention_mask=mask, do_sample=False, pad_token_id=pad)
    with torch.inference_mode():
        model.generate(ids[:2, :8], attention_mask=mask[:2, :8], max_new_tokens=2,
                       do_sample=False, pad_token_id=pad)  # warm-up
        t0 = time.perf_counter()
        model.generate(ids, max_new_tokens=1, min_new_tokens=1, **kw)
        ttft = time.perf_counter() - t0
        t0 = time.perf_counter()
        out = model.generate(ids, max_new_tokens=n_new, min_new_tokens=n_new, **kw)
        wall = time.perf_counter() - t0
    produced = (out.shape[1] - width) * out.shape[0]
    print(json.dumps({"output_tokens": produced, "wall_s": wall,
                      "output_tokens_per_s": produced / wall, "ttft_s_p50": ttft,
                      "threads": torch.get_num_threads()}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
