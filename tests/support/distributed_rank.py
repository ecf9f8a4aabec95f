"""One rank of the distributed tests (tests/test_distributed.py); also runs alone (one rank).

    python distributed_rank.py SPEC.json OUT_DIR

SPEC: {"cases": [{"name", "target", "draft", "prompt": [ids], "block_size", "max_tokens",
"temp", "seed"}], "taps": [[target, draft]], "forever": bool}. Every rank writes
OUT_DIR/rank{r}.json ({case name: token ids, name/drafted: per round}), OUT_DIR/meta{r}.json (group size,
parameters held per target) and OUT_DIR/taps-{i}-rank{r}.npy, head-{i}-rank{r}.npy (the
target's taps over the first case's prompt, the borrowed head on the first tap); with "forever" it generates until interrupted, after
writing OUT_DIR/pid{r} and OUT_DIR/started{r}.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten

from dflash_mlx.distributed import world
from dflash_mlx.generate import stream_generate
from dflash_mlx.speculate import SpeculationConfig
from dflash_mlx.loader import load


def generate(pair, case: dict) -> tuple[list[int], list[list[int]]]:
    """The emitted ids, and what the draft proposed in each round."""
    # fixed verify widths: nothing may depend on per-rank timing
    config = SpeculationConfig(block_size=case["block_size"], verify_pad={})
    out, drafted = [], []
    for ev in stream_generate(pair, case["prompt"], config, max_tokens=case["max_tokens"],
                              temperature=case.get("temp", 0.0), seed=case.get("seed")):
        out += ev.tokens
        drafted.append(ev.drafted)
    return out, drafted


def main(spec_path: str, out_dir: str) -> None:
    spec, out = json.loads(Path(spec_path).read_text()), Path(out_dir)
    group = world()
    rank, size = (0, 1) if group is None else (group.rank(), group.size())
    pairs: dict = {}

    def pair_for(target, draft):
        if (target, draft) not in pairs:
            pairs[target, draft] = load(target, draft, draft_bits=16, weights="float32")
        return pairs[target, draft]

    if spec.get("forever"):
        case = spec["cases"][0]
        pair = pair_for(case["target"], case["draft"])
        (out / f"pid{rank}").write_text(str(os.getpid()))
        (out / f"started{rank}").write_text("1")
        while True:
            generate(pair, case)
    results = {}
    for c in spec["cases"]:
        results[c["name"]], results[c["name"] + "/drafted"] = generate(
            pair_for(c["target"], c["draft"]), c)
    for i, (target, draft) in enumerate(spec.get("taps", [])):
        pair = pair_for(target, draft)
        _, taps = pair.target(mx.array([spec["cases"][0]["prompt"]]), pair.target.make_cache())
        np.save(out / f"taps-{i}-rank{rank}.npy", np.array(taps.astype(mx.float32)))
        # the LM head the draft borrows, applied to the first tap
        head = pair.target.lm_head(taps[..., : pair.target.hidden_size])
        np.save(out / f"head-{i}-rank{rank}.npy", np.array(head.astype(mx.float32)))
    (out / f"rank{rank}.json").write_text(json.dumps(results))
    # how much of each target this rank holds: proof that it was sharded at all
    held = {t: sum(v.size for _, v in tree_flatten(p.target.model.parameters()))
            for (t, _), p in pairs.items()}
    (out / f"meta{rank}.json").write_text(json.dumps({"size": size, "params": held}))


if __name__ == "__main__":
    main(*sys.argv[1:3])
