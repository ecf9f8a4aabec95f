"""Per prompt: the load-adaptive width against fixed-width speculation and plain AR, one run.

For every prompt of a file, greedy, the demo pair (or --model/--draft) with this device's
defaults: AR (block 1), DFlash at a fixed width (`--fixed-width`) and DFlash adaptive (the
default). Each repeat runs the settings on the prompt in rotated order; a setting's
tokens/s on a prompt is the median over repeats of its tokens over its decode seconds
(prefill excluded), or with `--stat fastest` its tokens over its least decode seconds (noise
on a shared host only ever adds time, so the least of several runs is the steadiest estimate
of a deterministic run's cost). Reported: per prompt the ratio to AR, then the mean of the
ratios, the lowest, and how many prompts fall below 0.97x. Outputs must equal AR token for token.
`--control` also runs AR a second time as its own setting: its ratio to the first AR is this
host's noise on a per-prompt ratio (how many prompts fall below 0.97x with no change at all).

The rule's constants are chosen on the held-out file (the default); the unseen file only
reports:

    python scripts/bench_adaptive.py --max-tokens 64 --repeats 3          # held-out: choose
    python scripts/bench_adaptive.py --prompts scripts/prompts/unseen-v1.jsonl   # report
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import dflash_mlx  # noqa: F401  (first: preloads OpenBLAS before mlx)
from dflash_mlx import registry, stream_generate
from dflash_mlx.bench.runner import load_prompt_file
from dflash_mlx.atomic import write_atomic
from dflash_mlx.chat import apply_template
from dflash_mlx.engine import EngineSettings, open as open_engine
from dflash_mlx.errors import DFlashError

HELDOUT = Path(__file__).resolve().parent / "prompts" / "heldout-v1.jsonl"
FLOOR = 0.97


def run(pair, ids, config, n):
    """(tokens, decode seconds, rounds that speculated, rounds)."""
    tic = time.perf_counter()
    events = list(stream_generate(pair, ids, config, max_tokens=n))
    secs = time.perf_counter() - tic - events[0].prompt_s
    return ([t for e in events for t in e.tokens], secs,
            sum(e.block_size > 1 for e in events), len(events))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="default: the demo pair")
    ap.add_argument("--draft", default=None)
    ap.add_argument("--prompts", type=Path, default=HELDOUT)
    ap.add_argument("--num-prompts", type=int, default=None, help="only the first N prompts")
    ap.add_argument("--skip", type=int, default=0, help="start at prompt K (counted from 0)")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json", type=Path, default=None, help="also write the results here")
    ap.add_argument("--control", action="store_true",
                    help="also run AR again: the noise of a per-prompt ratio on this host")
    ap.add_argument("--stat", choices=("median", "fastest"), default="median",
                    help="a setting's tokens/s on a prompt: over its median or its least seconds")
    ap.add_argument("--no-fixed", action="store_true", help="leave the fixed-width setting out")
    a = ap.parse_args()
    if a.skip < 0 or (a.num_prompts is not None and a.num_prompts < 1):
        print("error: --skip must be 0 or more and --num-prompts 1 or more", file=sys.stderr)
        raise SystemExit(2)
    try:
        spec = registry.resolve(a.model, a.draft, False)
        opened = open_engine(spec, EngineSettings(tree=0))
        texts = [t[0] for t in load_prompt_file(a.prompts)[1]][a.skip:][: a.num_prompts]
    except DFlashError as e:
        print(f"error: {e}", file=sys.stderr)
        raise SystemExit(2)
    pair, config = opened.pair, opened.config
    settings = {"AR": config.replace(block_size=1), "fixed": config.replace(adaptive=False),
                "adaptive": config.replace(adaptive=True)}
    if a.no_fixed:
        del settings["fixed"]
    if a.control:
        settings["AR again"] = settings["AR"]
    names = list(settings)
    compared = names[1:]
    print(f"{spec.target} + {spec.draft}: {len(texts)} prompts from {a.prompts.name}, "
          f"{a.max_tokens} tokens, {a.repeats} repeats ({a.stat}), block {config.block_size}",
          flush=True)
    costs = config.pass_costs
    print("pass costs: " + ("none (round seconds are timed)" if costs is None else
          ", ".join(f"{r} rows {c:.2f}" for r, c in costs.rows) + f"; draft {costs.draft:.2f}"),
          flush=True)
    pick = max if a.stat == "fastest" else statistics.median  # the most tok/s: least seconds
    rows, diffs = [], 0
    for i, text in enumerate(texts, start=a.skip):
        ids = apply_template(pair.tokenizer, [{"role": "user", "content": text}])
        tps = {k: [] for k in names}
        spec_share, ref = [], None
        for rep in range(a.repeats):
            shift = (rep + i) % len(names)
            for name in names[shift:] + names[:shift]:
                toks, secs, wide, rounds = run(pair, ids, settings[name], a.max_tokens)
                tps[name].append(len(toks) / secs)
                ref = toks if ref is None and name == "AR" else ref
                if name == "adaptive":
                    spec_share.append(wide / rounds)
                if ref is not None and toks != ref and name != "AR":
                    diffs += 1
        med = {k: pick(v) for k, v in tps.items()}
        rows.append({"prompt": i, **{f"{k}_tps": round(v, 2) for k, v in med.items()},
                     **{f"{k}_vs_ar": med[k] / med["AR"] for k in compared},
                     "adaptive_speculating": statistics.mean(spec_share)})
        r = rows[-1]
        print(f"{i:3d}  AR {med['AR']:5.1f}  " + "  ".join(
            f"{k} {r[f'{k}_vs_ar']:.3f}x" for k in compared)
            + f"  (adaptive speculating {100 * r['adaptive_speculating']:.0f}% of rounds)",
            flush=True)
    summary = {}
    for k in compared:
        ratios = [r[f"{k}_vs_ar"] for r in rows]
        summary[k] = {"mean": statistics.mean(ratios), "min": min(ratios),
                      "below_floor": sum(x < FLOOR for x in ratios)}
        print(f"{k:>8}: mean {summary[k]['mean']:.3f}x, lowest {summary[k]['min']:.3f}x, "
              f"{summary[k]['below_floor']} of {len(ratios)} prompts below {FLOOR}x")
    print(f"outputs differing from AR: {diffs}")
    if a.json:
        write_atomic(a.json, json.dumps({
            "prompts": str(a.prompts.name), "max_tokens": a.max_tokens, "repeats": a.repeats,
            "stat": a.stat, "rows": rows, "summary": summary, "outputs_differing": diffs},
            indent=1))


if __name__ == "__main__":
    main()
