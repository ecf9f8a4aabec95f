"""Train the embedded demo draft for SmolLM2-135M-Instruct (see dflash_mlx/demo/draft/README.md).

Usage: python scripts/train_demo_draft.py FEATURES_DIR OUT_DIR [--steps N] [--layers 2] [--resume]
"""

import argparse
import sys

import dflash_mlx  # noqa: F401  (first: preloads OpenBLAS before mlx)
import mlx.core as mx

from dflash_mlx.demo.target import demo_target_path
from dflash_mlx.models.dflash import DFlashDraftModel
from dflash_mlx.gguf.reader import load_gguf
from dflash_mlx.loader import convert_weights
from dflash_mlx.models.target import Target
from dflash_mlx.train.config import TrainConfig
from dflash_mlx.train.trainer import new_draft_config, pick_mask_token, train
from dflash_mlx.train.data import load_shards, split_heldout


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("features")
    ap.add_argument("out")
    ap.add_argument("--steps", type=int, default=4000)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--lr", type=float, default=6e-4)
    ap.add_argument("--seqs", type=int, default=2)
    ap.add_argument("--anchors", type=int, default=24)
    ap.add_argument("--heldout", type=int, default=24)
    ap.add_argument("--resume", action="store_true")
    args = ap.parse_args()
    model, tok = load_gguf(demo_target_path())
    convert_weights(model, mx.float32)
    target = Target(model)
    cfg = new_draft_config(target, num_layers=args.layers, block_size=8,
                           mask_token_id=pick_mask_token(tok))
    target.set_taps(cfg.target_layer_ids)
    mx.random.seed(0)
    draft = DFlashDraftModel(cfg).bind(target)
    shards, held = split_heldout(load_shards(args.features), args.heldout)
    n_tok = sum(len(s.tokens) for s in shards)
    print(f"train tokens {n_tok}, held-out tokens {len(held[0].tokens)}", file=sys.stderr)
    tc = TrainConfig(steps=args.steps, lr=args.lr, seqs_per_step=args.seqs,
                     anchors_per_seq=args.anchors, eval_every=100, checkpoint_every=200)
    for ev in train(draft, shards, held, args.out, tc, resume=args.resume):
        acc = " ".join(f"{a:.2f}" for a in ev.slot_accuracy)
        print(f"step {ev.step} loss {ev.loss:.3f} lr {ev.lr:.2e} labels/s {ev.tokens_per_s:.0f} "
              f"heldout_tau@5 {ev.heldout_tau:.3f} slot_acc [{acc}]"
              + (f" saved {ev.checkpoint}" if ev.checkpoint else ""), file=sys.stderr, flush=True)


if __name__ == "__main__":
    main()
