"""Aggregate tokens/s with N prompts at once (the demo pair or --model): batched speculation against the rest.

For each concurrency N (default 1, 2, 4, 8) the same N prompts are decoded greedy by
  (a) `batch_generate`: one round for all N per step (this project, batched; each round
      speculates or decodes plainly as the width controller finds it pays, `--adaptive`),
  (a') the same at a fixed width (every round speculates, `--fixed-width`),
  (b) `stream_generate` one prompt after another (this project, serial: what the server does today),
  (c) mlx-lm's `BatchGenerator`: batched plain decoding of the same (float32) target,
interleaved in one process, rotating which goes first; aggregate tok/s = generated tokens /
wall seconds from the first prompt in to the last token out (prefill included), median over
`--repeats`, and the median of each repeat's (a)/(c) ratio ("per repeat": a repeat's runs are
close in time, so their ratio drifts less with the host). (a) and (b) use the settings the CLI
and the server open the pair with (this machine's cost curve included). Greedy outputs of (a)
and (b) must match per prompt; a difference is reported, not hidden.

Prompts: the first N of `--prompts`, by default the unseen file (scripts/prompts/unseen-v1.jsonl),
which no setting was chosen on; with `--groups G`, G groups of N (the first G x N, in file
order), each repeat's tok/s being all G groups' tokens over their seconds (whether speculation
pays at N = 2 depends on the two prompts: on held-out pairs a batch ran 0.81-1.48x mlx-lm's).
The width controller's rules are chosen on the held-out file.
With `--loop K`, each N is a closed loop instead, as a server sees N clients: the first K
prompts of the file queue up, N run at once and each one that ends lets the next join at the
next round (mlx-lm's `BatchGenerator` takes it at its next step); (b) is then the K prompts one
after another, the same at every N, so it runs once per repeat. A closed batch of N ends when
its last sequence does, so tokens a fast sequence gains there only make it leave early; in a
loop the next prompt takes its place.
A batch's controller starts from what the pair's last batch measured (as a running server's
does), so before each N, (a) runs once on N prompts of `--warm-prompts` (the held-out file):
its first rounds at that load do not time both kinds of rounds on the reported prompts, and every
repeat starts from that run's measurements, not from an earlier repeat's.

    python scripts/bench_batch.py --max-tokens 96 --repeats 3 [--groups 4] [--json out.json]
    python scripts/bench_batch.py --max-tokens 64 --loop 24 --concurrency 2,4,8
    python scripts/bench_batch.py --model gemma3-270m --draft lookup   # sliding windows
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import dflash_mlx  # noqa: F401, I001  (first: preloads the system OpenBLAS before mlx on Linux)
from mlx_lm.generate import BatchGenerator

from dflash_mlx import registry, stream_generate
from dflash_mlx.atomic import write_atomic
from dflash_mlx.batch import Batch, batch_generate, serial_reason
from dflash_mlx.bench.runner import load_prompt_file
from dflash_mlx.chat import apply_template
from dflash_mlx.engine import EngineSettings, open as open_engine
from dflash_mlx.errors import DFlashError
from dflash_mlx.speculate.width import remember, remembered

PROMPTS = Path(__file__).resolve().parent / "prompts" / "unseen-v1.jsonl"
WARM = PROMPTS.with_name("heldout-v1.jsonl")


def chat_ids(pair, text: str) -> list[int]:
    return apply_template(pair.tokenizer, [{"role": "user", "content": text}])


def run_batched(pair, prompts, config, n) -> tuple[float, list[list[int]]]:
    outs = [[] for _ in prompts]
    tic = time.perf_counter()
    for ev in batch_generate(pair, prompts, config, max_tokens=n):
        outs[ev.index] += ev.tokens
    return time.perf_counter() - tic, outs


def run_serial(pair, prompts, config, n) -> tuple[float, list[list[int]]]:
    outs = []
    tic = time.perf_counter()
    for p in prompts:
        outs.append([t for ev in stream_generate(pair, p, config, max_tokens=n)
                     for t in ev.tokens])
    return time.perf_counter() - tic, outs


def run_mlx_lm(pair, prompts, n, clients=None) -> tuple[float, list[list[int]]]:
    """mlx-lm's batched plain decoding; `clients`: at most that many at once, each prompt
    inserted when one ends (None: all at once)."""
    clients = clients or len(prompts)
    eos = list(getattr(pair.tokenizer, "eos_token_ids", None) or [])
    gen = BatchGenerator(pair.target.model, stop_tokens=[[t] for t in eos],
                         completion_batch_size=max(clients, 1), prefill_batch_size=max(clients, 1))
    queue, uids, outs = list(prompts), [], {}

    def insert(k):
        uids.extend(gen.insert(queue[:k], [n] * len(queue[:k])))
        del queue[:k]

    tic = time.perf_counter()
    try:
        insert(clients)
        while responses := gen.next_generated():
            for r in responses:
                outs.setdefault(r.uid, []).append(r.token)
                if r.finish_reason is not None and queue:
                    insert(1)
    finally:
        gen.close()
    return time.perf_counter() - tic, [outs.get(u, []) for u in uids]


def run_loop(pair, prompts, config, n, clients) -> tuple[float, list[list[int]]]:
    """`clients` prompts at once on one `Batch`, each one that ends letting the next join."""
    batch, queue, outs, index = Batch(pair, config), list(range(len(prompts))), {}, {}

    def add():
        i = queue.pop(0)
        index[batch.add(prompts[i], max_tokens=n)] = i
        outs[i] = []

    tic = time.perf_counter()
    try:
        for _ in range(min(clients, len(queue))):
            add()
        while batch.running:
            for ev in batch.step():
                outs[index[ev.index]] += ev.tokens
                if ev.finish_reason is not None and queue:
                    add()
    finally:
        batch.close()
    return time.perf_counter() - tic, [outs[i] for i in range(len(prompts))]


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--concurrency", default="1,2,4,8", help="comma-separated N values")
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--groups", type=int, default=1,
                    help="groups of N prompts at each N (the first groups x N of the file)")
    ap.add_argument("--loop", type=int, default=0, metavar="K",
                    help="a closed loop over the first K prompts at each N instead of batches")
    ap.add_argument("--json", type=Path, help="write the table here too")
    ap.add_argument("--model", default=None,
                    help="a models.toml name or path (default: the demo pair)")
    ap.add_argument("--draft", default=None, help="with --model: its draft, or 'lookup'")
    ap.add_argument("--prompts", type=Path, default=PROMPTS, help="a JSONL file of prompts")
    ap.add_argument("--warm-prompts", type=Path, default=WARM,
                    help="prompts (a JSONL file) the batched runs warm up on at each N")
    args = ap.parse_args()
    try:
        levels = [int(x) for x in args.concurrency.split(",")]
        if min(levels) < 1:
            raise ValueError
    except ValueError:
        print(f"error: --concurrency {args.concurrency!r}: give positive whole numbers, "
              "comma-separated (e.g. 1,2,4,8)", file=sys.stderr)
        raise SystemExit(2)
    if args.groups < 1 or args.repeats < 1 or args.loop < 0:
        print("error: --groups and --repeats take a positive whole number, --loop a whole "
              "number", file=sys.stderr)
        raise SystemExit(2)

    try:
        opened = open_engine(registry.resolve(args.model, args.draft, False),
                             EngineSettings(tree=0))
        texts = [turns[0] for turns in load_prompt_file(args.prompts)[1]]  # first turns
        warm = [turns[0] for turns in load_prompt_file(args.warm_prompts, "--warm-prompts")[1]]
    except DFlashError as e:
        print(f"error: {e}", file=sys.stderr)
        raise SystemExit(2)
    pair, config = opened.pair, opened.config
    print(f"target {pair.target_id} ({pair.weights}), draft {pair.draft_id}; "
          f"block {config.block_size}, cut {config.min_confidence}, lookup {config.lookup}; "
          f"batched target: {serial_reason(pair) or 'yes'}", file=sys.stderr)
    fixed = config.replace(adaptive=False)
    warmed = {}  # N -> the controller its held-out warm run left

    level = [0, 0]  # the N and the repeat being run
    serial_runs = {}  # with --loop: repeat -> the serial run, the same at every N

    def batched(ps, cfg):  # every repeat starts from the held-out run, not from the last repeat
        if cfg is config and warmed.get(level[0]) is not None:
            remember(pair, config.block_size, warmed[level[0]])
        if args.loop:
            return run_loop(pair, ps, cfg, args.max_tokens, level[0])
        return run_batched(pair, ps, cfg, args.max_tokens)

    def serial(ps):
        if not args.loop:
            return run_serial(pair, ps, config, args.max_tokens)
        if level[1] not in serial_runs:
            serial_runs[level[1]] = run_serial(pair, ps, config, args.max_tokens)
        return serial_runs[level[1]]

    runners = {
        "batched": lambda ps: batched(ps, config),
        "fixed": lambda ps: batched(ps, fixed),
        "serial": serial,
        "mlx-lm": lambda ps: run_mlx_lm(pair, ps, args.max_tokens,
                                        level[0] if args.loop else None),
    }
    run_batched(pair, [chat_ids(pair, warm[0])] * 2, config, 4)  # warm-up: first-call costs
    rows = []
    for n in levels:
        level[0] = n
        groups = ([[chat_ids(pair, t) for t in texts[: args.loop]]] if args.loop else
                  [[chat_ids(pair, texts[(g * n + i) % len(texts)]) for i in range(n)]
                   for g in range(args.groups)])
        run_batched(pair, [chat_ids(pair, warm[i % len(warm)]) for i in range(n)], config,
                    args.max_tokens)  # the controller measures this load on other prompts
        warmed[n] = remembered(pair, config.block_size)
        tps = {k: [] for k in runners}
        mismatched = 0
        for r in range(args.repeats):
            level[1] = r
            order = list(runners)
            order = order[r % len(order):] + order[: r % len(order)]  # rotate who runs first
            secs, tokens, outs = dict.fromkeys(order, 0.0), dict.fromkeys(order, 0), {}
            for prompts in groups:  # each runner's tok/s: every group's tokens / seconds
                for name in order:
                    s, outs[name] = runners[name](prompts)
                    secs[name] += s
                    tokens[name] += sum(len(o) for o in outs[name])
                mismatched += sum(a != b for a, b in zip(outs["batched"], outs["serial"]))
            for name in order:
                tps[name].append(tokens[name] / secs[name])
        med = {k: statistics.median(v) for k, v in tps.items()}
        paired = statistics.median(a / c for a, c in zip(tps["batched"], tps["mlx-lm"]))
        rows.append({"n": n, "groups": args.groups, "loop": args.loop,
                     **{f"{k}_tps": round(v, 2) for k, v in med.items()},
                     "runs_tps": {k: [round(x, 2) for x in v] for k, v in tps.items()},
                     "paired_batched_vs_mlx_lm": round(paired, 3),
                     "batched_vs_serial": round(med["batched"] / med["serial"], 3),
                     "batched_vs_mlx_lm": round(med["batched"] / med["mlx-lm"], 3),
                     "outputs_differing": mismatched})
        label = f"N={n}" + (f" in a loop of {args.loop}" if args.loop else
                            f" x {args.groups} groups" if args.groups > 1 else "")
        print(f"{label}: batched {med['batched']:.1f}  fixed {med['fixed']:.1f}  "
              f"serial {med['serial']:.1f}  "
              f"mlx-lm {med['mlx-lm']:.1f} tok/s  (batched/serial "
              f"{rows[-1]['batched_vs_serial']:.2f}x, batched/mlx-lm "
              f"{rows[-1]['batched_vs_mlx_lm']:.2f}x, per repeat {paired:.2f}x; "
              f"batched vs serial outputs differing: {mismatched})", flush=True)
    if args.json:
        write_atomic(args.json, json.dumps({"max_tokens": args.max_tokens,
                                            "repeats": args.repeats, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
