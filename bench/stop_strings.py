"""Detokenizer cost per token against the number of stop strings.

    python -m bench.stop_strings [--model-dir DIR]

Streams ~2.5k tokens of mixed text through one ``RequestDetokenizer`` with 0, 1, 64,
10k and 100k stop strings that never match (the worst case: nothing ends the scan early)
and prints the automaton build time and the median per-token cost of add_token +
take_delta over 5 runs; then stops built to be the worst case for the held-back tail. The tiny checkpoint's tokenizer is built when no directory is
given.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

from tokenizers import Tokenizer

from detokenizer.incremental import RequestDetokenizer
from protocol.ipc import DetokParams

TEXT = ("Über café — 中文 and 🙂🙂 emoji, then plain words at the end. "
        "A longer stretch of ordinary English text follows, with numbers 12345 too. ") * 40


def measure(tokenizer: Tokenizer, stops: list[str], ids: list[int]) -> tuple[float, float]:
    """(build seconds, median seconds per token)."""
    runs, builds = [], []
    for _ in range(5):
        started = time.perf_counter()
        detok = RequestDetokenizer(tokenizer, DetokParams(stop=stops))
        builds.append(time.perf_counter() - started)
        started = time.perf_counter()
        for token_id in ids:
            detok.add_token(token_id)
            detok.take_delta(final=False)
        runs.append((time.perf_counter() - started) / len(ids))
        assert not detok.stopped
    return statistics.median(builds), statistics.median(runs)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-dir", type=Path)
    args = parser.parse_args()
    model_dir = args.model_dir
    if model_dir is None:
        from launcher.tiny_model import build_tiny_model
        model_dir = build_tiny_model(Path(tempfile.mkdtemp()) / "tiny-llama")
    tokenizer = Tokenizer.from_file(str(Path(model_dir) / "tokenizer.json"))
    ids = tokenizer.encode(TEXT, add_special_tokens=False).ids
    print(f"{len(ids)} tokens per run; stop strings are 12-16 characters and never match")
    print(f"{'stops':>8} {'build ms':>10} {'us/token':>10}")
    for count in (0, 1, 64, 10_000, 100_000):
        stops = [f"zq{i:06d} never"[: 12 + i % 5] for i in range(count)]
        build, per_token = measure(tokenizer, stops, ids)
        print(f"{count:>8} {build * 1e3:>10.2f} {per_token * 1e6:>10.2f}")
    # adversarial: every stop is 40 characters of the text itself plus one that never
    # comes, so some 39-character tail is always a possible stop start and is rescanned
    print("stops that are the text's own 40-character runs + '#':")
    for count in (1, 64, 10_000):
        stops = [TEXT[i % 150:i % 150 + 40] + f"#{i}" for i in range(count)]
        build, per_token = measure(tokenizer, stops, ids)
        print(f"{count:>8} {build * 1e3:>10.2f} {per_token * 1e6:>10.2f}")


if __name__ == "__main__":
    main()
