"""Requests the demo target writes itself: a self-instruct source of training prompts.

For every (topic, task) pair of two broad lists the target is asked, at temperature, for one
request a user might send an assistant. Its answers are cut to the request, cleaned,
de-duplicated, and dropped when they share an 8-word run with the unseen set, the held-out
source or a bundled benchmark item; the rest go to a JSONL that
`build_demo_features.py --prompts-file` answers. No benchmark's format is used: the lists
below are everyday subjects and kinds of help.

Usage: python scripts/self_instruct.py OUT.jsonl [--rounds 2] [--seed 0] [--temperature 0.9]
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import tempfile
import time
from pathlib import Path

import dflash_mlx  # noqa: F401  (first: preloads OpenBLAS before mlx)

from dflash_mlx.bench.runner import DATASETS, load_prompt_file, load_prompts
from dflash_mlx.demo.target import load_demo_feature_target
from dflash_mlx.train.data import load_shards, self_distill_features

TOPICS = (
    "cooking dinner", "baking", "gardening", "house cleaning", "home repairs", "pets", "travel",
    "public transport", "personal finance", "shopping", "fitness", "sleep", "nutrition",
    "first aid", "parenting", "friendship", "job interviews", "workplace conflicts",
    "learning a language", "studying for exams", "music", "films", "books", "photography",
    "the weather", "astronomy", "geology", "oceans", "birds", "insects", "ancient history",
    "modern history", "geography", "economics", "the law", "elections", "renewable energy",
    "cars", "bicycles", "smartphones", "spreadsheets", "email etiquette", "web browsers",
    "the Linux command line", "git", "Python programming", "JavaScript", "databases",
    "networking", "computer security", "chess", "football", "hiking", "camping", "weddings",
    "moving house", "volunteering", "art history", "philosophy", "psychology", "chemistry",
    "physics", "biology", "medicine", "statistics", "geometry", "fractions",
)
TASKS = (
    "explain something simply", "give step-by-step instructions", "compare two options",
    "make a plan or schedule", "write a short poem or story", "draft an email or letter",
    "summarise a short paragraph it includes", "list ideas", "give advice on a personal situation",
    "answer a factual question", "solve a small word problem", "write a short piece of code",
    "fix or explain a short piece of code", "rewrite a sentence it includes in another tone",
    "define a term", "recommend something and say why",
)


def asks(rounds: int) -> list[str]:
    return [f"Write one question or request that a person might send to an AI assistant about "
            f"{topic}, asking it to {task}. Reply with the request only, in one or two sentences."
            for _ in range(rounds) for topic in TOPICS for task in TASKS]


def clean(text: str) -> str | None:
    """The request alone, or None when the answer is not one."""
    text = text.strip().split("\n\n")[0].strip()
    text = re.sub(r'^(request|question|sure[,!]?[^:]*)\s*:\s*', "", text, flags=re.I).strip()
    text = text.strip('"“”').strip()
    if not 20 <= len(text) <= 400 or "AI assistant" in text or "request" in text.lower():
        return None
    return text


def runs(text: str, n: int = 8) -> set:
    words = re.findall(r"\w+", text.lower())
    return {tuple(words[i:i + n]) for i in range(len(words) - n + 1)}


def kept_apart() -> set:
    """8-word runs of every prompt that reports or chooses anything."""
    folder = Path(__file__).parent / "prompts"
    texts = [t for f in ("unseen-v1.jsonl", "heldout-v1.jsonl")
             for turns in load_prompt_file(folder / f)[1] for t in turns]
    texts += [t for name in DATASETS for turns in load_prompts(name)[1] for t in turns]
    return set().union(*map(runs, texts))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("--rounds", type=int, default=1, help="asks per (topic, task) pair")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--temperature", type=float, default=0.9)
    ap.add_argument("--batch", type=int, default=64)
    a = ap.parse_args()
    if a.rounds < 1 or not 0 < a.temperature <= 2:
        print("error: --rounds must be at least 1 and --temperature in (0, 2]", file=sys.stderr)
        raise SystemExit(2)
    try:  # before ten minutes of generation, not after
        a.out.touch()
    except OSError as e:
        print(f"error: cannot write {a.out} ({e.strerror or e})", file=sys.stderr)
        raise SystemExit(2) from None
    target, tok = load_demo_feature_target()
    tic = time.time()
    with tempfile.TemporaryDirectory() as tmp:
        self_distill_features(target, tok, asks(a.rounds), Path(tmp), max_tokens=64,
                              batch_size=a.batch, temperature=a.temperature, seed=a.seed,
                              progress=lambda d, n: print(f"{d}/{n} asks, {time.time() - tic:.0f}s",
                                                          file=sys.stderr, flush=True))
        answers = [tok.decode(s.sequence(i)[0][s.answer_start(i):].tolist())
                   for s in load_shards(Path(tmp)) for i in range(s.num_sequences)]
    apart, seen, rows = kept_apart(), set(), []
    eos = tok.eos_token or "<|im_end|>"
    for answer in answers:
        text = clean(answer.split(eos)[0])
        if text is None or text.lower() in seen or runs(text) & apart:
            continue
        seen.add(text.lower())
        rows.append({"family": "self-instruct", "prompt": text})
    a.out.write_text("".join(json.dumps(r) + "\n" for r in rows))
    print(f"{len(rows)} requests of {len(answers)} answers in {time.time() - tic:.0f}s -> {a.out}",
          file=sys.stderr)


if __name__ == "__main__":
    main()
