"""`benchmark --concurrency N` in process: a closed loop of N requests in flight on one `Batch`.

Each prompt of a set arrives when a slot frees (the first N at the start) and joins the batch at
the next round boundary. Per request: TTFT from its arrival (before its prefill, so queueing
behind other prefills counts) to its first tokens; TPOT = (last − first token time) /
(tokens − 1). Per set: aggregate tok/s = generated tokens / wall time of the whole set.

The same loop runs twice on the same target and batch machinery: with the pair's speculation
and with plain decoding (block size 1), alternating which goes first per set and repeat so
drift favours neither; repeats keep the run with the median aggregate tok/s. Only the first
user turn of each item is sent (later turns would need an answer to follow, as remotely).
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from mlx_lm.generate import wired_limit

from ..batch import Batch
from ..latency import spread_ms, tpot
from ..speculate import SamplingParams, SpeculationConfig
from ..stats import Stats
from .runner import WARMUP_PROMPT, WARMUP_TOKENS, first_divergence

CARD_SCHEMA = "dflash-mlx/concurrency-card/1"
SYSTEMS = ("plain", "dflash")


@dataclass
class Request:
    """One prompt's trip through the loop; times are `clock()` readings."""

    index: int
    prompt_tokens: int
    arrival: float = 0.0
    first: float | None = None
    last: float | None = None
    tokens: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    events: list = field(default_factory=list)

    @property
    def stats(self) -> Stats:
        return _stats([self])

    @property
    def ttft_s(self) -> float | None:
        return None if self.first is None else self.first - self.arrival

    @property
    def tpot_s(self) -> float | None:
        return tpot(self.first, self.last, len(self.tokens))


@dataclass
class SetRun:
    requests: list[Request]
    wall_s: float

    @property
    def tokens(self) -> int:
        return sum(len(r.tokens) for r in self.requests)

    @property
    def tps(self) -> float:
        return self.tokens / self.wall_s if self.wall_s > 0 else 0.0


def run_set(pair, config: SpeculationConfig, prompts: list[list[int]], concurrency: int, *,
            sampling: SamplingParams | None = None, max_tokens: int = 128,
            clock: Callable[[], float] = time.perf_counter) -> SetRun:
    """Every prompt through one batch with at most `concurrency` in flight."""
    reqs = [Request(i, len(p)) for i, p in enumerate(prompts)]
    waiting, live = deque(reqs), {}
    batch = Batch(pair, config)
    start = clock()
    try:
        with wired_limit(pair.target.model):
            while waiting or live:
                now = clock()  # the slots the last round freed are free from now
                while waiting and len(live) < concurrency:
                    r = waiting.popleft()
                    r.arrival = now
                    live[batch.add(prompts[r.index], sampling=sampling,
                                   max_tokens=max_tokens)] = r
                events = batch.step()
                now = clock()  # the round's tokens reach the host together
                for ev in events:
                    r = live[ev.index]
                    r.events.append(ev)
                    if ev.tokens:
                        r.first = now if r.first is None else r.first
                        r.last = now
                        r.tokens += ev.tokens
                    r.finish_reason = ev.finish_reason or r.finish_reason
                running = set(batch.running)
                live = {i: r for i, r in live.items() if i in running}
    finally:
        batch.close()
    return SetRun(reqs, clock() - start)


def run(pair, prompt_sets: dict[str, list[list[str]]], encode: Callable[[list[dict]], list[int]],
        *, config: SpeculationConfig, concurrency: int, sampling: SamplingParams | None = None,
        max_tokens: int = 128, repeats: int = 1,
        progress: Callable[[str], None] | None = None) -> dict[str, dict[str, list[SetRun]]]:
    """dataset → system ("plain", "dflash") → one `SetRun` per repeat."""
    say = progress or (lambda _m: None)
    configs = {"plain": config.replace(block_size=1), "dflash": config}
    warm = encode([{"role": "user", "content": WARMUP_PROMPT}])
    for system in SYSTEMS:  # compile and allocate at this width before anything is timed
        run_set(pair, configs[system], [warm] * concurrency, concurrency, sampling=sampling,
                max_tokens=WARMUP_TOKENS)
    results: dict[str, dict[str, list[SetRun]]] = {}
    count = 0
    for name, items in prompt_sets.items():
        prompts = [encode([{"role": "user", "content": turns[0]}]) for turns in items]
        runs = results[name] = {s: [] for s in SYSTEMS}
        for _ in range(repeats):
            for system in SYSTEMS if count % 2 == 0 else SYSTEMS[::-1]:
                runs[system].append(run_set(pair, configs[system], prompts, concurrency,
                                            sampling=sampling, max_tokens=max_tokens))
            count += 1
        plain, dflash = median(runs["plain"]), median(runs["dflash"])
        say(f"{name}: {len(prompts)} requests, {concurrency} in flight: plain "
            f"{plain.tps:.1f} tok/s, DFlash {dflash.tps:.1f} tok/s")
    return results


def median(runs: list[SetRun]) -> SetRun:
    """The run with the median aggregate tok/s (the upper one of an even count)."""
    return sorted(runs, key=lambda r: r.tps)[len(runs) // 2]


def _figures(runs: list[SetRun]) -> dict:
    reqs = [r for run in runs for r in run.requests]
    tokens, wall = sum(r.tokens for r in runs), sum(r.wall_s for r in runs)
    return {"tps": round(tokens / wall, 3) if wall > 0 else None,
            "generation_tokens": tokens, "wall_s": round(wall, 4),
            **spread_ms("ttft", (r.ttft_s for r in reqs)),
            **spread_ms("tpot", (r.tpot_s for r in reqs))}


def summarize(results: dict[str, dict[str, list[SetRun]]], *, concurrency: int, block_size: int,
              greedy: bool) -> list[dict]:
    """One row per dataset (the median runs), plus "all" when there are several."""
    groups = {name: {s: [median(runs[s])] for s in SYSTEMS} for name, runs in results.items()}
    if len(groups) > 1:
        groups["all"] = {s: [g[s][0] for g in groups.values()] for s in SYSTEMS}
    rows = []
    for name, med in groups.items():
        plain, dflash = _figures(med["plain"]), _figures(med["dflash"])
        pairs = [pd for p_run, d_run in zip(med["plain"], med["dflash"])
                 for pd in zip(p_run.requests, d_run.requests)]
        merged = _stats([d for _p, d in pairs])
        same = [p.tokens == d.tokens for p, d in pairs]
        rows.append({
            "dataset": name, "requests": len(pairs), "concurrency": concurrency,
            "block_size": block_size, "plain": plain, "dflash": dflash,
            "speedup": round(dflash["tps"] / plain["tps"], 4)
            if plain["tps"] and dflash["tps"] else None,
            "tau": round(merged.tau, 4),
            "acceptance_rates": [round(x, 4) for x in merged.acceptance_rates],
            "greedy_match": round(sum(same) / len(same), 4) if greedy and same else None,
        })
    return rows


def _stats(reqs: list[Request]) -> Stats:
    """τ and acceptance over every round of `reqs`."""
    stats = Stats()
    for r in reqs:
        for ev in r.events:
            stats.add(ev)
    return stats


def _entry(r: Request) -> dict:
    return {"generation_tokens": len(r.tokens),
            "ttft_ms": None if r.ttft_s is None else round(r.ttft_s * 1e3, 3),
            "tpot_ms": None if r.tpot_s is None else round(r.tpot_s * 1e3, 3),
            "finish_reason": r.finish_reason}


def per_request(results: dict[str, dict[str, list[SetRun]]]) -> list[dict]:
    """The card's per-request numbers, from each system's median run."""
    out = []
    for name, runs in results.items():
        plain, dflash = median(runs["plain"]), median(runs["dflash"])
        for p, d in zip(plain.requests, dflash.requests):
            out.append({"dataset": name, "item": p.index, "prompt_tokens": p.prompt_tokens,
                        "plain": _entry(p),
                        "dflash": {**_entry(d), "stats": d.stats.as_dict(),
                                   "first_divergence": first_divergence(d.tokens, p.tokens)}})
    return out
