"""Verify padding, side by side: AR, DFlash unpadded and DFlash padded on the same prompts.

Padding (`SpeculationConfig.verify_pad`, see `cpu/cost.py` `CostCurve.pads`) changes only what
a verify pass costs, so the three runs of a prompt must give the same tokens; what differs is time. Runs of
one prompt follow each other in a rotating order (AR, unpadded, padded; then unpadded, padded,
AR; ...), so drift on a noisy machine lands on all three alike. Reports the median per-prompt
speedup of each DFlash variant over AR, how often padding won, and the median verify time of
each width inside the decode loop.

    python scripts/ab_verify_pad.py [--model M --draft D] [--items 1-2] [--max-tokens 128]
        [--block-size 5] [--repeats 2]
"""

from __future__ import annotations

import argparse
import statistics
import sys

import dflash_mlx  # noqa: F401  (first: preloads OpenBLAS before mlx)

from dflash_mlx import registry
from dflash_mlx.chat import encoder
from dflash_mlx.engine import EngineSettings, open as open_engine
from dflash_mlx.bench.runner import DATASETS, generate_once, load_prompts
from dflash_mlx.errors import DFlashError

SAMPLING = {"max_tokens": 128, "temperature": 0.0, "top_p": 1.0, "top_k": 0, "seed": 0}


def _fail(message: str):
    print(f"error: {message}", file=sys.stderr)
    raise SystemExit(2)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model")
    ap.add_argument("--draft")
    ap.add_argument("--items", default="1-2", help="1-based item range of each bundled set")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--block-size", type=int, default=5)
    ap.add_argument("--repeats", type=int, default=2, help="rotations per prompt")
    a = ap.parse_args()
    try:
        lo, hi = (int(x) for x in a.items.split("-"))
        if not 1 <= lo <= hi or a.repeats < 1 or a.max_tokens < 1:
            raise ValueError
    except ValueError:
        _fail("--items takes FIRST-LAST (1-based); --repeats and --max-tokens at least 1")
    try:
        opened = open_engine(registry.resolve(a.model, a.draft, False),
                             EngineSettings(block_size=a.block_size, tree=0))
    except DFlashError as e:
        _fail(str(e))
    pair, base = opened.pair, opened.config
    pads = dict(base.verify_pad)
    if not pads:
        _fail("this machine's cost curve pads no verify width: nothing to compare")
    sampling = {**SAMPLING, "max_tokens": a.max_tokens}
    encode = encoder(pair, {})
    systems = {"ar": (1, {}), "unpadded": (a.block_size, {}), "padded": (a.block_size, pads)}
    order = list(systems)
    ratios = {"unpadded": [], "padded": []}
    widths = {"unpadded": {}, "padded": {}}
    wins = n = 0
    warm = encode([{"role": "user", "content": "Hi"}])
    configs = {name: base.replace(verify_pad=pad) for name, (_, pad) in systems.items()}
    for system, (block, _) in systems.items():  # first calls compile and allocate
        generate_once(pair, warm, block, {**sampling, "max_tokens": 8}, configs[system])
    print(f"pads {pads}; cut {base.min_confidence}; block {a.block_size}; "
          f"{a.max_tokens} tokens; {a.repeats} rotations per prompt")
    for name in DATASETS:
        for i, turns in enumerate(load_prompts(name)[1][lo - 1: hi], start=lo):
            ids = encode([{"role": "user", "content": turns[0]}])
            for _ in range(a.repeats):
                runs = {}
                for system in order:
                    block = systems[system][0]
                    runs[system] = generate_once(pair, ids, block, sampling, configs[system])
                order = order[1:] + order[:1]
                if not runs["ar"].tokens == runs["unpadded"].tokens == runs["padded"].tokens:
                    _fail(f"{name} #{i}: the three runs gave different tokens")
                for system in ratios:
                    ratios[system].append(runs["ar"].tpot / runs[system].tpot)
                    for ev in runs[system].events:
                        widths[system].setdefault(ev.block_size, []).append(ev.verify_s)
                wins += ratios["padded"][-1] > ratios["unpadded"][-1]
                n += 1
                print(f"{name} #{i}: unpadded {ratios['unpadded'][-1]:.3f}×  "
                      f"padded {ratios['padded'][-1]:.3f}×", flush=True)
    for system in ratios:
        ms = " ".join(f"{w}:{statistics.median(v) * 1e3:.1f}"
                      for w, v in sorted(widths[system].items()))
        print(f"{system:8s} median speedup {statistics.median(ratios[system]):.3f}×; "
              f"verify ms by width (rounds) {ms}")
    print(f"padded faster in {wins} of {n} runs")


if __name__ == "__main__":
    main()
