"""Training data for a DFlash draft: the target's own responses, its taps and its predictions.

One teacher-forced target pass over a sequence yields both the tapped hidden states (the
draft's context) and the target's next-token argmax at every position (the draft's labels:
acceptance measures agreement with the *target*, not with the text). Features are written
once to disk so training epochs never re-run the target.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable, Iterator

import mlx.core as mx
import numpy as np

from .target import Target

SUBJECTS = [
    "photosynthesis", "the water cycle", "black holes", "compound interest", "machine learning",
    "the French Revolution", "climate change", "vaccines", "the stock market", "recursion",
    "prime numbers", "the immune system", "volcanoes", "electric cars", "the internet",
    "democracy", "gravity", "DNA", "the Roman Empire", "renewable energy", "sleep",
    "coffee", "honeybees", "the moon landing", "inflation", "blockchain", "earthquakes",
    "the human heart", "plate tectonics", "quantum computing", "the Renaissance",
    "ocean tides", "solar panels", "meditation", "the printing press", "antibiotics",
    "rainbows", "the speed of light", "hash tables", "sorting algorithms", "neural networks",
    "the Great Wall of China", "chess", "jazz music", "healthy eating", "time management",
    "public speaking", "gardening", "the Pythagorean theorem", "probability", "fractions",
    "supply and demand", "the periodic table", "evolution", "cloud computing", "encryption",
    "dinosaurs", "the Olympic Games", "marathon training", "bread baking", "recycling",
]
TEMPLATES = [
    "What is {s}?", "Explain {s} in simple terms.", "Give me three interesting facts about {s}.",
    "Why is {s} important?", "Write a short paragraph about {s}.",
    "How would you explain {s} to a child?", "What are the main ideas behind {s}?",
    "Summarize the history of {s} in a few sentences.", "What are common misconceptions about {s}?",
    "Write a haiku about {s}.", "List the pros and cons of {s}.", "Tell me a fun story involving {s}.",
    "What should a beginner know about {s}?", "Compare {s} and {t}.",
    "Write a short email to a friend recommending they learn about {s}.",
]
CODE_TASKS = [
    "reverses a string", "checks whether a number is prime", "returns the factorial of n",
    "computes the n-th Fibonacci number", "counts the vowels in a string",
    "removes duplicates from a list while keeping order", "finds the largest element of a list",
    "checks whether a string is a palindrome", "merges two sorted lists",
    "returns the sum of the digits of an integer", "flattens a nested list",
    "counts word frequencies in a text", "converts Celsius to Fahrenheit",
    "computes the greatest common divisor of two numbers", "sorts a list of tuples by the second item",
    "returns the second largest number in a list", "checks whether two strings are anagrams",
    "implements binary search", "transposes a matrix", "validates an email address with a regex",
]
CODE_TEMPLATES = [
    "Write a Python function that {c}.", "Write a Python function that {c}. Include a docstring.",
    "How do I write a function in Python that {c}?", "Write a JavaScript function that {c}.",
    "Explain step by step how to write code that {c}.",
]
MATH_TEMPLATES = [
    "A shop sells apples for ${a} each. Tom buys {b} apples and pays with a ${c} bill. "
    "How much change does he get?",
    "A train travels {a} miles per hour for {b} hours. How far does it go?",
    "Sara has {a} marbles. She gives {b} to her brother and buys {c} more. How many does she have?",
    "What is {a} times {b}, plus {c}?",
    "A rectangle is {a} cm long and {b} cm wide. What are its area and perimeter?",
    "If {a} workers build a wall in {b} days, how long would {c} workers take?",
]


def chat_prompts(n: int, seed: int = 0) -> list[str]:
    """A varied set of chat, code and arithmetic requests (none taken from a benchmark)."""
    rng = random.Random(seed)
    out: dict[str, None] = {}  # ordered and deduplicated, so a seed gives the same list
    while len(out) < n:
        kind = rng.random()
        if kind < 0.6:
            s, t = rng.sample(SUBJECTS, 2)
            out[rng.choice(TEMPLATES).format(s=s, t=t)] = None
        elif kind < 0.85:
            out[rng.choice(CODE_TEMPLATES).format(c=rng.choice(CODE_TASKS))] = None
        else:
            a, b, c = rng.randint(2, 60), rng.randint(2, 30), rng.randint(2, 100)
            q = rng.choice(MATH_TEMPLATES).format(a=a, b=b, c=c)
            out[q + " Please reason step by step."] = None
    return list(out)


def self_distill(model, tokenizer, prompts: list[str], *, max_tokens: int = 256,
                 batch_size: int = 32, temperature: float = 0.0,
                 progress: Callable[[int, int], None] | None = None) -> Iterator[list[int]]:
    """The target's own answers: yields prompt+response token ids per prompt."""
    from mlx_lm.generate import batch_generate
    from mlx_lm.sample_utils import make_sampler

    sampler = make_sampler(temp=temperature) if temperature > 0 else None
    for start in range(0, len(prompts), batch_size):
        chunk = prompts[start : start + batch_size]
        ids = [tokenizer.apply_chat_template([{"role": "user", "content": p}],
                                             add_generation_prompt=True) for p in chunk]
        ids = [list(x["input_ids"]) if isinstance(x, dict) else list(x) for x in ids]
        kw = {"sampler": sampler} if sampler else {}
        res = batch_generate(model, tokenizer, ids, max_tokens=max_tokens,
                             return_token_ids=True, **kw)
        for prompt_ids, out in zip(ids, res.token_ids):
            yield prompt_ids + list(out)
        if progress:
            progress(min(start + batch_size, len(prompts)), len(prompts))


def text_sequences(tokenizer, texts: Iterable[str], length: int = 512) -> Iterator[list[int]]:
    """Plain text cut into teacher-forcing chunks of `length` tokens."""
    buf: list[int] = []
    for text in texts:
        buf.extend(tokenizer.encode(text))
        while len(buf) >= length:
            yield buf[:length]
            buf = buf[length:]


@dataclass
class FeatureShard:
    tokens: np.ndarray  # (N,) int32, sequences back to back
    preds: np.ndarray  # (N,) int32, target argmax for the *next* position
    taps: np.ndarray  # (N, n_taps * hidden) float16
    starts: np.ndarray  # (S + 1,) int64 sequence boundaries

    def sequence(self, i: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        a, b = self.starts[i], self.starts[i + 1]
        return self.tokens[a:b], self.preds[a:b], self.taps[a:b]

    @property
    def num_sequences(self) -> int:
        return len(self.starts) - 1


def extract_features(target: Target, sequences: Iterable[list[int]], out_dir: Path, *,
                     shard_tokens: int = 50_000, min_len: int = 16,
                     progress: Callable[[int], None] | None = None) -> int:
    """Run the target over each sequence once; write taps + predictions shards. Returns tokens."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    index = len(list(out_dir.glob("shard_*.npz")))
    toks, preds, taps, starts, total = [], [], [], [0], 0

    def flush():
        nonlocal toks, preds, taps, starts, index
        if len(starts) == 1:
            return
        tmp = out_dir / f".shard_{index:04d}.tmp.npz"
        np.savez(tmp, tokens=np.concatenate(toks), preds=np.concatenate(preds),
                 taps=np.concatenate(taps), starts=np.array(starts, dtype=np.int64))
        tmp.rename(out_dir / f"shard_{index:04d}.npz")  # atomic: a shard is whole or absent
        index += 1
        toks, preds, taps, starts = [], [], [], [0]

    for seq in sequences:
        if len(seq) < min_len:
            continue
        cache = target.make_cache()
        logits, t = target(mx.array([seq]), cache)
        p = mx.argmax(logits[0], axis=-1).astype(mx.int32)
        t = t[0].astype(mx.float16)
        mx.eval(p, t)
        toks.append(np.array(seq, dtype=np.int32))
        preds.append(np.array(p))
        taps.append(np.array(t))
        starts.append(starts[-1] + len(seq))
        total += len(seq)
        if progress:
            progress(total)
        if starts[-1] >= shard_tokens:
            flush()
    flush()
    (out_dir / "features.json").write_text(json.dumps(
        {"tap_ids": target.tap_ids, "hidden_size": target.hidden_size}, indent=2))
    return total


def load_shards(folder: Path) -> list[FeatureShard]:
    shards = []
    for f in sorted(Path(folder).glob("shard_*.npz")):
        z = np.load(f)
        shards.append(FeatureShard(z["tokens"], z["preds"], z["taps"], z["starts"]))
    return shards


def split_heldout(shards: list[FeatureShard], n_sequences: int) -> tuple[list, list]:
    """Hold out the last `n_sequences` sequences of the last shard (never trained on)."""
    last = shards[-1]
    k = last.num_sequences - n_sequences
    if k < 1:
        raise ValueError("not enough sequences to hold some out")
    cut = last.starts[k]
    train = FeatureShard(last.tokens[:cut], last.preds[:cut], last.taps[:cut], last.starts[: k + 1])
    held = FeatureShard(last.tokens[cut:], last.preds[cut:], last.taps[cut:],
                        last.starts[k:] - cut)
    return shards[:-1] + [train], [held]
