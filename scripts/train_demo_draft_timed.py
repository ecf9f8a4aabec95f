"""Self-distil and train the demo draft within a fixed time, on whatever device MLX runs on.

Usage: python scripts/train_demo_draft_timed.py OUT_DIR [--distill-minutes 2.5] [--train-minutes 4]
       [--init dflash_mlx/demo/draft] [--seed 7] [--batch 512] [--seqs 32] [--anchors 64]

The whole recipe in one run, sized by the clock rather than by counts, so one command fits a
short lease of a fast machine (an MLX CUDA GPU does in minutes what the 2-core CPU does in
hours): SmolLM2 answers fresh `chat_prompts` (seeds from --seed on) greedily until the distil
time is spent, the last --heldout answers are held out, and the draft is fine-tuned from --init
with the cosine schedule fitted to the train time (`TrainConfig.minutes`). Writes OUT_DIR/features,
OUT_DIR/draft (checkpoint, draft_vocab.json, trainer state) and a line per event on stderr.
"""

import argparse
import sys
import time
from pathlib import Path

import dflash_mlx  # noqa: F401  (first: preloads OpenBLAS before mlx)
import mlx.core as mx

from dflash_mlx.models import draft_vocab
from dflash_mlx.demo.target import load_demo_feature_target
from dflash_mlx.loader import check_pair, load_draft
from dflash_mlx.train.config import TrainConfig
from dflash_mlx.train.trainer import train
from dflash_mlx.train.data import load_shards, self_distill_features, split_heldout
from dflash_mlx.train.eval import heldout_tau, run_batches, walk_tau
from dflash_mlx.train.prompts import chat_prompts


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def distill(target, tok, out: Path, *, minutes: float, seed: int, chunk: int, batch: int,
            max_tokens: int) -> int:
    """Greedy answers to fresh prompts, a chunk at a time, until `minutes` are spent."""
    tic, total, answered, seen = time.perf_counter(), 0, 0, set()
    while time.perf_counter() - tic < minutes * 60:
        prompts = [p for p in chat_prompts(chunk, seed) if p not in seen]
        seen.update(prompts)
        total += self_distill_features(target, tok, prompts, out, max_tokens=max_tokens,
                                       batch_size=batch)
        answered += len(prompts)
        dt = time.perf_counter() - tic
        log(f"distil seed {seed}: {answered} answers, {total} tokens, {dt:.0f}s, "
            f"{total / dt:.0f} tokens/s")
        seed += 1
    return total


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("out", type=Path)
    ap.add_argument("--distill-minutes", type=float, default=2.5)
    ap.add_argument("--train-minutes", type=float, default=4.0)
    ap.add_argument("--steps", type=int, default=0,
                    help="a fixed step count instead of fitting the schedule to --train-minutes")
    ap.add_argument("--init", type=Path, default=Path(dflash_mlx.__file__).parent / "demo" / "draft")
    ap.add_argument("--seed", type=int, default=7, help="first chat_prompts seed (3-6: stages 2-6)")
    ap.add_argument("--chunk", type=int, default=2048, help="prompts per chat_prompts seed")
    ap.add_argument("--batch", type=int, default=512)
    ap.add_argument("--max-tokens", type=int, default=160)
    ap.add_argument("--heldout", type=int, default=256)
    ap.add_argument("--seqs", type=int, default=32)
    ap.add_argument("--anchors", type=int, default=64)
    ap.add_argument("--lr", type=float, default=4e-4)
    ap.add_argument("--warmup", type=int, default=50)
    ap.add_argument("--eval-every", type=int, default=100)
    ap.add_argument("--keep-head", action="store_true",
                    help="train through --init's own draft_vocab.json instead of re-choosing "
                         "the head on the new data (a small fine-tuning set)")
    args = ap.parse_args()
    # checked before the target loads, so a wrong --init costs nothing
    head_ids = draft_vocab.read(args.init) if args.keep_head else None
    if args.keep_head and head_ids is None:
        print(f"error: --keep-head: {args.init} has no draft_vocab.json", file=sys.stderr)
        raise SystemExit(2)

    log(f"mlx {mx.__version__} on {mx.default_device()}")
    target, tok = load_demo_feature_target()
    draft = load_draft(args.init)
    draft.set_dtype(mx.float32)  # exported drafts are bf16; train in full precision
    check_pair(target, draft.config)
    target.set_taps(draft.config.target_layer_ids)
    draft.bind(target)

    feats = args.out / "features"
    if not list(feats.glob("shard_*.npz")):
        distill(target, tok, feats, minutes=args.distill_minutes, seed=args.seed,
                chunk=args.chunk, batch=args.batch, max_tokens=args.max_tokens)
    shards, held = split_heldout(load_shards(feats), args.heldout)
    log(f"training on {sum(len(s.tokens) for s in shards)} tokens, "
        f"{sum(len(h.tokens) for h in held)} held out")

    tc = TrainConfig(steps=args.steps or 100_000, minutes=0 if args.steps else args.train_minutes,
                     lr=args.lr, warmup=args.warmup,
                     seqs_per_step=args.seqs, anchors_per_seq=args.anchors, head_vocab=8192,
                     head_ids=head_ids, eval_every=args.eval_every, checkpoint_every=args.eval_every,
                     eval_blocks=4096, seed=args.seed)
    # the trainer's own held-out blocks, scored before any step: the start's τ
    tau0, _ = heldout_tau(draft, run_batches(held, draft.config, tc), tc.eval_block_size)
    walk0 = walk_tau(draft, held, tc.eval_block_size)
    log(f"start ({args.init.name}): held-out τ@{tc.eval_block_size} {tau0:.3f} per block, "
        f"{walk0:.3f} decoding (full head)")
    for ev in train(draft, shards, held, args.out / "draft", tc):
        acc = " ".join(f"{a:.3f}" for a in ev.slot_accuracy)
        log(f"step {ev.step}/{ev.total_steps} loss {ev.loss:.4f} lr {ev.lr:.2e} labels/s "
            f"{ev.tokens_per_s:.0f} heldout_tau {ev.heldout_tau:.3f} walk_tau "
            f"{ev.heldout_walk_tau:.3f} slot_acc {acc}"
            + (" (saved)" if ev.checkpoint else ""))


if __name__ == "__main__":
    main()
