"""Training data for a DFlash draft: the target's own responses, its taps and its predictions.

One teacher-forced target pass over a sequence yields both the tapped hidden states (the
draft's context) and the target's next-token argmax at every position (the draft's labels:
acceptance measures agreement with the *target*, not with the text). Features are written
once to disk so training epochs never re-run the target.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable, Iterator

import mlx.core as mx
import numpy as np
from mlx_lm.models.cache import BatchKVCache, KVCache

from ..errors import TrainingDataError
from ..atomic import write_atomic
from ..models.target import Target

def self_distill_features(target: Target, tokenizer, prompts: list[str], out_dir: Path, *,
                          max_tokens: int = 200, batch_size: int = 48, temperature: float = 0.0,
                          seed: int = 0, progress: Callable[[int, int], None] | None = None) -> int:
    """The target answers each prompt; its taps and argmax are recorded in the same passes.

    Prompts are sorted by length and decoded in left-padded batches (a batch KV cache masks
    the padding and gives each row its own positions), so answers need no second
    teacher-forced pass. Returns the number of tokens written.
    """
    encoded = sorted((_chat_ids(tokenizer, p) for p in prompts), key=len)
    eos = set(getattr(tokenizer, "eos_token_ids", []) or [])
    key = mx.random.key(seed)
    writer = ShardWriter(out_dir, target)
    for start in range(0, len(encoded), batch_size):
        batch = encoded[start : start + batch_size]
        width = len(batch[-1])
        pads = [width - len(ids) for ids in batch]
        cache = target.make_cache()
        if any(pads):
            if not all(type(c) is KVCache for c in cache):
                raise TrainingDataError("self-distillation batches prompts of different lengths, "
                                        "which needs a plain attention KV cache; use --batch 1")
            cache = [BatchKVCache(pads) for _ in cache]
        x = mx.array([[0] * p + ids for p, ids in zip(pads, batch)])
        taps, preds, toks = [], [], [x]
        finished = np.zeros(len(batch), dtype=bool)
        for _ in range(max_tokens):
            logits, t = target(x, cache)
            pred = mx.argmax(logits, axis=-1)
            if temperature > 0:
                key, sub = mx.random.split(key)
                x = mx.random.categorical(logits[:, -1, :] / temperature, key=sub)[:, None]
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
        for r, pad in enumerate(pads):
            n = tok.shape[1]
            for i in range(width, n):  # cut after the answer's first EOS
                if int(tok[r, i]) in eos:
                    n = i + 1
                    break
            writer.add(tok[r, pad:n], prd[r, pad:n], tap[r, pad:n], answer=width - pad)
        if progress:
            progress(start + len(batch), len(encoded))
    writer.close()
    return writer.total


def distill_prompts(target: Target, tokenizer, prompts: list[str], out_dir: Path, *,
                    sampled_fraction: float, max_tokens: int, batch_size: int, seed: int = 0,
                    progress: Callable[[int, int], None] | None = None) -> int:
    """Greedy answers to the first prompts, answers sampled at T=0.7 to the last
    `sampled_fraction`; `progress(done, total)` counts over both. Returns tokens written."""
    n_greedy = int(len(prompts) * (1 - sampled_fraction))

    def after(base):
        return None if progress is None else (lambda done, _: progress(base + done, len(prompts)))

    total = self_distill_features(target, tokenizer, prompts[:n_greedy], out_dir,
                                  max_tokens=max_tokens, batch_size=batch_size, progress=after(0))
    if n_greedy < len(prompts):
        total += self_distill_features(target, tokenizer, prompts[n_greedy:], out_dir,
                                       max_tokens=max_tokens, batch_size=batch_size,
                                       temperature=0.7, seed=seed, progress=after(n_greedy))
    return total


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
        write_atomic(self.out / "features.json", json.dumps(
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
        arrays = dict(tokens=np.concatenate(self.toks), preds=np.concatenate(self.preds),
                      taps=np.concatenate(self.taps), starts=np.array(self.starts, dtype=np.int64),
                      answers=np.array(self.answers, dtype=np.int64))
        # a shard is whole or absent: a full disk never leaves half of one to load later
        write_atomic(self.out / f"shard_{self.index:04d}.npz", lambda f: np.savez(f, **arrays))
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
    """Every shard_*.npz in order. Links to one file (a mix that repeats a source to weight it)
    share one copy in memory: taps are most of a machine's RAM."""
    shards, loaded = [], {}
    for f in sorted(Path(folder).glob("shard_*.npz")):
        real = f.resolve()
        if real not in loaded:
            z = np.load(real)
            answers = z["answers"] if "answers" in z.files else None
            loaded[real] = FeatureShard(z["tokens"], z["preds"], z["taps"], z["starts"], answers)
        shards.append(loaded[real])
    return shards


def feature_taps(folder: Path) -> list[int] | None:
    """The target layers a feature folder's taps were recorded at (None: not recorded)."""
    try:
        return list(json.loads((Path(folder) / "features.json").read_text())["tap_ids"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


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
