"""Tree speculation (DDTree, `--tree N`) against one path and plain AR on the same pair, one run.

1. Slot accuracy: along each prompt's greedy answer, how often the target's token at block slot
   s is the draft's 1st, 2nd, 3rd or 4th guess there (the draft reading the target's own
   context, as in a real round), at the draft's trained width. A tree pays where the 2nd-4th
   guesses hold what the 1st misses.
2. Speed: greedy, AR, then one path (this device's defaults, and plain: no lookup, no cut) and
   trees of 8/16/32 nodes at block 5 and at the draft's trained width. Every setting runs every
   prompt in each repeat, in rotated order; τ is tokens per target pass, tokens/s the median over
   repeats of a setting's tokens over its decode seconds (prefill excluded). Outputs must equal
   AR token for token (float32); a difference is printed with its top-2 logit margin.

    python scripts/bench_tree.py                       # the demo pair, bundled prompts
    python scripts/bench_tree.py --prompts my.jsonl --repeats 5 --max-tokens 128

--prompts: JSONL, one {"prompt": ...}, {"messages": [...]} or {"turns": [...]} per line (the
first user turn is used, with the chat template as the CLI applies it). Nothing is tuned here.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import dflash_mlx  # noqa: F401  (first: preloads OpenBLAS before mlx)
import mlx.core as mx
import numpy as np
from dflash_mlx import registry, stream_generate
from dflash_mlx.bench.runner import load_prompt_file, load_prompts, logit_margin
from dflash_mlx.chat import apply_template
from dflash_mlx.engine import EngineSettings, open as open_engine
from dflash_mlx.errors import DFlashError
from dflash_mlx.models.tree import tree_forward
from dflash_mlx.speculate.proposal import slot_candidates

RANKS = 4


def default_prompts(per_set: int) -> list[str]:
    out = []
    for name in ("mt-bench", "humaneval", "gsm8k", "math500", "mbpp"):
        out += [turns[0] for turns in load_prompts(name)[1][:per_set]]
    return out


def slot_accuracy(pair, ids: list[int], answer: list[int]) -> np.ndarray:
    """(slots, RANKS) counts: the target's token at slot s was the draft's r-th guess; plus a
    last column counting the anchors tried. Teacher-forced along `answer`, one draft pass per
    anchor, the draft's cache fed the target's taps up to the anchor."""
    seq = ids + answer
    width = pair.draft.config.block_size
    _, taps = pair.target(mx.array([seq[:-1]]), pair.target.make_cache())
    cache = pair.draft.make_cache()
    mask = pair.draft.config.mask_token_id
    counts = np.zeros((width - 1, RANKS + 1), np.int64)
    fed = 0
    for anchor in range(len(ids) - 1, len(seq) - 1):
        block = mx.array([[seq[anchor]] + [mask] * (width - 1)])
        top, _ = slot_candidates(pair.draft, block, taps[:, fed:anchor], cache, RANKS)
        fed = anchor
        for s, guesses in enumerate(top.tolist()):
            if anchor + 1 + s >= len(seq):
                break
            counts[s, RANKS] += 1
            truth = seq[anchor + 1 + s]
            if truth in guesses:
                counts[s, guesses.index(truth)] += 1
    return counts


def run(pair, ids, config, n):
    """(tokens, decode seconds, rounds, branch tokens, rows the verify passes ran)."""
    tic = time.perf_counter()
    events = list(stream_generate(pair, ids, config, max_tokens=n))
    wall = time.perf_counter() - tic - events[0].prompt_s
    rows = sum(1 + e.tree_nodes if e.tree_nodes else config.width(e.block_size) for e in events)
    return ([t for e in events for t in e.tokens], wall, len(events),
            sum(e.branch_tokens for e in events), rows)


class PassCost:
    """Fastest of `reps` timings of one target pass (or draft pass) after `ids`: on a shared
    machine the minimum is what the pass costs, the rest is waiting for a core."""

    def __init__(self, pair, ids: list[int], reps: int):
        self.pair, self.ids, self.reps, self.memo = pair, ids, reps, {}
        self.cache = pair.target.make_cache()
        _, taps = pair.target(mx.array([ids[:-1]]), self.cache)
        self.dcache = pair.draft.make_cache()
        pair.draft.absorb_context(taps, self.dcache)
        mx.eval([c.state for c in self.cache])

    def _best(self, fn) -> float:
        base, times = len(self.ids) - 1, []
        for _ in range(self.reps):
            tic = time.perf_counter()
            mx.eval(fn())
            times.append(time.perf_counter() - tic)
            self.pair.target.truncate(self.cache, base)
        return min(times)

    def verify(self, rows: int, tree: bool, taps: bool = True) -> float:
        key = (rows, tree, taps)
        if key not in self.memo:
            last, target = self.ids[-1], self.pair.target
            vis = np.tril(np.ones((rows, rows), bool))  # a chain costs what any tree of as
            # many rows does

            def one_pass():
                if tree:
                    out = tree_forward(target, [last] * rows, list(range(rows)), vis, self.cache)
                else:
                    out = target(mx.array([[last] * rows]), self.cache, taps=taps)
                return out[0].argmax(-1)

            self.memo[key] = self._best(one_pass)
        return self.memo[key]

    def draft(self, width: int, k: int) -> float:
        """The draft pass: top-k candidates per slot (k=1: a path's argmax and confidence)."""
        block = mx.array([[self.ids[-1]] + [self.pair.draft.config.mask_token_id] * (width - 1)])
        return self._best(lambda: slot_candidates(self.pair.draft, block, None, self.dcache, k))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="default: the demo pair")
    ap.add_argument("--draft", default=None)
    ap.add_argument("--prompts", type=Path, default=None)
    ap.add_argument("--per-set", type=int, default=1, help="bundled items per set (no --prompts)")
    ap.add_argument("--num-prompts", type=int, default=None, help="use only the first N prompts")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--budgets", default="8,16,32")
    ap.add_argument("--blocks", default=None,
                    help="block sizes, comma-separated (default: 5 and the draft's trained width)")
    ap.add_argument("--no-plain", action="store_true",
                    help="skip the path without lookup and cut (fewer settings, faster)")
    ap.add_argument("--cost-reps", type=int, default=15, help="timings per pass (the fastest)")
    ap.add_argument("--json", type=Path, default=None, help="also write the results here")
    a = ap.parse_args()
    try:
        spec = registry.resolve(a.model, a.draft, False)
        opened = open_engine(spec, EngineSettings(tree=0))
        pair = opened.pair
        texts = ([t[0] for t in load_prompt_file(a.prompts)[1]] if a.prompts
                 else default_prompts(a.per_set))[: a.num_prompts]
        trained = pair.draft.config.block_size
        blocks = [int(b) for b in a.blocks.split(",")] if a.blocks else sorted({5, trained})
        defaults = {b: opened.config.replace(block_size=b) for b in blocks}
    except DFlashError as e:
        print(f"error: {e}", file=sys.stderr)
        raise SystemExit(2)
    prompts = [apply_template(pair.tokenizer, [{"role": "user", "content": t}]) for t in texts]
    budgets = [int(b) for b in a.budgets.split(",")]
    settings = {"AR": defaults[blocks[0]].replace(block_size=1)}
    for b, cfg in defaults.items():
        settings[f"B{b} path"] = cfg
        if not a.no_plain:
            settings[f"B{b} path plain"] = cfg.replace(lookup=False, min_confidence=0.0)
        for n in budgets:
            settings[f"B{b} tree {n}"] = cfg.replace(tree=n)
    print(f"{spec.target} + {spec.draft}: {len(prompts)} prompts, {a.max_tokens} tokens, "
          f"{a.repeats} repeats, weights {pair.weights}, device {mx.default_device()}", flush=True)

    answers: dict[int, list[int]] = {}
    tps: dict[str, list[float]] = {k: [] for k in settings}
    tau: dict[str, tuple[int, int, int]] = {}
    diffs: list[str] = []
    names = list(settings)
    for rep in range(a.repeats):
        totals = {k: [0, 0.0, 0, 0, 0] for k in settings}  # tokens, s, rounds, branch, rows
        for i, ids in enumerate(prompts):
            shift = (rep * len(prompts) + i) % len(names)
            for name in ["AR"] + [k for k in names[shift:] + names[:shift] if k != "AR"]:
                toks, secs, rounds, branch, rows = run(pair, ids, settings[name], a.max_tokens)
                if name == "AR":
                    answers.setdefault(i, toks)
                elif toks != answers[i] and rep == 0:
                    k = next((j for j, (x, y) in enumerate(zip(toks, answers[i])) if x != y),
                             min(len(toks), len(answers[i])))
                    m = (logit_margin(pair, ids + answers[i][:k], answers[i][k], toks[k])
                         if k < min(len(toks), len(answers[i])) else float("nan"))
                    diffs.append(f"{name} prompt {i}: differs at {k} (top-2 margin {m:.4g})")
                for j, v in enumerate((len(toks), secs, rounds, branch, rows)):
                    totals[name][j] += v
        for name, (toks, secs, rounds, branch, rows) in totals.items():
            tps[name].append(toks / secs)
            tau[name] = (toks, rounds, branch, rows)
        print(f"repeat {rep + 1}: " + ", ".join(f"{k} {v[-1]:.1f}" for k, v in tps.items()),
              flush=True)

    counts = sum(slot_accuracy(pair, ids, answers[i]) for i, ids in enumerate(prompts))
    print(f"\nSlot accuracy (trained width {trained}; % of anchors where the target's token is "
          "the draft's r-th guess)")
    print("slot  " + "  ".join(f"r{r + 1:<5}" for r in range(RANKS)) + "  top-4  anchors")
    for s, row in enumerate(counts):
        pct = 100 * row[:RANKS] / max(row[RANKS], 1)
        print(f"{s + 1:>4}  " + "  ".join(f"{p:5.1f}%" for p in pct)
              + f"  {pct.sum():5.1f}%  {row[RANKS]}")

    # the cost model: per setting, its mean verify rows and a draft pass, each timed alone
    cost = PassCost(pair, prompts[0] + answers[0][:16], a.cost_reps)
    step = cost.verify(1, tree=False, taps=False)  # an AR step (no draft: no taps)
    ar = statistics.median(tps["AR"])
    print(f"\nSpeed: measured = median of {a.repeats} repeats (AR {ar:.1f} tok/s); model = τ / "
          f"(draft pass + verify pass of the setting's mean rows), each the fastest of "
          f"{a.cost_reps} (AR step {step * 1e3:.1f} ms); host work per round not included")
    print(f"{'setting':<18} {'tau':>5} {'rows':>5} {'tok/s':>7} {'vs AR':>6} {'model':>6} "
          f"{'branch':>7}")
    rows = []
    for name, cfg in settings.items():
        toks, rounds, branch, n_rows = tau[name]
        med, mean_rows = statistics.median(tps[name]), n_rows / rounds
        if name == "AR":
            model = 1.0
        else:
            width = cfg.block_size
            secs = (cost.draft(width, cfg.tree or 1)
                    + cost.verify(round(mean_rows), tree=bool(cfg.tree)))
            model = toks / rounds * step / secs
        rows.append({"setting": name, "tau": toks / rounds, "mean_rows": mean_rows, "tps": med,
                     "vs_ar": med / ar, "model_vs_ar": model, "branch_tokens": branch,
                     "tps_runs": tps[name]})
        print(f"{name:<18} {toks / rounds:5.2f} {mean_rows:5.1f} {med:7.1f} {med / ar:5.2f}x "
              f"{model:5.2f}x {branch:7d}", flush=True)
    print("\n" + ("\n".join(diffs) if diffs else "every output equals AR token for token"))
    if a.json:
        a.json.write_text(json.dumps({"rows": rows, "slot_counts": counts.tolist(),
                                      "differences": diffs}, indent=1))


if __name__ == "__main__":
    main()
