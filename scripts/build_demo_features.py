"""Build the demo draft's training features: SmolLM2's own answers, taps and predictions.

Usage: python scripts/build_demo_features.py OUT_DIR [--prompts 600] [--max-tokens 200]

Writes one shard per batch of prompts, so training can start before the last one lands.
"""

import argparse
import sys
import time

import mlx.core as mx

from dflash_mlx.config import build_target_layer_ids
from dflash_mlx.demo import demo_target_path
from dflash_mlx.gguf import load_gguf
from dflash_mlx.load import convert_weights
from dflash_mlx.target import Target
from dflash_mlx.train_data import chat_prompts, extract_features, self_distill


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--prompts", type=int, default=600)
    ap.add_argument("--max-tokens", type=int, default=200)
    ap.add_argument("--batch", type=int, default=48)
    ap.add_argument("--sampled-fraction", type=float, default=0.25)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    model, tok = load_gguf(demo_target_path())
    convert_weights(model, mx.float32)
    target = Target(model, build_target_layer_ids(len(model.layers), 5))
    prompts = chat_prompts(args.prompts, seed=args.seed)
    n_greedy = int(len(prompts) * (1 - args.sampled_fraction))
    tic, total = time.time(), 0
    for start in range(0, len(prompts), args.batch):
        chunk = prompts[start : start + args.batch]
        temp = 0.0 if start < n_greedy else 0.7
        seqs = list(self_distill(model, tok, chunk, max_tokens=args.max_tokens,
                                 batch_size=args.batch, temperature=temp))
        total += extract_features(target, seqs, args.out)
        print(f"{start + len(chunk)}/{len(prompts)} prompts, {total} tokens, "
              f"{time.time() - tic:.0f}s", file=sys.stderr, flush=True)


if __name__ == "__main__":
    main()
