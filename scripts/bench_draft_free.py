"""Draft-free speculation (`--draft lookup`) against plain AR on the same target, same run.

For each prompt, AR (block 1) and lookup-only speculation run back to back in alternating order;
the outputs must be identical token for token (a difference is reported with the target's top-2
logit margin at its first token). Prints per-prompt tokens/s of both, τ, and the medians.

    python scripts/bench_draft_free.py --model gemma3-270m --max-tokens 700
    python scripts/bench_draft_free.py --model smollm2-demo --chat --max-tokens 256

The prompts below were written for this script and chose nothing: no threshold was tuned on them.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import dflash_mlx  # noqa: F401  (first: preloads OpenBLAS before mlx)
from dflash_mlx import SpeculationConfig, registry, stream_generate
from dflash_mlx.bench.runner import logit_margin
from dflash_mlx.chat import prompt_ids
from dflash_mlx.engine import EngineSettings, open as open_engine
from dflash_mlx.errors import DFlashError

PROMPTS = [
    "The history of the bicycle begins in the early nineteenth century, when",
    "def parse_config(path):\n    \"\"\"Read a key=value file into a dict.\"\"\"\n",
    "Chapter 1\n\nThe lighthouse keeper had not spoken to anyone in three weeks when",
    "Photosynthesis is the process by which plants",
    "Instructions for assembling the bookshelf:\n1.",
    "The following is a list of the planets of the solar system, with a short description "
    "of each:\n\nMercury:",
    "In mathematics, a prime number is a natural number greater than 1 that",
    "Dear hiring manager,\n\nI am writing to apply for the position of",
    "Recipe: tomato soup\n\nIngredients:\n-",
    "The rules of chess are simple to learn. Each player starts with sixteen pieces:",
    "SELECT name, email FROM users WHERE",
    "Once upon a time, in a village at the edge of a great forest, there lived",
]


def tokens_and_time(pair, ids, config, n):
    tic = time.perf_counter()
    events = list(stream_generate(pair, ids, config, max_tokens=n))
    wall = time.perf_counter() - tic - events[0].prompt_s
    return [t for e in events for t in e.tokens], wall, events


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="gemma3-270m")
    ap.add_argument("--max-tokens", type=int, default=700)
    ap.add_argument("--block-size", type=int, default=5)
    ap.add_argument("--prompts", type=int, default=len(PROMPTS))
    ap.add_argument("--chat", action="store_true", help="apply the chat template")
    a = ap.parse_args()
    try:
        spec = registry.resolve(a.model, registry.LOOKUP)
        opened = open_engine(spec, EngineSettings(block_size=a.block_size, tree=0), print)
        pair, lookup = opened.pair, opened.config
    except DFlashError as e:
        print(f"error: {e}", file=sys.stderr)
        raise SystemExit(2)
    plain = SpeculationConfig(block_size=1)
    pair.tokenizer._eos_token_ids = set()  # base models: run the full length, past the window
    ratios, taus, same, ties = [], [], 0, []
    print(f"{a.model}: AR vs --draft lookup at block {a.block_size}, {a.max_tokens} tokens, "
          f"pads {dict(lookup.verify_pad)}")
    for i, text in enumerate(PROMPTS[: a.prompts]):
        ids = prompt_ids(pair, text, None, {}, use_template=a.chat)
        runs = {}
        order = ("ar", "lookup") if i % 2 == 0 else ("lookup", "ar")
        for name in order:
            runs[name] = tokens_and_time(pair, ids, plain if name == "ar" else lookup,
                                         a.max_tokens)
        (ar, ar_s, _), (lk, lk_s, events) = runs["ar"], runs["lookup"]
        tau = len(lk) / len(events)
        ratios.append(ar_s / lk_s)
        taus.append(tau)
        if ar == lk:
            same += 1
            verdict = "identical"
        else:
            k = next(j for j, (x, y) in enumerate(zip(ar, lk)) if x != y)
            margin = logit_margin(pair, ids + ar[:k], ar[k], lk[k])
            ties.append(margin)
            verdict = f"differs at {k} (top-2 margin {margin:.4f})"
        print(f"#{i + 1}: AR {len(ar) / ar_s:.1f} tok/s, lookup {len(lk) / lk_s:.1f} tok/s "
              f"({ar_s / lk_s:.2f}x), tau {tau:.2f}; {verdict}", flush=True)
    print(f"median speedup {statistics.median(ratios):.3f}x, median tau "
          f"{statistics.median(taus):.3f}; identical {same}/{len(ratios)}"
          + (f"; margins at differences {ties}" if ties else ""))


if __name__ == "__main__":
    main()
