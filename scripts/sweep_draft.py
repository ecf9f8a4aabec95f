"""Draft capacity and schedule at equal compute, scored on a held-out source.

    python scripts/sweep_draft.py --features F --heldout-features H --minutes 9 --out DIR \
        [--variants depth2 depth4 ...] [--reference DRAFT] [--score-only] [-- train-draft flags]

Every variant is `dflash-mlx train-draft` from scratch on the same features, for the same
wall-clock minutes (`--minutes`: the step count and cosine schedule fit the clock, so a deeper
draft takes fewer steps), held out by source (`--heldout-features`: answers to prompts of a
family the training data lacks, e.g. `scripts/prompts/heldout-v1.jsonl` through
`scripts/build_demo_features.py --prompts-file`). Each is then scored on every held-out answer:

- τ at block 5 walked the way greedy decoding goes (eval.walk_runs: no lookup, no cut, the draft
  alone), pooled over all rounds;
- its difference from the first variant, with a 95% interval from resampling whole answers
  (the same resamples for every variant, so the comparison is paired);
- τ per block at uniform anchors, at block 5.

`--reference DRAFT` scores a finished draft (the shipped one) in the same table. Writes
DIR/sweep.json and prints a table. On a GPU pass bigger batches after `--`
(`-- --seqs 32 --anchors 64`).
"""

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import dflash_mlx  # noqa: F401  (first: preloads OpenBLAS before mlx)
from dflash_mlx.errors import DFlashError

import mlx.core as mx
import numpy as np

VARIANTS = {  # name: train-draft flags (the default draft block is 8)
    "depth4": ["--layers", "4"],
    "depth2": ["--layers", "2"],
    "depth6": ["--layers", "6"],
    "block16": ["--layers", "4", "--block-size", "16"],
    "soft0.5": ["--layers", "4", "--soft-labels", "0.5"],
    "half-data": ["--layers", "4"],  # every other shard of --features
}
RESAMPLES = 2000


def half_features(features: Path, out: Path) -> Path:
    """A folder linking every other shard of `features` (and its features.json)."""
    out.mkdir(parents=True, exist_ok=True)
    for f in out.iterdir():
        f.unlink()
    (out / "features.json").symlink_to((features / "features.json").resolve())
    for i, f in enumerate(sorted(features.glob("shard_*.npz"))[::2]):
        (out / f"shard_{i:04d}.npz").symlink_to(f.resolve())
    return out


def train(name: str, args, extra: list[str]) -> None:
    out = args.out / name
    features = args.features
    if name == "half-data":
        features = half_features(args.features, args.out / "half-features")
    model = ["--model", args.model] if args.model else []
    cmd = ["dflash-mlx", "train-draft", *model, "--out", str(out), "--features", str(features),
           "--heldout-features", str(args.heldout_features), "--minutes", str(args.minutes),
           "--steps", "100000", "--seed", str(args.seed), *VARIANTS[name], *extra]
    print(f"[{name}] {' '.join(cmd)}", flush=True)
    with open(args.out / f"{name}.log", "w") as log:
        rc = subprocess.call(cmd, stdout=log, stderr=subprocess.STDOUT,
                             env={**os.environ, "COLUMNS": "200"})
    if rc:
        fail(f"{name} failed (exit {rc}); see {args.out / (name + '.log')}")


def score(folder: Path, target, held, block: int) -> dict:
    """Per-answer (accepted, rounds) of the greedy walk, and τ per block at uniform anchors."""
    from dflash_mlx.models import draft_vocab
    from dflash_mlx.train.eval import heldout_batches, heldout_tau, walk_counts
    from dflash_mlx.loader import load_draft

    draft = load_draft(folder)
    draft.set_dtype(mx.float32)
    draft.bind(target)
    if (folder / "draft_vocab.json").is_file():  # propose as the engine would
        draft.restrict_head(draft_vocab.read_with_coverage(folder)[0])
    per_answer = walk_counts(draft, held, block)
    batches = heldout_batches(held, draft.config, 2048, seed=7)
    return {"per_answer": per_answer, "per_block": heldout_tau(draft, batches, block)[0]}


def table(results: dict, seed: int) -> list[dict]:
    """A row per draft: τ pooled over rounds (what a benchmark of these answers reads) and its
    paired difference from the first draft, the same answer resamples for every draft."""
    counts = {n: np.array(r["per_answer"], float) for n, r in results.items()}  # (accepted, rounds)
    first = next(iter(counts))
    answers = len(counts[first])
    picks = np.random.default_rng(seed).integers(0, answers, size=(RESAMPLES, answers))

    def tau(n, idx=slice(None)):
        return 1 + counts[n][idx, 0].sum(-1) / counts[n][idx, 1].sum(-1)

    rows = []
    for n in counts:
        diff = tau(n, picks) - tau(first, picks)
        rows.append({"variant": n, "walk_tau": float(tau(n)), "per_block_tau": results[n]["per_block"],
                     "delta": float(tau(n) - tau(first)),
                     "delta_95": [float(np.percentile(diff, 2.5)), float(np.percentile(diff, 97.5))],
                     "steps": results[n].get("steps")})
    return rows


def fail(message: str):
    print(f"error: {message}", file=sys.stderr)
    raise SystemExit(2)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--features", type=Path, required=True)
    ap.add_argument("--heldout-features", type=Path, required=True)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--model", help="target (default: the demo target)")
    ap.add_argument("--minutes", type=float, default=9.0)
    ap.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    ap.add_argument("--block-size", type=int, default=5, help="block the scores are taken at")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--score-only", action="store_true", help="score the drafts OUT already holds")
    ap.add_argument("--reference", type=Path, action="append", default=[],
                    help="a finished draft to score beside the variants (repeatable)")
    args, extra = ap.parse_known_args()
    extra = [a for a in extra if a != "--"]
    for flag, folder in (("--features", args.features), ("--heldout-features", args.heldout_features)):
        if not list(folder.glob("shard_*.npz")):
            fail(f"{flag} {folder}: no feature shards (shard_*.npz) there")
    args.out.mkdir(parents=True, exist_ok=True)
    if not args.score_only:
        for name in args.variants:
            train(name, args, extra)

    from dflash_mlx.train.data import load_shards

    if args.model:
        from dflash_mlx.loader import load

        target = load(args.model, None).target
    else:
        from dflash_mlx.demo.target import load_demo_feature_target

        target = load_demo_feature_target()[0]
    held = load_shards(args.heldout_features)
    results = {}
    drafts = [(n, args.out / n) for n in args.variants]
    drafts += [("/".join(r.parts[-2:]), r) for r in args.reference]
    for name, folder in drafts:
        try:
            results[name] = score(folder, target, held, args.block_size)
        except (DFlashError, OSError) as e:  # a variant not trained yet, a wrong --reference
            fail(f"{folder}: {e}")
        state = folder / "trainer" / "state.json"
        if state.is_file():
            results[name]["steps"] = json.loads(state.read_text()).get("step")
    rows = table(results, args.seed)
    (args.out / "sweep.json").write_text(json.dumps(
        {"minutes": args.minutes, "block_size": args.block_size, "extra": extra, "rows": rows,
         "answers": sum(s.num_sequences for s in held)}, indent=2))
    print(f"{'variant':<12} {'steps':>6} {'τ walk':>7} {'Δ':>7} {'95% of Δ':>17} {'τ/block':>8}")
    for r in rows:
        lo, hi = r["delta_95"]
        print(f"{r['variant'][-12:]:<12} {r['steps'] or '-':>6} {r['walk_tau']:7.3f} {r['delta']:+7.3f} "
              f"[{lo:+.3f}, {hi:+.3f}] {r['per_block_tau']:8.3f}")


if __name__ == "__main__":
    main()
