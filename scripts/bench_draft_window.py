"""Draft time per round against context length, with and without a draft window.

A DFlash 2 draft of a configurable shape (default: a scaled-down Qwen3.8-27B-DFlash2, five
layers, float32) is bound to a stub target, given C rows of random context taps as a prefill
would, then timed over rounds that each add `accepted + 1` context rows and propose a
block, exactly as `decode.stream_generate` calls it. Three modes:

- `none`:   full-attention layers, no limit: the draft cache holds every context row;
- `config`: the checkpoint's own sliding window (`sliding_window`, all layers sliding);
- `window:N`: full-attention layers plus `--draft-window N` (`SpeculationConfig(draft_window=N)`).

On the CPU the draft's attention (MLX's CPU SDPA) costs ∝ cache rows, so the ratio for a
window W reflects 512 → W rows of attention; on Metal, and with the real draft's much larger
fixed cost (hidden 5120, vocab 248k: the LM head alone reads ~5 GB per round), it is smaller.

Usage: python scripts/bench_draft_window.py [--contexts 512 8192] [--runs 5] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import dflash_mlx  # noqa: F401  (preloads the system OpenBLAS before mlx on Linux)
import mlx.core as mx
import mlx.nn as nn

from dflash_mlx.models.config import DraftConfig
from dflash_mlx.models.dflash2 import DFlash2DraftModel
from dflash_mlx.speculate.proposal import propose
from dflash_mlx.speculate.sampling import SamplingParams


class StubTarget:
    """Only what `bind` needs: an embedding and an LM head (and the module holding its rows)."""

    def __init__(self, vocab: int, hidden: int):
        self._embed = nn.Embedding(vocab, hidden)
        self._head = nn.Linear(hidden, vocab, bias=False)
        self.head_module = self._head
        mx.eval(self._embed.parameters(), self._head.parameters())

    def embed(self, ids):
        return self._embed(ids)

    def lm_head(self, h):
        return self._head(h)


def window_of(mode: str) -> int | None:
    return int(mode.split(":")[1]) if mode.startswith("window:") else None


def make_draft(args, mode: str) -> DFlash2DraftModel:
    sliding = mode == "config"
    raw = {
        "architectures": ["DFlash2DraftModel"],
        "hidden_size": args.hidden,
        "num_hidden_layers": args.layers,
        "num_attention_heads": args.heads,
        "num_key_value_heads": args.kv_heads,
        "head_dim": 128,
        "intermediate_size": args.intermediate,
        "vocab_size": args.vocab,
        "rope_theta": 1e7,
        "layer_types": ["sliding_attention" if sliding else "full_attention"] * args.layers,
        "sliding_window": args.sliding_window if sliding else None,
        "is_causal": False,
        "dflash_config": {
            "block_size": 8, "mask_token_id": args.vocab - 1, "target_layer_ids": [1, 2, 3, 4, 5],
            "conv_kernel_size": 2, "conv_group_size": 16, "selector_rank": 256, "selector_top_k": 16,
        },
    }
    mx.random.seed(0)
    draft = DFlash2DraftModel(DraftConfig.from_dict(raw))
    mx.eval(draft.parameters())
    return draft


def prefill(draft, caches, context: int, width: int, window: int | None):
    """What generate.prefill hands the draft: the taps it can ever read (skip the rest)."""
    limit = draft.context_rows_needed(window)
    keep = context if limit is None else min(context, limit)
    for c in caches:
        c.skip(context - keep)
    return mx.random.normal((1, keep, width)) * 0.1


def time_rounds(draft, contexts: list[int], rounds: int, block: int, width: int,
                window: int | None) -> dict:
    """Per-round draft seconds for each context, the contexts interleaved round by round so
    that a machine's changing load hits them alike."""
    ids = mx.array([[7] + [draft.config.mask_token_id] * (block - 1)])
    params = SamplingParams(0.0)
    state = {}
    for ctx in contexts:
        caches = draft.make_cache(window)
        state[ctx] = [caches, prefill(draft, caches, ctx, width, window)]
    times = {ctx: [] for ctx in contexts}
    for r in range(rounds + 2):
        for ctx in contexts:
            caches, pending = state[ctx]
            tic = time.perf_counter()
            tokens = propose(draft, ids, pending, caches, params=params)[0]
            mx.eval(tokens)
            if r >= 2:  # the first two rounds absorb the prefill context / warm up
                times[ctx].append(time.perf_counter() - tic)
            pending = mx.random.normal((1, 1 + r % block, width)) * 0.1  # accepted + 1 rows
            mx.eval(pending)
            state[ctx][1] = pending
    return times


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--contexts", type=int, nargs="+", default=[512, 8192])
    ap.add_argument("--modes", nargs="+", default=["none", "config", "window:1024", "window:512"],
                    help="none | config | window:N (N = --draft-window)")
    ap.add_argument("--runs", type=int, default=5, help="repeats; the median is reported")
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--block", type=int, default=5)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=5)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--intermediate", type=int, default=2816)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--sliding-window", type=int, default=2048)
    ap.add_argument("--json", help="also write the rows as JSON here")
    args = ap.parse_args()

    head = StubTarget(args.vocab, args.hidden)
    width = 5 * args.hidden
    rows = []
    for mode in args.modes:
        draft = make_draft(args, mode)
        draft.bind(head)
        window = window_of(mode)
        runs = [time_rounds(draft, args.contexts, args.rounds, args.block, width, window)
                for _ in range(args.runs)]
        for ctx in args.contexts:
            medians = [statistics.median(run[ctx]) for run in runs]
            cache_rows = draft.context_rows_needed(window) or ctx
            rows.append({"mode": mode, "context": ctx, "cache_rows": min(cache_rows, ctx),
                         "draft_ms": 1000 * statistics.median(medians),
                         "runs_ms": [round(1000 * m, 2) for m in medians]})
    base = {r["mode"]: r["draft_ms"] for r in rows if r["context"] == min(args.contexts)}
    label = {m: ("no window" if m == "none" else f"sliding_window {args.sliding_window}"
                 if m == "config" else f"--draft-window {m.split(':')[1]}") for m in args.modes}
    print(f"draft: hidden {args.hidden}, {args.layers} layers, vocab {args.vocab}, block "
          f"{args.block}, float32, {mx.default_device()}; median of {args.runs} runs x "
          f"{args.rounds} rounds")
    print(f"{'mode':<22}{'context':>8}{'cache rows':>12}{'ms/round':>10}{'vs min ctx':>12}")
    for r in rows:
        print(f"{label[r['mode']]:<22}{r['context']:>8}{r['cache_rows']:>12}"
              f"{r['draft_ms']:>10.2f}{r['draft_ms'] / base[r['mode']]:>11.2f}x")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "rows": rows}, f, indent=2)


if __name__ == "__main__":
    main()
