"""Tiny training setups: a target on disk, features for it, and `train-draft` command lines that
train for a couple of steps in about a second."""

from __future__ import annotations

import random
from pathlib import Path

import numpy as np


def tiny_features(root: Path, sequences: int = 24, length: int = 40) -> tuple[Path, Path]:
    """(target folder, features folder): teacher-forced random text through a tiny qwen3, with
    the taps `train-draft` picks for it."""
    from dflash_mlx import load, tiny
    from dflash_mlx.train.data import extract_features
    from dflash_mlx.train.trainer import new_draft_config, pick_mask_token

    target = tiny.make_target(root / "target")
    pair = load(target, None, weights="float32")
    cfg = new_draft_config(pair.target, num_layers=1, mask_token_id=pick_mask_token(pair.tokenizer))
    pair.target.set_taps(cfg.target_layer_ids)
    rng = random.Random(0)
    texts = ([rng.randrange(256) for _ in range(length)] for _ in range(sequences))
    extract_features(pair.target, texts, root / "features")
    return target, root / "features"


def train_args(target: Path, features: Path, out: Path, *extra) -> list[str]:
    """A `train-draft` command line: 2 steps of a 1-layer draft, block 4, no restricted head."""
    args = ["train-draft", "--model", target, "--features", features, "--out", out,
            "--steps", 2, "--heldout", 2, "--layers", 1, "--block-size", 4, "--vocab", 0,
            "--seqs", 1, "--anchors", 4, *extra]
    return [str(a) for a in args]


def checkpoint_files(out: Path) -> dict[str, bytes]:
    """Every file of a checkpoint folder (features aside), by relative path."""
    return {str(p.relative_to(out)): p.read_bytes() for p in sorted(out.rglob("*"))
            if p.is_file() and "features" not in p.relative_to(out).parts}


def saved_weights_are_finite(path: Path) -> bool:
    import mlx.core as mx

    return all(np.isfinite(np.array(w.astype(mx.float32))).all()
               for w in mx.load(str(path)).values())


def leftovers(folder: Path) -> list[str]:
    """Temporary files an interrupted write would leave behind."""
    return sorted(str(p.relative_to(folder)) for p in Path(folder).rglob("*")
                  if ".tmp" in p.name or p.name.endswith(".part") or p.name.startswith(".probe."))
