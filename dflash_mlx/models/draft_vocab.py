"""A restricted draft LM head: score only the tokens the target actually tends to produce.

At a small target the shared LM head is most of a draft pass (SmolLM2: 4 slots × 576 × 49152
MACs, about one whole target step). Proposing from the N most frequent target predictions keeps
verification exact (the target still checks every token against its full distribution; a v1
draft's proposals are one-hot, so the rejection rule is unchanged) and only costs acceptance when
the target's next token lies outside the set. `draft_vocab.json` next to a draft enables it.
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path
from typing import Callable, Iterable

import mlx.core as mx
import mlx.nn as nn

from ..errors import CheckpointError

FILENAME = "draft_vocab.json"


def head_rows(head: nn.Module, ids: mx.array) -> Callable[[mx.array], mx.array]:
    """logits over `ids` only, from the rows of an LM head or tied embedding (quantized or not)."""
    # Gathered rows are evaluated here: a lazy graph built on this thread's stream cannot be
    # evaluated later from another thread (a server's or the TUI's generation worker).
    if isinstance(head, (nn.QuantizedLinear, nn.QuantizedEmbedding)):
        w, s = head.weight[ids], head.scales[ids]
        b = head["biases"][ids] if "biases" in head else None
        mx.eval(w, s, *([b] if b is not None else []))
        gs, bits, mode = head.group_size, head.bits, getattr(head, "mode", "affine")
        return lambda h: mx.quantized_matmul(h, w, s, b, transpose=True, group_size=gs,
                                             bits=bits, mode=mode)
    if isinstance(head, (nn.Linear, nn.Embedding)):
        w = head.weight[ids]
        mx.eval(w)
        return lambda h: h @ w.T
    raise TypeError(f"cannot restrict a {type(head).__name__} head")


def most_frequent(predictions: Iterable, size: int, always: Iterable[int] = (),
                  vocab_size: int = 0) -> tuple[list[int], float]:
    """The `size` most frequent ids (plus `always`) and the share of predictions they cover."""
    counts = Counter()
    for chunk in predictions:
        counts.update(int(t) for t in chunk)
    keep = dict.fromkeys(list(always))
    for tok, _ in counts.most_common():
        if len(keep) >= size:
            break
        keep[tok] = None
    # Fewer distinct predictions than `size`: fill with the lowest ids. In a BPE vocabulary
    # those are the earliest merges, the tokens most frequent in the tokenizer's own corpus.
    tok = 0
    while len(keep) < size and vocab_size and tok < vocab_size:
        keep.setdefault(tok, None)
        tok += 1
    total = sum(counts.values())
    covered = sum(counts[t] for t in keep) / total if total else 0.0
    return sorted(keep), covered


def save(folder: Path, ids: list[int], coverage: float, source: str) -> Path:
    from ..atomic import write_atomic

    return write_atomic(Path(folder) / FILENAME, json.dumps(
        {"size": len(ids), "coverage": round(coverage, 5), "source": source, "ids": ids}))


def read(folder: Path, vocab_size: int | None = None) -> list[int] | None:
    found = read_with_coverage(folder, vocab_size)
    return None if found is None else found[0]


def read_with_coverage(folder: Path, vocab_size: int | None = None
                       ) -> tuple[list[int], float] | None:
    """The ids and coverage in `draft_vocab.json`, checked: each id an integer in the
    vocabulary (`vocab_size` when known), so a bad file never reaches MLX indexing."""
    path = Path(folder) / FILENAME
    if not path.is_file():
        return None
    try:
        saved = json.loads(path.read_text())
    except (ValueError, UnicodeDecodeError, RecursionError) as e:
        raise CheckpointError(f"{path}: not valid JSON ({_line(e)})") from None
    if not isinstance(saved, dict) or "ids" not in saved:
        raise CheckpointError(f"{path}: expected an object with an 'ids' list")
    ids, coverage = saved["ids"], saved.get("coverage", 0.0)
    if not isinstance(ids, list) or not ids or not all(
            isinstance(i, int) and not isinstance(i, bool) for i in ids):
        raise CheckpointError(f"{path}: 'ids' must be a non-empty list of token ids")
    top = vocab_size if vocab_size else 1 << 22
    bad = next((i for i in ids if not 0 <= i < top), None)
    if bad is not None:
        raise CheckpointError(f"{path}: token id {bad} is outside the vocabulary (0..{top - 1})")
    if len(set(ids)) != len(ids):
        raise CheckpointError(f"{path}: 'ids' lists a token twice")
    if isinstance(coverage, bool) or not isinstance(coverage, (int, float)) \
            or not 0 <= coverage <= 1:
        raise CheckpointError(f"{path}: 'coverage' must be a number in [0, 1]")
    return ids, float(coverage)


def _line(e: Exception) -> str:
    return " ".join(str(e).split())[:120] or type(e).__name__
