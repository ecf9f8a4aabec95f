"""Time one DFlash round on a Qwen3-0.6B-shaped random target, split into draft and verify.

Target: mlx-lm qwen3 with Qwen3-0.6B's shape (hidden 1024, 28 layers, 16/8 heads of 128,
intermediate 3072, vocab 151936, tied embeddings), random float32 weights, built in memory.
Draft: a random DFlash v1 draft shaped like Qwen3-4B-DFlash-b16 scaled to hidden 1024 (5 layers,
16/8 heads of 128, intermediate 3072, 5 taps). Weights are random, so acceptance is ~0 and
only the timings mean anything.

After a ~512-token prefill: rounds at block 5 through `stream_generate` (draft_s and verify_s
from its BlockEvents; verify includes the accept step and the cache trim), and plain AR steps
(block 1) on the same session. Median of the timed rounds after warm-up.

    python scripts/round_timing.py [--context 512] [--rounds 7] [--warmup 2] [--block 5]
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import time

import dflash_mlx  # noqa: F401  (first: preloads OpenBLAS before mlx)
import mlx.core as mx
from mlx_lm.models import qwen3

from dflash_mlx import Session, pair_from_models, stream_generate
from dflash_mlx.cpu import blas
from dflash_mlx.models.config import DraftConfig
from dflash_mlx.models.dflash import DFlashDraftModel

TARGET = dict(model_type="qwen3", hidden_size=1024, num_hidden_layers=28, intermediate_size=3072,
              num_attention_heads=16, num_key_value_heads=8, head_dim=128, rms_norm_eps=1e-6,
              vocab_size=151936, max_position_embeddings=40960, rope_theta=1e6,
              tie_word_embeddings=True)
DRAFT = {"architectures": ["DFlashDraftModel"], "hidden_size": 1024, "num_hidden_layers": 5,
         "num_attention_heads": 16, "num_key_value_heads": 8, "head_dim": 128,
         "intermediate_size": 3072, "vocab_size": 151936, "rms_norm_eps": 1e-6,
         "rope_theta": 1e6, "max_position_embeddings": 40960, "num_target_layers": 28,
         "block_size": 16, "dflash_config": {"mask_token_id": 151669}}


class _Detok:
    last_segment = ""

    def reset(self):
        pass

    def add_token(self, _t):
        pass

    def finalize(self):
        pass


class _Tokenizer:
    """All stream_generate needs from a tokenizer when the prompt is token ids."""

    eos_token_ids: list[int] = []
    detokenizer = _Detok()


def n_params(model) -> int:
    from mlx.utils import tree_flatten

    return sum(v.size for _, v in tree_flatten(model.parameters()))


def rounds(pair, session, prompt, block, n):
    """BlockEvents of the first n full-width rounds (the generator is closed after them)."""
    out = []
    gen = stream_generate(pair, prompt, block_size=block, max_tokens=n * block + 1,
                          session=session)
    for ev in gen:
        if ev.block_size == block:
            out.append(ev)
        if len(out) == n:
            break
    gen.close()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--block", type=int, default=5)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--warmup", type=int, default=2)
    args = ap.parse_args()

    st = blas.status()
    print(f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores "
          "(other processes' load inflates every number below)")
    print(f"BLAS: {st['active']} ({st['library'] or 'mlx bundled'}; {st['reason']})")
    ms = blas.sgemm_ms()
    print(f"sgemm 512x1024x3072: {ms:.1f} ms ({blas.gflops(ms):.0f} GFLOP/s)")
    tic = time.perf_counter()
    mx.random.seed(0)
    target = qwen3.Model(qwen3.ModelArgs.from_dict(TARGET))
    draft = DFlashDraftModel(DraftConfig.from_dict(DRAFT))
    mx.eval(target.parameters(), draft.parameters())
    pair = pair_from_models(target, _Tokenizer(), draft)
    print(f"target {n_params(target) / 1e6:.0f} M params, draft {n_params(draft) / 1e6:.0f} M "
          f"(float32, taps {draft.config.target_layer_ids}); built in "
          f"{time.perf_counter() - tic:.1f} s")

    prompt = [random.Random(0).randrange(150000) for _ in range(args.context)]
    session = Session.new(pair)
    tic = time.perf_counter()
    spec = rounds(pair, session, prompt, args.block, args.warmup + args.rounds)
    spent = time.perf_counter() - tic - spec[0].prompt_s
    print(f"prefill {spec[0].prompt_tokens} tokens: {spec[0].prompt_s:.1f} s "
          f"(+ {args.warmup + args.rounds} rounds in {spent:.1f} s)")
    timed = spec[args.warmup:]
    d = statistics.median(e.draft_s for e in timed)
    v = statistics.median(e.verify_s for e in timed)
    r = statistics.median(e.draft_s + e.verify_s for e in timed)
    ar_ev = rounds(pair, session, prompt, 1, args.warmup + args.rounds)
    assert ar_ev[0].reused_tokens == args.context - 1  # same session: no second prefill
    ar = statistics.median(e.verify_s for e in ar_ev[args.warmup:])

    print(f"\nmedian of {args.rounds} rounds after {args.warmup} warm-up, context ~{args.context}:")
    print(f"  block {args.block} round : {r * 1e3:8.1f} ms  = draft {d * 1e3:.1f} ms "
          f"+ verify {v * 1e3:.1f} ms")
    print(f"  AR step       : {ar * 1e3:8.1f} ms")
    print(f"  verify / AR   : {v / ar:8.2f}x   "
          f"(round / AR {r / ar:.2f}x, draft / AR {d / ar:.2f}x)")
    print(f"  break-even    : {r / ar:.2f} tokens per round (τ) for the round to beat AR")
    print(f"  per round (ms): draft {[round(e.draft_s * 1e3, 1) for e in timed]}")
    print(f"                  verify {[round(e.verify_s * 1e3, 1) for e in timed]}")
    print(f"  AR steps (ms) : {[round(e.verify_s * 1e3, 1) for e in ar_ev[args.warmup:]]}")
    print(f"load average at the end: {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
