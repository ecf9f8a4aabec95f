"""AR vs DFlash on the same target and prompts, interleaved per prompt; a reproducible card.

Methodology (as z-lab's `dflash/benchmark.py`, with the AR baseline through the same target
code): per sample, time per output token = decode wall time (prefill excluded) / tokens;
speedup = mean(AR time per token) / mean(DFlash time per token); τ = mean over samples of
tokens per verify round (bonus included). Runs alternate AR-first and AR-last per prompt so
slow drift (thermals, other load) does not favour either side. Repeats keep the median.
"""

from __future__ import annotations

import hashlib
import json
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from ..generate import stream_generate
from ..speculate import SpeculationConfig
from ..errors import InvalidArgumentError
from ..stats import Stats

PROMPTS = Path(__file__).parent / "prompts"
DATASETS = ("gsm8k", "math500", "humaneval", "mbpp", "mt-bench")
WARMUP_PROMPT = "Hi"
WARMUP_TOKENS = 8
CARD_SCHEMA = "dflash-mlx/benchmark-card/2"  # 2: per-run `stats` is Stats.as_dict()


def load_prompts(name: str) -> tuple[dict, list[list[str]]]:
    """(metadata, items) of a bundled prompt set; each item is a list of user turns."""
    path = PROMPTS / f"{name}.jsonl"
    if name not in DATASETS or not path.is_file():
        raise InvalidArgumentError(f"unknown dataset {name!r}; choose from {', '.join(DATASETS)}")
    meta, items = {}, []
    for line in path.read_text().splitlines():
        if not line.strip():
            continue
        row = json.loads(line)
        if "_meta" in row:
            meta = row["_meta"]
        else:
            items.append(list(row["turns"]))
    return meta, items


def load_prompt_file(path: Path, option: str = "--prompts") -> tuple[dict, list[list[str]]]:
    """(metadata with the file's sha256, items) of a user's JSONL of prompts.

    A line is a JSON string (one user turn), or an object with `prompt` (one turn), `turns`
    (user turns in order) or `messages` (chat messages; the user turns are kept, as every later
    turn follows the AR answer to the one before, like the bundled multi-turn sets). `option`:
    the flag that named the file, for its errors.
    """
    from ..input_files import read_bytes

    where = f"{option} {path}"
    raw = read_bytes(path, option)  # a FIFO or a folder: one line, never a wait
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise InvalidArgumentError(f"{where}: not UTF-8 text (byte {e.start})") from None
    items = []
    for n, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            items.append(_turns(json.loads(line)))
        except (ValueError, TypeError) as e:
            msg = e.msg if isinstance(e, json.JSONDecodeError) else str(e)
            raise InvalidArgumentError(f"{where}, line {n}: {msg}") from None
    if not items:
        raise InvalidArgumentError(f"{where}: no prompts in the file")
    meta = {"name": Path(path).stem, "source": "--prompts",
            "sha256": hashlib.sha256(raw).hexdigest(), "items": len(items)}
    return meta, items


def select_prompts(dataset: str, prompts: Path | None, num_prompts: int | None
                   ) -> tuple[dict[str, dict], dict[str, list[list[str]]]]:
    """(metadata, items) per set: a --prompts file (all of it by default) or bundled datasets
    (8 items each by default), cut to `num_prompts` items in file order."""
    if num_prompts is not None and num_prompts < 1:
        raise InvalidArgumentError("--num-prompts must be at least 1")
    if prompts is not None:
        meta, items = load_prompt_file(prompts)
        metas, found = {meta["name"]: meta}, {meta["name"]: items}
    else:
        metas, found = {}, {}
        for name in parse_datasets(dataset):
            metas[name], found[name] = load_prompts(name)
        num_prompts = num_prompts or 8
    return metas, {name: items[:num_prompts] for name, items in found.items()}


def _turns(row) -> list[str]:
    if isinstance(row, dict) and "prompt" in row:
        turns = [row["prompt"]]
    elif isinstance(row, dict) and "turns" in row:
        turns = row["turns"]
    elif isinstance(row, dict) and "messages" in row:
        msgs = row["messages"]
        if not isinstance(msgs, list) or not all(isinstance(m, dict) for m in msgs):
            raise TypeError("`messages` must be a list of {role, content} objects")
        turns = [m.get("content") for m in msgs if m.get("role") == "user"]
    else:
        turns = [row]
    if not isinstance(turns, list) or not turns or \
            not all(isinstance(t, str) and t.strip() for t in turns):
        raise TypeError("expected a non-empty string, or an object with `prompt`, `turns` or "
                        "`messages` holding non-empty user text")
    return turns


def parse_datasets(spec: str) -> list[str]:
    names = list(DATASETS) if spec == "all" else [s.strip() for s in spec.split(",") if s.strip()]
    for n in names:
        load_prompts(n)  # validates
    return names


@dataclass
class Run:
    tokens: list[int]
    text: str
    decode_s: float
    stats: Stats
    events: list = field(default_factory=list)

    @property
    def tpot(self) -> float:
        return self.decode_s / max(len(self.tokens), 1)


def generate_once(pair, ids: list[int], block: int, sampling: dict,
                  config: SpeculationConfig | None = None) -> Run:
    """One generation at `block` (the rest of the policy from `config`, None: the defaults)."""
    stats, events = Stats(), []
    tic = time.perf_counter()
    for ev in stream_generate(pair, ids, config, block_size=block, **sampling):
        stats.add(ev)
        events.append(ev)
    wall = time.perf_counter() - tic - stats.prompt_s  # decode wall time, prefill excluded
    tokens = [t for ev in events for t in ev.tokens]
    return Run(tokens, "".join(ev.text for ev in events), wall, stats, events)


def first_divergence(a: list[int], b: list[int]) -> int | None:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


@dataclass
class Sample:
    dataset: str
    item: int
    turn: int
    prompt_tokens: int
    runs: dict[int, list[Run]] = field(default_factory=dict)  # block size → repeats

    def median(self, block: int) -> Run:
        runs = sorted(self.runs[block], key=lambda r: r.tpot)
        return runs[len(runs) // 2]


def run(pair, prompt_sets: dict[str, list[list[str]]], encode: Callable[[list[dict]], list[int]],
        *, block_sizes: list[int], sampling: dict, repeats: int = 1,
        progress: Callable[[str], None] | None = None,
        config: SpeculationConfig | None = None) -> list[Sample]:
    """Run AR (block 1) and every block size on every turn of every item.

    Args:
        config: the speculation policy besides the block size (None: the pair's defaults).
        encode: messages → prompt ids (chat template, reasoning kwargs).
        sampling: max_tokens, temperature, top_p, top_k, seed for stream_generate.
    """
    say = progress or (lambda _m: None)
    blocks = [1] + [b for b in block_sizes if b != 1]
    warm = encode([{"role": "user", "content": WARMUP_PROMPT}])
    for b in blocks:
        generate_once(pair, warm, b, {**sampling, "max_tokens": WARMUP_TOKENS}, config)
    samples: list[Sample] = []
    count = 0
    for name, items in prompt_sets.items():
        for i, turns in enumerate(items):
            messages: list[dict] = []
            for t, user in enumerate(turns):
                messages.append({"role": "user", "content": user})
                ids = encode(messages)
                sample = Sample(name, i, t, len(ids))
                order = blocks if count % 2 == 0 else blocks[::-1]
                count += 1
                for _ in range(repeats):
                    for b in order:
                        run_ = generate_once(pair, ids, b, sampling, config)
                        sample.runs.setdefault(b, []).append(run_)
                samples.append(sample)
                ar = sample.median(1)
                say(f"{name} #{i} turn {t + 1}: AR {1 / ar.tpot:.1f} tok/s, " + ", ".join(
                    f"B{b} {1 / sample.median(b).tpot:.1f} tok/s τ {sample.median(b).stats.tau:.2f}"
                    for b in blocks[1:]))
                # The next turn sees the AR answer: the same history for every block size.
                messages.append({"role": "assistant", "content": ar.text})
    return samples


def summarize(samples: list[Sample], block_sizes: list[int], greedy: bool) -> list[dict]:
    """One row per (dataset, block size), plus an "all" row when there are several datasets."""
    groups: dict[str, list[Sample]] = {}
    for s in samples:
        groups.setdefault(s.dataset, []).append(s)
    if len(groups) > 1:
        groups["all"] = list(samples)
    rows = []
    for name, group in groups.items():
        ar_tpot = statistics.fmean(s.median(1).tpot for s in group)
        for b in block_sizes:
            merged = Stats()
            for s in group:
                for ev in s.median(b).events:
                    merged.add(ev)
            tpot = statistics.fmean(s.median(b).tpot for s in group)
            matches = [s.median(b).tokens == s.median(1).tokens for s in group]
            rows.append({
                "dataset": name,
                "block_size": b,
                "samples": len(group),
                "speedup": round(ar_tpot / tpot, 4) if tpot else None,
                "tau": round(statistics.fmean(s.median(b).stats.tau for s in group), 4),
                "acceptance_rates": [round(r, 4) for r in merged.acceptance_rates],
                "ar_tps": round(1 / ar_tpot, 3) if ar_tpot else None,
                "dflash_tps": round(1 / tpot, 3) if tpot else None,
                "greedy_match": round(sum(matches) / len(matches), 4) if greedy else None,
                "generation_tokens": merged.tokens,
                # share of the generated tokens that were context-lookup slots the target accepted
                "lookup_share": round(merged.lookup_accepted / merged.tokens, 4)
                if merged.tokens else 0.0,
            })
    return rows


def _run_entry(run_: Run) -> dict:
    # wall time per token is the card's own measure; the rest is the one stats schema
    return {"tpot_s": round(run_.tpot, 6), "stats": run_.stats.as_dict()}


def per_sample(samples: list[Sample], block_sizes: list[int]) -> list[dict]:
    out = []
    for s in samples:
        ar = s.median(1)
        out.append({
            "dataset": s.dataset, "item": s.item, "turn": s.turn, "prompt_tokens": s.prompt_tokens,
            "ar": _run_entry(ar),
            "dflash": {str(b): {
                **_run_entry(s.median(b)),
                "first_divergence": first_divergence(s.median(b).tokens, ar.tokens),
            } for b in block_sizes},
        })
    return out


def card(*, machine: dict, versions: dict, models: dict, settings: dict, rows: list[dict],
         samples: list[dict], datasets: dict) -> dict:
    return {
        "schema": CARD_SCHEMA,
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "machine": machine,
        "versions": versions,
        "models": models,
        "settings": settings,
        "datasets": datasets,
        "results": rows,
        "samples": samples,
    }


# -- --check-parity --------------------------------------------------------------------------

# Logit margins under which a divergence counts as a near-tie that batched verification may
# flip (z-lab #57, #159): float32 paths agree to ~1e-4; half-precision activations to ~0.1.
NEAR_TIE_FLOAT32 = 0.01
NEAR_TIE_LOW_PRECISION = 0.25


def near_tie_threshold(weights: str) -> float:
    return NEAR_TIE_FLOAT32 if weights == "float32" else NEAR_TIE_LOW_PRECISION


@dataclass
class Parity:
    compared: int
    index: int | None = None
    dflash_token: int | None = None
    ar_token: int | None = None
    margin: float | None = None
    threshold: float = NEAR_TIE_FLOAT32
    verdict: str = "match"  # match | near-tie | mismatch


def logit_margin(pair, ids: list[int], a: int, b: int) -> float:
    """logit(a) − logit(b) of the target's next-token prediction after `ids` (fresh pass)."""
    import mlx.core as mx

    from ..generate import PREFILL_STEP

    cache = pair.target.make_cache()
    for start in range(0, len(ids), PREFILL_STEP):
        logits, _ = pair.target(mx.array([ids[start:start + PREFILL_STEP]]), cache, taps=False)
        mx.eval(logits)
    last = logits[0, -1].astype(mx.float32)
    return float(last[a] - last[b])


def check_parity(pair, ids: list[int], tokens: list[int], max_tokens: int) -> Parity:
    """Run plain AR greedy on the same target and prompt; classify the first divergence."""
    ar = generate_once(pair, ids, 1, {"max_tokens": max_tokens, "temperature": 0.0})
    threshold = near_tie_threshold(pair.weights)
    i = first_divergence(tokens, ar.tokens)
    if i is None:
        return Parity(len(tokens), threshold=threshold)
    if i >= min(len(tokens), len(ar.tokens)):  # one output is a strict prefix of the other
        return Parity(i, i, threshold=threshold, verdict="mismatch")
    margin = logit_margin(pair, ids + ar.tokens[:i], ar.tokens[i], tokens[i])
    verdict = "near-tie" if abs(margin) < threshold else "mismatch"
    return Parity(i, i, tokens[i], ar.tokens[i], margin, threshold, verdict)
