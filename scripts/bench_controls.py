"""Speculation under the request controls: processors, min-p and a JSON schema, on the demo pair.

For each setting, every prompt is decoded by DFlash (the pair's defaults) and by plain AR
decoding (block 1) with the same controls, in the same process, alternating which goes first;
medians over repeats. Settings: plain greedy; repetition penalty 1.1; min-p 0.05 at T 0.7;
a JSON schema (greedy). Also: the processors' share of a round (the same DFlash run with and
without the penalty, per round), and for the schema the drafted slots the grammar cut before
verification (they could never be accepted, so τ is the same either way: the cut saves rows).

The prompts are written here for this benchmark and were used to tune nothing.

Usage: python scripts/bench_controls.py [--tokens 96] [--repeats 3] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import dflash_mlx  # noqa: F401  (preloads the system OpenBLAS before mlx on Linux)
from dflash_mlx import load, stream_generate
from dflash_mlx.registry import default_pair
from dflash_mlx.speculate.grammar import Constraint
from dflash_mlx.speculate.processors import Processing
from dflash_mlx.speculate.sampling import SamplingParams

TEXT = [
    "Explain in a few sentences why the sky is blue.",
    "Write a short Python function that returns the factorial of n.",
    "Give three tips for writing clear emails.",
    "What is the difference between a list and a tuple in Python?",
]
JSON = [
    "Describe the city of Paris as JSON with its name, country and population.",
    "Give a JSON record for a book: title, author and year.",
    "Return a JSON object describing a cat: name, age and color.",
    "List a person as JSON with a name, an age and an email address.",
]
SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 40},
                   "kind": {"type": "string", "maxLength": 40},
                   "year": {"type": "integer"}, "tags": {"type": "array", "maxItems": 3,
                                                         "items": {"type": "string",
                                                                   "maxLength": 20}}},
    "required": ["name", "kind", "year", "tags"], "additionalProperties": False,
}
SETTINGS = {
    "greedy": (TEXT, SamplingParams()),
    "repetition 1.1": (TEXT, SamplingParams(processing=Processing(repetition_penalty=1.1))),
    "min-p 0.05, T 0.7": (TEXT, SamplingParams(0.7, min_p=0.05, seed=0)),
    "json_schema": (JSON, SamplingParams(constraint=Constraint.json_schema(SCHEMA))),
}


def decode(pair, ids, params, tokens, block):
    """(tokens/s after the first round, τ, grammar-cut slots, decode seconds per round)."""
    rounds = n = cut = 0
    tic = None
    for ev in stream_generate(pair, ids, max_tokens=tokens, block_size=block, sampling=params):
        rounds += 1
        n += len(ev.tokens)
        cut += ev.grammar_cut
        if tic is None:  # the first round carries the prefill
            tic, first = time.perf_counter(), n
    secs = time.perf_counter() - tic
    return (n - first) / secs if secs > 0 else 0.0, n / rounds, cut, secs / max(rounds - 1, 1)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", type=int, default=96)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json", help="write the table here")
    args = ap.parse_args()
    pair = load(*default_pair())
    chat = pair.tokenizer.apply_chat_template
    rows = []
    for name, (prompts, params) in SETTINGS.items():
        ratios, taus, dflash_tps, ar_tps, cuts, per_round = [], [], [], [], [], []
        for i, text in enumerate(prompts):
            ids = chat([{"role": "user", "content": text}], add_generation_prompt=True)
            got = {5: [], 1: []}
            for r in range(args.repeats):
                for block in ((5, 1) if (i + r) % 2 == 0 else (1, 5)):
                    got[block].append(decode(pair, ids, params, args.tokens, block))
            d = statistics.median(g[0] for g in got[5])
            a = statistics.median(g[0] for g in got[1])
            ratios.append(d / a)
            dflash_tps.append(d)
            ar_tps.append(a)
            taus.append(got[5][0][1])
            cuts.append(got[5][0][2])
            per_round.append(statistics.median(g[3] for g in got[5]))
        row = {"setting": name, "tau": round(statistics.mean(taus), 3),
               "dflash_tps": round(statistics.median(dflash_tps), 2),
               "ar_tps": round(statistics.median(ar_tps), 2),
               "speedup_median": round(statistics.median(ratios), 3),
               "round_ms": round(1000 * statistics.median(per_round), 2),
               "grammar_cut_slots": sum(cuts)}
        rows.append(row)
        print(json.dumps(row), flush=True)
    base = rows[0]["round_ms"]
    print(f"round time vs greedy: " + ", ".join(
        f"{r['setting']} {r['round_ms'] / base:.3f}x" for r in rows[1:]))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
