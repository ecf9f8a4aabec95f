"""Two versions of dflash-mlx side by side on the same prompts: did a change make decoding slower?

Each version runs in its own process (a source tree, e.g. made with `git worktree add /tmp/old
COMMIT`) that loads the pair once; the driver hands the processes the same prompts in turn,
alternating which one goes first, so drift on a busy machine lands on both alike. Every prompt is
decoded greedy with each version's defaults, and the tokens must match (both are exact). Reports
the median per-prompt ratio of decode tokens/s (B over A) and each side's median tokens/s.

    git worktree add /tmp/before 394cdfc~1
    python scripts/ab_commits.py /tmp/before . --items 1-4 --max-tokens 128 --repeats 3
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

WORKER = r"""
import json, sys, time
sys.path.insert(0, sys.argv[1])
import dflash_mlx  # first: the BLAS preload
print("worker:", dflash_mlx.__file__, file=sys.stderr, flush=True)
from dflash_mlx import load, stream_generate
from dflash_mlx.registry import default_pair
pair = load(*default_pair())
for line in sys.stdin:
    job = json.loads(line)
    ids = pair.tokenizer.apply_chat_template([{"role": "user", "content": job["prompt"]}],
                                             add_generation_prompt=True)
    tokens, rounds, tic, first = [], 0, None, 0
    for ev in stream_generate(pair, ids, max_tokens=job["max_tokens"], block_size=job["block"]):
        rounds += 1
        tokens += ev.tokens
        if tic is None:  # the first round carries the prefill: time the rest
            tic, first = time.perf_counter(), len(tokens)
    decode = time.perf_counter() - tic
    print(json.dumps({"tokens": tokens, "rounds": rounds,
                      "tps": (len(tokens) - first) / decode if decode > 0 else 0.0}), flush=True)
"""


def start(tree: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", WORKER, str(Path(tree).resolve())],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)


def ask(proc: subprocess.Popen, job: dict) -> dict:
    proc.stdin.write(json.dumps(job) + "\n")
    proc.stdin.flush()
    line = proc.stdout.readline()
    if not line:
        raise SystemExit("a worker ended early")
    return json.loads(line)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("a", help="source tree A (the baseline)")
    ap.add_argument("b", help="source tree B")
    ap.add_argument("--prompts", default="dflash_mlx/bench/prompts/mt-bench.jsonl",
                    help="a JSONL with `turns` or `prompt` per line (first turn used)")
    ap.add_argument("--items", default="1-4", help="1-based range of lines")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--block", type=int, default=5)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    lo, hi = (int(x) for x in args.items.split("-"))
    rows = [json.loads(x) for x in Path(args.prompts).read_text().splitlines() if x.strip()]
    prompts = [r.get("prompt") or r["turns"][0] for r in rows if "_meta" not in r][lo - 1:hi]
    procs = {"A": start(args.a), "B": start(args.b)}
    ratios, tps = [], {"A": [], "B": []}
    try:
        for i, prompt in enumerate(prompts):
            job = {"prompt": prompt, "max_tokens": args.max_tokens, "block": args.block}
            got = {"A": [], "B": []}
            for r in range(args.repeats):
                for side in ("AB" if (i + r) % 2 == 0 else "BA"):
                    got[side].append(ask(procs[side], job))
            if got["A"][0]["tokens"] != got["B"][0]["tokens"]:
                print(f"item {lo + i}: the two versions' outputs differ", file=sys.stderr)
            med = {s: statistics.median(x["tps"] for x in got[s]) for s in got}
            for s in med:
                tps[s].append(med[s])
            ratios.append(med["B"] / med["A"])
            print(f"item {lo + i}: A {med['A']:.1f} tok/s, B {med['B']:.1f} tok/s, "
                  f"B/A {ratios[-1]:.3f}", flush=True)
    finally:
        for p in procs.values():
            p.stdin.close()
            p.wait(timeout=60)
    print(f"median B/A {statistics.median(ratios):.3f} over {len(ratios)} prompts "
          f"(A {statistics.median(tps['A']):.1f} tok/s, B {statistics.median(tps['B']):.1f})")


if __name__ == "__main__":
    main()
