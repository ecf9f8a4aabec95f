"""Peak memory of a batch on the demo pair against the bound weights + 1.15 x the sum of KV.

For each concurrency N and prompt length, `batch_generate` decodes N held-out prompts (greedy,
the pair's device defaults) after `mx.reset_peak_memory()`; the peak (`mx.get_peak_memory()`,
MLX's allocations: weights, caches and temporaries) is set against the weights (every target
and draft parameter) plus the K/V every sequence holds at its end (`kv_bytes_per_token` x
(prompt + generated tokens), summed over the sequences). "long" prompts are held-out prompts
joined until each is about `--long` tokens: there the KV, not the temporaries of one pass,
dominates what a batch adds.

    python scripts/bench_batch_memory.py --concurrency 1,2,4,8 --max-tokens 64
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import dflash_mlx  # noqa: F401, I001  (first: preloads the system OpenBLAS before mlx on Linux)
import mlx.core as mx

from dflash_mlx import load
from dflash_mlx.batch import batch_generate
from dflash_mlx.registry import default_pair
from dflash_mlx.server.memory import kv_bytes_per_token, weights_bytes
from dflash_mlx.speculate import SpeculationConfig

PROMPTS = Path(__file__).resolve().parent / "prompts" / "heldout-v1.jsonl"
MB = 1 << 20


def chat_ids(pair, text: str) -> list[int]:
    return pair.tokenizer.apply_chat_template([{"role": "user", "content": text}],
                                              add_generation_prompt=True)


def prompts_of(pair, texts: list[str], n: int, tokens: int | None) -> list[list[int]]:
    out = []
    for i in range(n):
        text = texts[i % len(texts)]
        j = i + 1
        while tokens and len(chat_ids(pair, text)) < tokens:
            text += "\n\n" + texts[j % len(texts)]
            j += 1
        out.append(chat_ids(pair, text)[: tokens or None])
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--concurrency", default="1,2,4,8")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--long", type=int, default=1024, help="tokens of a long prompt")
    args = ap.parse_args()
    pair = load(*default_pair())
    config = SpeculationConfig.for_pair(pair)
    texts = [json.loads(line)["prompt"] for line in PROMPTS.read_text().splitlines() if line]
    weights, per_token = weights_bytes(pair), kv_bytes_per_token(pair)
    print(f"weights {weights / MB:.0f} MB, KV {per_token / 1024:.1f} KiB per token; "
          f"resident before any batch {mx.get_active_memory() / MB:.0f} MB", file=sys.stderr)
    list(batch_generate(pair, prompts_of(pair, texts, 2, None), config, max_tokens=4))
    print("| prompts | N | KV held | peak | weights + 1.15 x KV | peak / bound |")
    print("|---|---|---|---|---|---|")
    for kind, tokens in (("chat", None), ("long", args.long)):
        for n in (int(x) for x in args.concurrency.split(",")):
            prompts = prompts_of(pair, texts, n, tokens)
            made = [0] * n
            mx.clear_cache()
            mx.reset_peak_memory()
            for ev in batch_generate(pair, prompts, config, max_tokens=args.max_tokens):
                made[ev.index] += len(ev.tokens)
            peak = mx.get_peak_memory()
            kv = per_token * sum(len(p) + m for p, m in zip(prompts, made))
            bound = weights + 1.15 * kv
            print(f"| {kind} ({sum(map(len, prompts)) // n} tokens) | {n} | {kv / MB:.1f} MB "
                  f"| {peak / MB:.0f} MB | {bound / MB:.0f} MB | {peak / bound:.3f} |",
                  flush=True)


if __name__ == "__main__":
    main()
