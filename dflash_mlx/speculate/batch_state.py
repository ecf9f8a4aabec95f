"""GatedDeltaNet layers in a batch: `RaggedStateCache`, one recurrent and conv state per row.

A GatedDeltaNet layer (mlx-lm's `qwen3_5` family) keeps no history to mask, only a fixed-size
state per sequence, so a batch stacks its rows' states (B, ...) and a pass of W tokens moves
every row W steps, shorter rows through their padding too. After the pass each row must hold
the state after only the steps it keeps. As for one sequence (`models/hybrid.py`), the
recurrence is causal: the state after the first n steps of a pass is a function of the state
before it and those n steps' inputs. So a short pass (a verify round, a plain step) keeps its
inputs (a `_Capture`, taken by the hybrid target's stand-in), and `set_lengths` replays them
for the rows that keep fewer steps than the pass gave them: one `gated_delta_update` over all
of them with mlx-lm's padding mask (a masked step leaves a row's state as it was), and each
row's conv state the K - 1 inputs ending at its own count. A prefill pass, too long to keep,
is told each row's real tokens beforehand (`expect`) and masks the padding in the pass, as
mlx-lm's own `ArraysCache.lengths` does for its batches.

The rows' token counts are the batch's K/V layers' (`batch_cache.row_lengths`); the hybrid
target hands each pass its rows' counts before it (`begin`), so a rollback can say exactly
how far back a row goes, and refuses what the last pass cannot give back.
"""

from __future__ import annotations

import mlx.core as mx
from mlx_lm.models.cache import ArraysCache


class RaggedStateCache:
    """One GatedDeltaNet target layer's states for a batch: [conv (B, K-1, C), state (B, ...)]."""

    def __init__(self):
        self.cache: list[mx.array | None] = [None, None]
        self.size = 0  # rows
        self.base: list[int | None] = []  # per row: its tokens before the last pass (None: none)
        self.done: list[int] = []  # per row: steps its state moved in that pass
        self.valid: list[int] | None = None  # the next pass's real tokens per row (None: all)
        self.capture = None  # the last pass's inputs (`models.hybrid._Capture`), if kept

    def __getitem__(self, i):
        return self.cache[i]

    def __setitem__(self, i, value):
        self.cache[i] = value

    @property
    def batch_size(self) -> int:
        return self.size

    @property
    def state(self) -> list:
        return [c for c in self.cache if c is not None]

    @property
    def nbytes(self) -> int:
        return sum(c.nbytes for c in self.state)

    def empty(self) -> bool:
        return self.cache[1] is None

    def is_trimmable(self) -> bool:
        return False  # rows roll back one by one: `set_lengths`

    # -- a pass --
    def expect(self, valid: list[int] | None):
        """Row b brings `valid[b]` real tokens to the next pass; the rest is padding."""
        self.valid = None if valid is None else list(valid)

    def make_mask(self, N: int, **kwargs) -> mx.array | None:
        """(B, N): the steps that are a row's own (mlx-lm's `create_ssm_mask` asks)."""
        if self.valid is None:
            return None
        return mx.arange(N)[None] < mx.array(self.valid)[:, None]

    def begin(self, base: list[int]):
        """A pass starts from these token counts per row (its K/V layers')."""
        self.base, self.done, self.capture = list(base), [0] * self.size, None

    def took(self, capture, steps: int):
        """The pass moved every row `steps` steps (its real tokens, if `expect` said them)."""
        self.capture = capture
        self.done = list(self.valid) if self.valid is not None else [steps] * self.size

    def advance(self, n: int):
        self.valid = None  # said for one pass

    # -- rows keep what they accepted --
    def set_lengths(self, lengths: list[int]):
        """Row b keeps its first `lengths[b]` tokens: its state goes back to that count."""
        back = []
        for b, (n, base, done) in enumerate(zip(lengths, self.base, self.done)):
            if base is None:  # no pass since it joined: nothing to undo
                continue
            if not base <= n <= base + done:
                raise ValueError(f"row {b}: its state holds tokens {base}..{base + done}, "
                                 f"not {n}")
            if n < base + done:
                back.append(b)
        if back:
            self._replay([n - (base or 0) for n, base in zip(lengths, self.base)], back)
        self.done = [n - base if base is not None else d
                     for n, base, d in zip(lengths, self.base, self.done)]

    def _replay(self, steps: list[int], rows: list[int]):
        """Rows `rows` get the state after their first `steps[b]` steps of the last pass."""
        cap = self.capture
        if cap is None or max(rows) >= cap.rows:
            raise ValueError("the last pass kept no inputs to roll these rows back")
        m = cap.rows  # rows that joined since are after these, untouched
        pick = mx.array([b in rows for b in range(m)])
        conv, state = cap.replay([steps[b] if b in rows else 0 for b in range(m)])
        # every row started fresh and goes back to the start
        state = mx.zeros_like(self.cache[1][:m]) if state is None else state
        conv = mx.zeros_like(self.cache[0][:m]) if conv is None else conv
        for i, new in ((0, conv), (1, state)):
            now = self.cache[i]
            mine = mx.where(pick.reshape((m,) + (1,) * (now.ndim - 1)), new, now[:m])
            self.cache[i] = mine if m == self.size else mx.concatenate([mine, now[m:]])

    # -- rows join and leave --
    def filter(self, keep: list[int]):
        idx = mx.array(keep, mx.int32)
        if keep:
            self.cache = [None if c is None else c[idx] for c in self.cache]
        else:
            self.cache = [None, None]
        cap = self.capture
        if cap is not None:  # its rows are the first ones (joins append)
            old = [i for i in keep if i < cap.rows]
            self.capture = cap.select(old) if old and keep[: len(old)] == old else None
        self.base = [self.base[i] for i in keep]
        self.done = [self.done[i] for i in keep]
        self.size, self.valid = len(keep), None

    def add(self, *caches) -> None:
        """Append sequences from their own mlx-lm `ArraysCache`s (or empty caches: fresh rows
        a shared prefill fills)."""
        states = [c.cache if isinstance(c, ArraysCache) else [None, None] for c in caches]
        self._append(len(caches), [_stack([s[i] for s in states]) for i in range(2)])

    def extend(self, other: "RaggedStateCache"):
        """Append `other`'s rows (rows prefilled together)."""
        self._append(other.size, other.cache)

    def _append(self, n: int, arrays: list):
        self.cache = [_concat(self.size, a, n, b) for a, b in zip(self.cache, arrays)]
        self.base += [None] * n
        self.done += [0] * n
        self.size += n  # the last pass's capture covers the rows before these

    def export(self, b: int) -> ArraysCache:
        """Row b as a single sequence's mlx-lm `ArraysCache` (copies)."""
        c = ArraysCache(2)
        if not self.empty():
            c.cache = [None if a is None else mx.contiguous(a[b: b + 1]) for a in self.cache]
        return c


def _stack(rows: list[mx.array | None]) -> mx.array | None:
    """Rows (1, ...) into one (n, ...); a missing row (a fresh state) is zeros."""
    like = next((r for r in rows if r is not None), None)
    if like is None:
        return None
    return mx.concatenate([r if r is not None else mx.zeros_like(like) for r in rows])


def _concat(n1: int, a: mx.array | None, n2: int, b: mx.array | None) -> mx.array | None:
    if a is None and b is None:
        return None
    like = a if a is not None else b
    a = a if a is not None else mx.zeros((n1,) + like.shape[1:], like.dtype)
    b = b if b is not None else mx.zeros((n2,) + like.shape[1:], like.dtype)
    return mx.concatenate([a, b]) if n1 else b
