"""Prompt-cache reuse for interleaved conversations through the server's worker (demo pair).

Two conversations, A and B, alternate for three turns each (A1 B1 A2 B2 A3 B3); each turn
sends the whole history with the model's previous answer, as chat clients do. Printed: per
request the prompt tokens, the cached (reused) ones, and the tokens that conversation had
already been through (its last prompt and answer), with one slot (the old single-session
server) and with the default slots. The conversations are written here and
tune nothing.

Usage: python scripts/bench_prompt_cache.py [--tokens 48] [--slots 1 4]
"""

from __future__ import annotations

import argparse
import asyncio

import dflash_mlx  # noqa: F401  (preloads the system OpenBLAS before mlx on Linux)
from dflash_mlx import load
from dflash_mlx.chat import apply_template
from dflash_mlx.registry import default_pair
from dflash_mlx.generate import Session
from dflash_mlx.server.prompt_cache import PromptCache
from dflash_mlx.server.worker import Delta, Job, Worker
from dflash_mlx.speculate import SpeculationConfig
from dflash_mlx.speculate.sampling import SamplingParams

SYSTEM = "You are a patient assistant who answers briefly and precisely."
TURNS = {
    "A": ["Plan a three-day trip to Lisbon for a family with two children.",
          "Which of those days suits a rainy forecast best?",
          "Suggest one restaurant for the last evening."],
    "B": ["Explain how a hash table handles collisions.",
          "Compare that with a balanced search tree.",
          "When would you pick the tree anyway?"],
}


async def ask(worker: Worker, ids: list[int], tokens: int):
    job = Job(ids, SamplingParams(), max_tokens=tokens)
    worker.submit(job)
    text, end = "", None
    async for msg in job.stream():
        if isinstance(msg, Delta):
            text += msg.text
        else:
            end = msg
    return text, end


async def run(worker: Worker, tokens: int) -> list[tuple]:
    """(request, prompt tokens, cached tokens, tokens that conversation had seen before)."""
    pair = worker.pair
    history = {k: [{"role": "system", "content": SYSTEM}] for k in TURNS}
    seen = dict.fromkeys(TURNS, 0)
    rows = []
    for turn in range(3):
        for name in TURNS:
            history[name].append({"role": "user", "content": TURNS[name][turn]})
            ids = apply_template(pair.tokenizer, history[name])
            text, end = await ask(worker, ids, tokens)
            history[name].append({"role": "assistant", "content": text})
            rows.append((f"{name}{turn + 1}", end.prompt_tokens, end.cached_tokens, seen[name]))
            seen[name] = end.prompt_tokens + end.completion_tokens
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--slots", type=int, nargs="+", default=[1, 4])
    args = ap.parse_args()
    target, draft = default_pair()
    pair = load(target, draft)
    # one worker thread for the whole run (each MLX thread must live until exit)
    worker = Worker(pair, SpeculationConfig()).start()
    try:
        for slots in args.slots:
            worker.cache = PromptCache(pair, lambda: Session.new(pair, worker.config), slots)
            rows = asyncio.run(run(worker, args.tokens))
            print(f"\n{slots} slot(s): request  prompt  cached  seen before  cached/seen")
            for name, prompt, cached, seen in rows:
                share = f"{cached / seen:6.1%}" if seen else "     -"
                print(f"  {name:>8} {prompt:7d} {cached:7d} {seen:12d}  {share}")
            later = rows[2:]  # turns 2 and 3 (turn 1 has nothing of its own to reuse)
            print(f"  turns 2-3: {sum(r[2] for r in later) / sum(r[3] for r in later):.1%} of "
                  "the tokens their conversation had seen were reused")
    finally:
        worker.close()


if __name__ == "__main__":
    main()
