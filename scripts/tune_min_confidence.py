"""Choose `--min-confidence` for a pair on this machine, by simulation on held-aside prompts.

Cutting unsure draft slots never changes the output, only what a round costs and how many
tokens it yields, so greedy decoding can be replayed exactly for any cut:

1. For each prompt (first turns of items 3-7 of every bundled set by default: never the first
   two, which `benchmark --num-prompts 2` reports), decode the AR greedy answer.
2. One teacher-forced target pass gives the taps of the whole sequence; at every position the
   draft proposes a block from exactly the context a real round would have, and we record
   each slot's token and probability.
3. Time on this machine one AR step, a verify pass of each width 1..B, and a draft pass:
   by default the medians of real decoding rounds of each set's first item (`--costs rounds`),
   or each pass timed alone (`--costs passes`).
4. Replay (`dflash_mlx.bench.replay`, like the records of 2): a round at position i merges the
   context lookup into the block as the engine does (`proposal.py`; or not, for the rows "no
   lookup"), keeps k slots (by the rule), accepts the leading ones that match the greedy
   answer, moves on by that + 1, and costs draft + verify(k + 1), padded as the engine pads
   here (`SpeculationConfig.verify_pad`). Simulated speedup = AR time / DFlash time.
   tests/test_demo_pair.py checks the replayed rounds against a real run.

Three rules: `joint` (the engine's: keep slots while the product of their probabilities stays
>= P), `slot` (each slot's own probability >= P, the engine's rule before) and `cost` (keep
the slots that maximise the expected tokens per second under the timed passes, taking the
draft's probabilities at their word; not in the engine).

    python scripts/tune_min_confidence.py [--model M --draft D] [--items 3-7 | --prompts FILE]
        [--block-size 5]
        [--max-tokens 64] [--costs rounds|passes] [--no-pad-verify] [--json out.json]
        [--records out.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import dflash_mlx  # noqa: F401  (first: preloads OpenBLAS before mlx)
import mlx.core as mx

from dflash_mlx import registry, stream_generate
from dflash_mlx.bench.replay import keep_joint, record, replay  # keep_joint: the engine's rule
from dflash_mlx.bench.runner import DATASETS, load_prompt_file, load_prompts
from dflash_mlx.chat import encoder
from dflash_mlx.engine import EngineSettings, open as open_engine
from dflash_mlx.errors import DFlashError
from dflash_mlx.speculate.proposal import propose

THRESHOLDS = (0.0, 0.03, 0.05, 0.08, 0.1, 0.12, 0.15, 0.2, 0.25, 0.3, 0.4, 0.5)


def costs(pair, config, seq: list[int], block: int, reps: int = 9) -> tuple[float, float, dict]:
    """(AR step, draft pass, {width: verify pass}) in seconds, at the context of `seq`.

    The passes are timed round-robin and each one's median is kept, so a burst of load on a
    noisy machine lands on all of them alike. Widths go up to the widest pass a round of
    `block` runs as (`config.verify_pad`).
    """
    widest = max(config.width(w) for w in range(1, block + 1))
    tgt, draft = pair.target, pair.draft
    cache = tgt.make_cache()
    base = len(seq) - block
    _, taps = tgt(mx.array([seq[:base]]), cache, taps=True)
    mx.eval(taps)
    dcache = draft.make_cache()
    mx.eval(draft(mx.array([[seq[base - 3]]]), taps[:, : base - 3], dcache))  # context only
    blk = mx.array([[seq[base]] + [draft.config.mask_token_id] * (block - 1)])

    def target_pass(w: int, with_taps: bool):
        logits, t = tgt(mx.array([seq[base: base + w]]), cache, taps=with_taps)
        mx.eval(logits, *([] if t is None else [t]))
        tgt.truncate(cache, base)

    def draft_pass():  # a typical round: two new context rows, then a proposal
        tokens = propose(draft, blk, taps[:, base - 3: base - 1], dcache, confidence=True)[0]
        mx.eval(tokens)
        for c in dcache:
            c.trim(2)

    passes = {"ar": lambda: target_pass(1, False), "draft": draft_pass}
    passes.update({w: (lambda w=w: target_pass(w, True)) for w in range(1, widest + 1)})
    times = {key: [] for key in passes}
    for rep in range(reps + 1):
        for key, fn in passes.items():
            tic = time.perf_counter()
            fn()
            if rep:  # the first sweep warms up
                times[key].append(time.perf_counter() - tic)
    med = {key: statistics.median(v) for key, v in times.items()}
    return med.pop("ar"), med.pop("draft"), med


def round_costs(pair, config, prompts: list[list[int]], block: int, max_tokens: int,
                passes: tuple[float, float, dict]) -> tuple[float, float, dict]:
    """(AR step, draft pass, {width: verify pass}): medians over real decoding rounds of
    `prompts` (AR, then DFlash at the pair's own cut), padding and all.

    Inside the decode loop a width can cost other than timed alone: with OpenBLAS here a
    verify of 5 timed alone right after one of 4 read like one of 8 (64 ms), in rounds 70 ms.
    Widths that fewer than 5 rounds ran fall back to the timed passes (`costs`).
    """
    ar, draft, verify = [], [], {}
    for ids in prompts:
        ar += [ev.verify_s for ev in stream_generate(pair, ids, block_size=1,
                                                     max_tokens=max_tokens)]
        for ev in stream_generate(pair, ids, config, block_size=block, max_tokens=max_tokens):
            draft.append(ev.draft_s)
            verify.setdefault(ev.block_size, []).append(ev.verify_s)
    med = statistics.median
    timed = passes[2]
    return med(ar), med(draft), {
        w: med(verify[w]) if len(verify.get(w, ())) >= 5 else timed[config.width(w)]
        for w in range(1, block + 1)}


def keep_slot(conf: list[float], p: float) -> int:
    """The per-slot rule the engine used before, for comparison."""
    k = 0
    while k < len(conf) and conf[k] >= p:
        k += 1
    return k


def keep_cost(conf: list[float], draft_s: float, verify: dict) -> int:
    """Slots that maximise expected tokens per second on this machine's measured passes: a
    round keeping k slots yields 1 + sum of the leading joint probabilities (the draft's own
    odds) and costs draft + verify(k + 1)."""
    best_k, best, expected, joint = 0, 1.0 / (draft_s + verify[1]), 1.0, 1.0
    for k, c in enumerate(conf, start=1):
        joint *= c
        expected += joint
        rate = expected / (draft_s + verify[k + 1])
        if rate > best:
            best_k, best = k, rate
    return best_k


def _fail(message: str):
    print(f"error: {message}", file=sys.stderr)
    raise SystemExit(2)


def _items(a, lo: int, hi: int):
    """(key, turns, timed): items lo..hi of every bundled set, or all of --prompts; `timed`
    marks the items whose real rounds cost the passes (each set's first, a file's first six)."""
    if a.prompts:
        try:
            items = load_prompt_file(a.prompts)[1]
        except DFlashError as e:
            _fail(str(e))
        return [(f"file#{i}", turns, i <= 6) for i, turns in enumerate(items, start=1)]
    return [(f"{name}#{i}", turns, i == lo) for name in DATASETS
            for i, turns in enumerate(load_prompts(name)[1][lo - 1: hi], start=lo)]


def measure(a, lo: int, hi: int) -> tuple[dict, tuple[float, float, dict], dict]:
    """Records of items lo..hi of every bundled set, this machine's pass costs, and the
    verify widths the engine pads here."""
    try:
        opened = open_engine(registry.resolve(a.model, a.draft, False), EngineSettings(
            block_size=a.block_size, tree=0, draft_bits=4, pad_verify=a.pad_verify))
    except DFlashError as e:
        _fail(str(e))
    pair, config = opened.pair, opened.config
    encode = encoder(pair, {})
    records, firsts, last = {}, [], None
    for key, turns, timed in _items(a, lo, hi):
        last = encode([{"role": "user", "content": turns[0]}])
        records[key] = record(pair, last, a.block_size, a.max_tokens)
        firsts += [last] if timed else []
    passes = costs(pair, config, last, a.block_size)
    if a.costs == "passes":
        return records, passes, dict(config.verify_pad)
    # the rounds ran padded already: their widths are the verify widths as run
    return records, round_costs(pair, config, firsts, a.block_size, a.max_tokens,
                                passes), {}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model")
    ap.add_argument("--draft")
    ap.add_argument("--items", default="3-7", help="1-based item range of each bundled set")
    ap.add_argument("--prompts", help="a JSONL of prompts (first turns) instead of the bundled "
                    "sets, e.g. a held-out source")
    ap.add_argument("--block-size", type=int, default=5)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--json", help="write the per-position records and the table here")
    ap.add_argument("--records", help="replay the records and costs of an earlier --json file "
                    "instead of decoding and timing again")
    ap.add_argument("--no-pad-verify", dest="pad_verify", action="store_false",
                    help="cost every round at its own width, as `--no-pad-verify` runs")
    ap.add_argument("--costs", choices=("rounds", "passes"), default="rounds",
                    help="rounds: medians of real decoding rounds of each set's first item "
                    "(default); passes: each pass timed alone")
    a = ap.parse_args()
    try:
        lo, hi = (int(x) for x in a.items.split("-"))
        if not 1 <= lo <= hi:
            raise ValueError
    except ValueError:
        _fail(f"--items takes FIRST-LAST (1-based), got {a.items}")
    if a.block_size < 2 or a.max_tokens < 1:
        _fail("--block-size must be at least 2 and --max-tokens at least 1")
    if a.records:
        try:
            with open(a.records) as f:
                saved = json.load(f)
        except (OSError, ValueError) as e:
            _fail(f"--records: cannot read {a.records}: {e}")
        records = saved["records"]
        ar_s, draft_s = saved["costs_s"]["ar"], saved["costs_s"]["draft"]
        verify = {int(w): v for w, v in saved["costs_s"]["verify"].items()}
        pads = {int(w): p for w, p in saved.get("pads", {}).items()} if a.pad_verify else {}
    else:
        records, (ar_s, draft_s, verify), pads = measure(a, lo, hi)
    print(f"{len(records)} prompts, {sum(len(r['rows']) for r in records.values())} positions; "
          f"AR step {ar_s * 1e3:.1f} ms, draft {draft_s * 1e3:.1f} ms, verify "
          + " ".join(f"{w}:{s * 1e3:.1f}" for w, s in verify.items()) + " ms"
          + (" (padded " + " ".join(f"{w}→{p}" for w, p in pads.items()) + ")" if pads else ""))
    timed = verify
    verify = {w: timed[pads.get(w, w)] for w in range(1, a.block_size + 1)}  # as the engine runs

    def simulate(name, threshold, keep, lookup):
        rounds = [r for rec in records.values() for r in replay(rec, keep, lookup)]
        t, r = sum(a + 1 for _, a in rounds), len(rounds)
        s = sum(draft_s + verify[k + 1] for k, _ in rounds)
        table.append({"rule": name, "threshold": threshold, "tau": t / r,
                      "speedup": t * ar_s / s})
        print(f"{name:17s} {'' if threshold is None else threshold:<5} τ {t / r:.2f}  "
              f"simulated speedup {t * ar_s / s:.3f}×")

    table = []
    for rule, keep, lookup in (("joint", keep_joint, True), ("joint", keep_joint, False),
                               ("slot", keep_slot, False)):
        for p in THRESHOLDS:
            simulate(rule + ("" if lookup else " (no lookup)"), p,
                     lambda c, keep=keep, p=p: keep(c, p), lookup)
    simulate("cost", None, lambda c: keep_cost(c, draft_s, verify), True)
    best = max(table, key=lambda row: row["speedup"])
    print(f"best: {best['rule']} {best['threshold']} ({best['speedup']:.3f}×)")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"costs_s": {"ar": ar_s, "draft": draft_s, "verify": timed}, "pads": pads,
                       "table": table, "records": records}, f)


if __name__ == "__main__":
    main()
