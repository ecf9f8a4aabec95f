"""One sequence's width controller replayed without noise: blind probes only, or with the cue.

A per-prompt ratio measured on a shared host moves by a few per cent from run to run, so two
rules for when one sequence speculates are compared here on replayed runs instead. For every
prompt of a file, greedy: the AR answer and the draft's block at every position
(`dflash_mlx.bench.replay.record`), then `replay_adaptive` walks them as `stream_generate`
does with this machine's pass costs (the CPU cost curve `dflash-mlx doctor` measures), whose
controller reads no clock: the rounds are the real run's (tests/test_demo_pair.py checks).
A round costs what the curve says (a plain one 1.0, a speculative one the draft pass plus a
verify pass of its rows), so a prompt's ratio is its tokens over its rounds' cost. Reported:
per prompt the ratio without and with the lookup's cue, then the mean, the lowest and how many
fall below 0.97x. Rules are chosen on the held-out file (the default), never the unseen one:

    python scripts/replay_width.py --max-tokens 32,48,64
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import dflash_mlx  # noqa: F401  (first: preloads OpenBLAS before mlx)
from dflash_mlx import registry
from dflash_mlx.atomic import write_atomic
from dflash_mlx.bench.replay import keep_joint, record, replay_adaptive
from dflash_mlx.bench.runner import load_prompt_file
from dflash_mlx.chat import apply_template
from dflash_mlx.engine import EngineSettings, open as open_engine
from dflash_mlx.errors import DFlashError

HELDOUT = Path(__file__).resolve().parent / "prompts" / "heldout-v1.jsonl"
FLOOR = 0.97
RULES = {"blind probes": False, "with the cue": True}


def ratio(rounds, costs, width) -> float:
    """Tokens per plain round's cost: AR's tokens/s is 1 in these units."""
    tokens = sum(a + 1 for _, _, a in rounds)
    cost = sum(costs.round(1, width(1 + k)) if wide else 1.0 for wide, k, _ in rounds)
    return tokens / cost


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="default: the demo pair")
    ap.add_argument("--draft", default=None)
    ap.add_argument("--prompts", type=Path, default=HELDOUT)
    ap.add_argument("--max-tokens", default="48", help="one or more, comma-separated")
    ap.add_argument("--json", type=Path, default=None, help="also write the results here")
    a = ap.parse_args()
    try:
        lengths = [int(x) for x in a.max_tokens.split(",")]
        if min(lengths) < 1:
            raise ValueError
    except ValueError:
        print(f"error: --max-tokens takes counts of 1 or more, got {a.max_tokens!r}",
              file=sys.stderr)
        raise SystemExit(2)
    try:
        spec = registry.resolve(a.model, a.draft, False)
        opened = open_engine(spec, EngineSettings(tree=0))
        texts = [t[0] for t in load_prompt_file(a.prompts)[1]]
    except DFlashError as e:
        print(f"error: {e}", file=sys.stderr)
        raise SystemExit(2)
    pair, config = opened.pair, opened.config
    costs, block = config.pass_costs, config.block_size
    if costs is None:
        print("error: no steady cost curve for this pair here: run `dflash-mlx doctor "
              "--remeasure` on an idle machine first", file=sys.stderr)
        raise SystemExit(2)
    print(f"{spec.target} + {spec.draft}: {len(texts)} prompts from {a.prompts.name}, block "
          f"{block}; pass costs " + ", ".join(f"{r} rows {c:.2f}" for r, c in costs.rows)
          + f"; draft {costs.draft:.2f}", flush=True)
    keep = lambda conf: keep_joint(conf, config.min_confidence)  # noqa: E731
    recs = [record(pair, apply_template(pair.tokenizer, [{"role": "user", "content": t}]),
                   block, max(lengths)) for t in texts]
    out = {}
    for n in lengths:
        rows = []
        for rec in recs:
            rounds = {name: replay_adaptive(rec, costs, keep, block, n, cue, config.width)
                      for name, cue in RULES.items()}
            rows.append({name: ratio(r, costs, config.width) for name, r in rounds.items()})
            rows[-1].update({f"{name} speculating": sum(w for w, _, _ in r)
                             for name, r in rounds.items()})
        print(f"\n{n} tokens: per prompt " + " / ".join(RULES))
        for i, r in enumerate(rows):
            print(f"{i:3d}  " + "  ".join(f"{r[k]:.3f}x ({r[k + ' speculating']})"
                                          for k in RULES))
        summary = {}
        for k in RULES:
            v = [r[k] for r in rows]
            summary[k] = {"mean": statistics.mean(v), "min": min(v),
                          "below_floor": sum(x < FLOOR for x in v)}
            print(f"{k:>13}: mean {summary[k]['mean']:.3f}x, lowest {summary[k]['min']:.3f}x, "
                  f"{summary[k]['below_floor']} of {len(v)} below {FLOOR}x")
        out[n] = {"rows": rows, "summary": summary}
    if a.json:
        write_atomic(a.json, json.dumps({"prompts": a.prompts.name, "by_max_tokens": out},
                                        indent=1))


if __name__ == "__main__":
    main()
