"""Copy a trained draft checkpoint into the package as the embedded demo draft.

Usage: python scripts/export_demo_draft.py CHECKPOINT_DIR FEATURES_DIR [--out dflash_mlx/demo/draft]

Writes config.json, model.safetensors (z-lab key names; bf16, matrices stored 8-bit by default
to stay small) and draft_vocab.json (the restricted proposal head: the checkpoint's own when it
was trained through one, else the 8,192 most frequent target predictions of the features).
"""

import argparse
import json
import shutil
from pathlib import Path

import dflash_mlx  # noqa: F401  (first: preloads OpenBLAS before mlx)
import mlx.core as mx

from dflash_mlx.models import draft_vocab
from dflash_mlx.train.data import load_shards


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("checkpoint", type=Path)
    ap.add_argument("features", type=Path)
    ap.add_argument("--out", type=Path, default=Path("dflash_mlx/demo/draft"))
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--bits", type=int, choices=(0, 4, 8), default=8,
                    help="store matrices quantized at these bits (0: plain bf16)")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    cfg = json.loads((args.checkpoint / "config.json").read_text())
    cfg["dtype"] = "bfloat16"
    weights = mx.load(str(args.checkpoint / "model.safetensors"))
    weights = {k: v.astype(mx.bfloat16) for k, v in weights.items()}
    if args.bits:
        # matrices stored quantized (mlx layout) to keep the package small; the engine
        # dequantizes at load and then applies its own --draft-bits
        cfg["quantization"] = {"group_size": 64, "bits": args.bits}
        for k in [k for k, v in weights.items() if k.endswith(".weight") and v.ndim == 2]:
            base = k[: -len(".weight")]
            weights[k], weights[base + ".scales"], weights[base + ".biases"] = mx.quantize(
                weights[k], group_size=64, bits=args.bits)
    mx.save_safetensors(str(args.out / "model.safetensors"), weights, metadata={"format": "mlx"})
    (args.out / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    state = args.checkpoint / "trainer" / "state.json"
    if state.exists():
        shutil.copy(state, args.out / "training_log.json")
    trained = draft_vocab.read_with_coverage(args.checkpoint)
    if trained is not None:
        # trained through this restricted head: ship exactly the ids it was trained on
        shutil.copy(args.checkpoint / draft_vocab.FILENAME, args.out / draft_vocab.FILENAME)
        ids, coverage = trained
    else:
        ids, coverage = draft_vocab.most_frequent((s.preds for s in load_shards(args.features)),
                                                  args.vocab, vocab_size=cfg["vocab_size"])
        draft_vocab.save(args.out, ids, coverage,
                         f"top {args.vocab} target predictions of the training features")
    print(f"exported to {args.out}: {len(weights)} tensors, vocab {len(ids)} covers {coverage:.2%}")


if __name__ == "__main__":
    main()
