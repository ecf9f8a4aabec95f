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

from .errors import TrainingDataError
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
    "the solar system", "photosynthesis in algae", "the Industrial Revolution", "batteries",
    "the human brain", "artificial intelligence", "the Amazon rainforest", "glaciers",
    "social media", "remote work", "budgeting", "credit scores", "nutrition labels",
    "the Cold War", "ancient Egypt", "the Silk Road", "Shakespeare", "impressionism",
    "photography", "video games", "electric guitars", "classical music", "film editing",
    "the stock exchange", "taxes", "small businesses", "negotiation", "leadership",
    "team work", "learning a language", "the scientific method", "statistics", "calculus",
    "linear algebra", "matrices", "logarithms", "geometry", "graph theory", "databases",
    "operating systems", "compilers", "version control", "unit testing", "APIs",
    "web browsers", "password security", "open source software", "3D printing", "robots",
    "self-driving cars", "airplanes", "rockets", "submarines", "bridges", "skyscrapers",
    "wind turbines", "nuclear power", "air pollution", "biodiversity", "coral reefs",
    "migration of birds", "cats", "dogs", "wolves", "elephants", "octopuses", "mushrooms",
    "tea", "chocolate", "pizza", "spices", "fermentation", "running shoes", "yoga",
    "the Moon", "Mars", "comets", "the Big Bang", "magnetism", "electricity", "sound waves",
]
TEMPLATES = [
    "What is {s}?", "Explain {s} in simple terms.", "Give me three interesting facts about {s}.",
    "Why is {s} important?", "Write a short paragraph about {s}.",
    "How would you explain {s} to a child?", "What are the main ideas behind {s}?",
    "Summarize the history of {s} in a few sentences.", "What are common misconceptions about {s}?",
    "Write a haiku about {s}.", "List the pros and cons of {s}.", "Tell me a fun story involving {s}.",
    "What should a beginner know about {s}?", "Compare {s} and {t}.",
    "Write a short email to a friend recommending they learn about {s}.",
    "Write a blog post introduction about {s}.", "Describe {s} in two sentences.",
    "What is the connection between {s} and {t}?", "Write a limerick about {s}.",
    "Pretend you are a teacher. Give a short lesson on {s}.",
    "What are the biggest open questions about {s}?", "How has {s} changed over time?",
    "Give a step-by-step guide to getting started with {s}.",
    "Write a persuasive paragraph arguing that everyone should care about {s}.",
    "Create a short quiz with three questions about {s}.",
    "Write a dialogue between two friends discussing {s}.",
    "What would happen if {s} did not exist?", "Define {s} and give an example.",
    "Write a product description for a book about {s}.",
    "Explain how {s} affects everyday life.",
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
    "returns the n-th triangular number", "counts the occurrences of a character in a string",
    "returns the common elements of two lists", "checks whether a year is a leap year",
    "converts a decimal number to binary", "finds the minimum of three numbers",
    "capitalizes the first letter of every word", "returns the length of the longest word",
    "rotates a list by k positions", "checks whether a list is sorted",
    "computes the average of a list of numbers", "returns all even numbers from a list",
    "replaces spaces in a string with underscores", "computes the power set of a set",
    "finds the index of the first repeated character", "computes the area of a circle",
    "splits a list into chunks of size n", "returns the median of a list",
    "checks whether a number is a perfect square", "counts the lines in a text file",
    "sums the squares of the first n natural numbers", "removes all vowels from a string",
    "returns the product of all elements in a list", "finds the missing number in 1..n",
    "converts a list of strings to integers", "checks whether parentheses are balanced",
]
CODE_TEMPLATES = [
    "Write a Python function that {c}.", "Write a Python function that {c}. Include a docstring.",
    "How do I write a function in Python that {c}?", "Write a JavaScript function that {c}.",
    "Explain step by step how to write code that {c}.",
    "Write a function that {c}.", "Write a Python program that {c} and prints the result.",
    "Write a Python function that {c}, with two test cases.", "Write a C function that {c}.",
    'Complete this Python function:\n\ndef solve(data):\n    """A function that {c}."""\n',
]
MATH_TEMPLATES = [
    "A shop sells apples for ${a} each. Tom buys {b} apples and pays with a ${c} bill. "
    "How much change does he get?",
    "A train travels {a} miles per hour for {b} hours. How far does it go?",
    "Sara has {a} marbles. She gives {b} to her brother and buys {c} more. How many does she have?",
    "What is {a} times {b}, plus {c}?",
    "A rectangle is {a} cm long and {b} cm wide. What are its area and perimeter?",
    "If {a} workers build a wall in {b} days, how long would {c} workers take?",
    "Solve for x: {a}x + {b} = {c}.", "What is the sum of the first {a} positive integers?",
    "A recipe needs {b} eggs for {a} cookies. How many eggs are needed for {c} cookies?",
    "Lisa reads {a} pages a day. How many days does she need for a {c}{b}-page book?",
    "A car uses {b} liters of fuel per 100 km. How much fuel does it need for {a}0 km?",
    "What is {a}% of {c}0?", "Find the remainder when {c}{a} is divided by {b}.",
    "A class has {a} students and {b} of them are absent. What fraction is present?",
    "John earns ${a} per hour and works {b} hours a week. How much does he earn in {c} weeks?",
    "What is the least common multiple of {a} and {b}?",
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


def bucketed_prompts(tokenizer, n: int, batch: int, seed: int = 0) -> list[str]:
    """`n` varied prompts in whole batches of one token length (batched decoding, no padding).

    Draws many candidates and keeps whole batches from the most common lengths.
    """
    buckets: dict[int, list[str]] = {}
    for p in chat_prompts(n * 8, seed=seed):
        buckets.setdefault(len(_chat_ids(tokenizer, p)), []).append(p)
    prompts: list[str] = []
    for group in sorted(buckets.values(), key=len, reverse=True):
        prompts += group[:batch]
        if len(prompts) >= n:
            break
    random.Random(seed).shuffle(prompts)
    return prompts


def self_distill_features(target: Target, tokenizer, prompts: list[str], out_dir: Path, *,
                          max_tokens: int = 200, batch_size: int = 48, temperature: float = 0.0,
                          seed: int = 0, progress: Callable[[int, int], None] | None = None) -> int:
    """The target answers each prompt; its taps and argmax are recorded in the same passes.

    Prompts are batched by exact token length, so a plain batched KV cache needs no padding
    and no second (teacher-forced) pass is needed. Returns the number of tokens written.
    """
    encoded = [_chat_ids(tokenizer, p) for p in prompts]
    by_len: dict[int, list[list[int]]] = {}
    for ids in encoded:
        by_len.setdefault(len(ids), []).append(ids)
    eos = set(getattr(tokenizer, "eos_token_ids", []) or [])
    key = mx.random.key(seed)
    writer = ShardWriter(out_dir, target)
    done = 0
    for group in by_len.values():
        for start in range(0, len(group), batch_size):
            batch = group[start : start + batch_size]
            cache = target.make_cache()
            x = mx.array(batch)
            taps, preds, toks = [], [], [x]
            finished = np.zeros(len(batch), dtype=bool)
            for _ in range(max_tokens):
                logits, t = target(x, cache)
                last = logits[:, -1, :]
                pred = mx.argmax(logits, axis=-1)
                if temperature > 0:
                    key, sub = mx.random.split(key)
                    x = mx.random.categorical(last / temperature, key=sub)[:, None]
                else:
                    x = pred[:, -1:]
                taps.append(t.astype(mx.float16))
                preds.append(pred)
                toks.append(x)
                mx.eval(x, taps[-1], preds[-1])
                finished |= np.isin(np.array(x[:, 0]), list(eos))
                if finished.all():
                    break
            tok = np.array(mx.concatenate(toks[:-1], axis=1))  # the last token was never fed
            tap = np.array(mx.concatenate(taps, axis=1))
            prd = np.array(mx.concatenate(preds, axis=1)).astype(np.int32)
            for r in range(len(batch)):
                n = tok.shape[1]
                for i in range(len(batch[r]), n):  # cut after the answer's first EOS
                    if int(tok[r, i]) in eos:
                        n = i + 1
                        break
                writer.add(tok[r, :n], prd[r, :n], tap[r, :n], answer=len(batch[r]))
            done += len(batch)
            if progress:
                progress(done, len(prompts))
    writer.close()
    return writer.total


def _chat_ids(tokenizer, prompt: str) -> list[int]:
    ids = tokenizer.apply_chat_template([{"role": "user", "content": prompt}],
                                        add_generation_prompt=True)
    return list(ids["input_ids"]) if isinstance(ids, dict) else list(ids)


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
    answers: np.ndarray | None = None  # (S,) where each answer starts (None: everywhere)

    def sequence(self, i: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        a, b = self.starts[i], self.starts[i + 1]
        return self.tokens[a:b], self.preds[a:b], self.taps[a:b]

    def answer_start(self, i: int) -> int:
        """First position the draft is trained to predict from (0 for plain text)."""
        return 0 if self.answers is None else int(self.answers[i])

    @property
    def num_sequences(self) -> int:
        return len(self.starts) - 1


class ShardWriter:
    """Appends sequences (tokens, predictions, taps) and writes atomic .npz shards."""

    def __init__(self, out_dir: Path, target: Target, shard_tokens: int = 10_000):
        self.out = Path(out_dir)
        self.out.mkdir(parents=True, exist_ok=True)
        self.index = len(list(self.out.glob("shard_*.npz")))
        self.shard_tokens, self.total = shard_tokens, 0
        self._reset()
        (self.out / "features.json").write_text(json.dumps(
            {"tap_ids": target.tap_ids, "hidden_size": target.hidden_size}, indent=2))

    def _reset(self):
        self.toks, self.preds, self.taps, self.starts, self.answers = [], [], [], [0], []

    def add(self, tokens: np.ndarray, preds: np.ndarray, taps: np.ndarray, answer: int = 0):
        self.answers.append(answer)
        self.toks.append(np.asarray(tokens, dtype=np.int32))
        self.preds.append(np.asarray(preds, dtype=np.int32))
        self.taps.append(np.asarray(taps, dtype=np.float16))
        self.starts.append(self.starts[-1] + len(tokens))
        self.total += len(tokens)
        if self.starts[-1] >= self.shard_tokens:
            self.flush()

    def flush(self):
        if len(self.starts) == 1:
            return
        tmp = self.out / f".shard_{self.index:04d}.tmp.npz"
        np.savez(tmp, tokens=np.concatenate(self.toks), preds=np.concatenate(self.preds),
                 taps=np.concatenate(self.taps), starts=np.array(self.starts, dtype=np.int64),
                 answers=np.array(self.answers, dtype=np.int64))
        tmp.rename(self.out / f"shard_{self.index:04d}.npz")  # a shard is whole or absent
        self.index += 1
        self._reset()

    def close(self):
        self.flush()


def extract_features(target: Target, sequences: Iterable[list[int]], out_dir: Path, *,
                     shard_tokens: int = 50_000, min_len: int = 16,
                     progress: Callable[[int], None] | None = None) -> int:
    """Teacher-force the target over each sequence once; write taps + predictions."""
    writer = ShardWriter(out_dir, target, shard_tokens)
    for seq in sequences:
        if len(seq) < min_len:
            continue
        logits, t = target(mx.array([seq]), target.make_cache())
        p = mx.argmax(logits[0], axis=-1)
        mx.eval(p, t)
        writer.add(np.array(seq), np.array(p), np.array(t[0].astype(mx.float16)))
        if progress:
            progress(writer.total)
    writer.close()
    return writer.total


def load_shards(folder: Path) -> list[FeatureShard]:
    shards = []
    for f in sorted(Path(folder).glob("shard_*.npz")):
        z = np.load(f)
        answers = z["answers"] if "answers" in z.files else None
        shards.append(FeatureShard(z["tokens"], z["preds"], z["taps"], z["starts"], answers))
    return shards


def split_heldout(shards: list[FeatureShard], n_sequences: int) -> tuple[list, list]:
    """Hold out the last `n_sequences` sequences (never trained on), across shards if need be."""
    train, held, need = list(shards), [], n_sequences
    while need > 0 and train:
        last = train.pop()
        k = last.num_sequences - need
        if k <= 0:  # the whole shard is held out
            held.insert(0, last)
            need -= last.num_sequences
            continue
        cut = last.starts[k]
        ans = (None, None) if last.answers is None else (last.answers[:k], last.answers[k:])
        train.append(FeatureShard(last.tokens[:cut], last.preds[:cut], last.taps[:cut],
                                  last.starts[: k + 1], ans[0]))
        held.insert(0, FeatureShard(last.tokens[cut:], last.preds[cut:], last.taps[cut:],
                                    last.starts[k:] - cut, ans[1]))
        need = 0
    if need > 0 or not train:
        raise TrainingDataError(
            f"not enough sequences to hold {n_sequences} out (--heldout) and train on the rest")
    return train, held
