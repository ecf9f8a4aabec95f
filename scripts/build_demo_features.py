"""Build the demo draft's training features: SmolLM2's own answers, taps and predictions.

Usage: python scripts/build_demo_features.py OUT_DIR [--prompts 2560] [--max-tokens 160] [--batch 64]
       [--seed S] [--exclude SEED:COUNT ...] [--prompts-file FILE.jsonl]

--prompts-file answers the "prompt" of every line of a JSONL file (in a seeded shuffle, so
batches mix its families) instead of generated ones: scripts/prompts/written-{1,2,3}.jsonl hold
the hand-written instruction, maths and code prompts of stage 10 (see scripts/prompts/README.md).

Writes one shard per batch of prompts, so training can start before the last one lands.
"""

import argparse
import json
import random
import sys
import time
from pathlib import Path

import dflash_mlx  # noqa: F401  (first: preloads OpenBLAS before mlx)

from dflash_mlx.demo.target import load_demo_feature_target
from dflash_mlx.train.data import distill_prompts
from dflash_mlx.train.prompts import chat_prompts


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--prompts", type=int, default=2560)
    ap.add_argument("--max-tokens", type=int, default=160)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--sampled-fraction", type=float, default=0.2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--exclude", action="append", default=[], metavar="SEED:COUNT",
                    help="skip prompts an earlier run (--seed SEED --prompts COUNT) answered")
    ap.add_argument("--prompts-file", type=Path)
    args = ap.parse_args()
    try:  # checked before the target loads, so a typo costs nothing
        excluded = [tuple(int(x) for x in spec.split(":")) for spec in args.exclude]
        if any(len(e) != 2 for e in excluded):
            raise ValueError
    except ValueError:
        print(f"error: --exclude takes SEED:COUNT, got {' '.join(args.exclude)}", file=sys.stderr)
        raise SystemExit(2) from None
    if args.prompts_file is not None:
        try:
            prompts = [json.loads(line)["prompt"] for line in
                       args.prompts_file.read_text().splitlines() if line.strip()]
        except (OSError, ValueError) as e:
            print(f"error: --prompts-file {args.prompts_file}: {e}", file=sys.stderr)
            raise SystemExit(2) from None
        except (KeyError, TypeError):
            print(f"error: --prompts-file {args.prompts_file}: every line must be a JSON object "
                  'with a "prompt"', file=sys.stderr)
            raise SystemExit(2) from None
        random.Random(args.seed).shuffle(prompts)
    else:
        prompts = chat_prompts(args.prompts, args.seed)
    target, tok = load_demo_feature_target()
    # Greedy answers to a repeated prompt are identical: re-answering one only wastes target time.
    seen = set()
    for seed, count in excluded:
        seen.update(chat_prompts(count, seed))
    prompts = [p for p in prompts if p not in seen]
    tic = time.time()

    def progress(done, total):
        print(f"{done}/{total} prompts, {time.time() - tic:.0f}s", file=sys.stderr, flush=True)

    n = distill_prompts(target, tok, prompts, args.out, sampled_fraction=args.sampled_fraction,
                        max_tokens=args.max_tokens, batch_size=args.batch, seed=args.seed,
                        progress=progress)
    print(f"{n} tokens in {time.time() - tic:.0f}s", file=sys.stderr)

if __name__ == "__main__":
    main()
