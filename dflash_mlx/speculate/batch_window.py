"""Sliding-window layers in a batch: `RaggedWindowCache`, and the batch caches of a target.

Alone, a sliding-window layer keeps a `RotatingKVCache`: the last `max_size` entries, rotated
in place, and for a pass of several tokens a few more, with a mask that lets query q see key
k only when q - k < window. A batch cannot rotate rows that move by different amounts, so its
rows keep their entries in order, as a plain layer's do, and the window is the mask's: each
query sees its own row's entries up to itself and fewer than `window` positions back. That is
what the rotating cache computes, for any acceptance and any rollback (a rollback only moves a
row's end; nothing is overwritten that a shorter row could still need).

A row keeps only about a window of entries: before a pass that would grow the buffer, those no
query can read again go (`prepare`, which the target calls before every batched pass); and a
row that joins from a sequence's own rotating cache brings only what that cache still holds
(at least the last `window` entries, in order). So each row also counts the tokens before its
first entry: `offset` (the RoPE position) stays the sequence's length. A row written back to a
sequence goes as a rotating cache holding its last `window` entries, the state a rotating cache
that decoded one token at a time would be in.
"""

from __future__ import annotations

import mlx.core as mx
from mlx_lm.models.cache import ArraysCache, KVCache, RotatingKVCache, make_prompt_cache

from .batch_cache import RaggedKVCache
from .batch_state import RaggedStateCache


def in_order(c: RotatingKVCache) -> tuple[mx.array, mx.array] | tuple[None, None]:
    """The entries a rotating cache holds, oldest first (1, H, n, D)."""
    keys, values, offset, keep, _, idx = c.state
    if keys is None or offset == 0:
        return None, None
    if keep:
        raise ValueError("rotating caches that keep leading tokens are not batched")
    if offset > idx and idx < keys.shape[2]:  # wrapped: the oldest entry is at idx
        return (mx.concatenate([keys[..., idx:, :], keys[..., :idx, :]], axis=2),
                mx.concatenate([values[..., idx:, :], values[..., :idx, :]], axis=2))
    return keys[..., :idx, :], values[..., :idx, :]


class RaggedWindowCache(RaggedKVCache):
    """One sliding-window target layer's K/V for a batch: ragged rows, the window a mask."""

    def __init__(self, window: int):
        super().__init__()
        self.window = window
        self.dropped: list[int] = []  # per row: tokens before its first entry

    def lengths(self) -> list[int]:
        return [e - l + d for l, e, d in zip(self.left, self.end, self.dropped)]

    @property
    def offset(self) -> mx.array:
        return mx.array(self.lengths())

    def set_lengths(self, lengths: list[int]):
        for b, (n, d, held) in enumerate(zip(lengths, self.dropped, self.lengths())):
            if not d <= n <= held:
                raise ValueError(f"row {b} holds tokens {d}..{held}, not {n}")
        self.end = [l + n - d for l, n, d in zip(self.left, lengths, self.dropped)]

    def make_mask(self, N: int, return_array: bool = False, window_size=None, **kwargs):
        """(B, 1, N, S): query t of row b sees its own entries up to itself, fewer than the
        window back."""
        window = min(window_size or self.window, self.window)
        if self.aligned() and not return_array and self.end[0] + N <= window:
            return None if N == 1 else "causal"  # no entry is a window back from any query
        return self._rows_mask(N, window)

    def prepare(self, n: int):
        """Before a pass of `n` tokens that would grow the buffer: all but each row's last
        `window` entries go (what its own rotating cache would hold; the next query reads one
        fewer), the columns moving while no pass holds a mask of them. So a row holds about a
        window, not its whole history. Rows never roll back past their ends of now."""
        if self.keys is None or max(self.end) + n <= self.keys.shape[2]:
            return
        first = [max(l, e - self.window) for l, e in zip(self.left, self.end)]
        self.dropped = [d + f - l for d, f, l in zip(self.dropped, first, self.left)]
        self.left = first
        self._reserve(n, self.keys, self.values, cut=True)

    def filter(self, keep: list[int]):
        self.dropped = [self.dropped[i] for i in keep]
        super().filter(keep)

    def add(self, *caches) -> None:
        """Append sequences from their own caches: a `RotatingKVCache` (what it still holds)
        or an empty `KVCache` (a row a shared prefill fills)."""
        rows = []
        for c in caches:
            k, v = in_order(c) if isinstance(c, RotatingKVCache) else (None, None)
            if isinstance(c, KVCache) and c.keys is not None:
                k, v = c.keys[..., : c.offset, :], c.values[..., : c.offset, :]
            n = 0 if k is None else k.shape[2]
            rows.append((k, v, n))
            self.dropped.append(c.offset - n)
        self._add(rows)

    def extend(self, other: "RaggedWindowCache"):
        self.dropped += list(other.dropped)
        super().extend(other)

    def export(self, b: int) -> RotatingKVCache:
        """Row b as a rotating cache of its own holding its last `window` entries (a copy)."""
        c = RotatingKVCache(max_size=self.window)
        k, v = self.rows(b)
        if k is not None:
            k, v = k[..., -self.window:, :], v[..., -self.window:, :]
            n = k.shape[2]
            if n < min(self.lengths()[b], self.window):  # a rotating cache could not go on
                raise ValueError(f"row {b} holds {n} entries, less than its window")
            c.state = (mx.contiguous(k), mx.contiguous(v), self.lengths()[b], 0, self.window, n)
        return c


def ragged_caches(target) -> list:
    """An empty batch cache per layer of `target`: windowed where its own cache rotates, a
    state per row where it is recurrent (GatedDeltaNet)."""
    def one(c):
        if isinstance(c, RotatingKVCache):
            return RaggedWindowCache(c.max_size)
        return RaggedStateCache() if isinstance(c, ArraysCache) else RaggedKVCache()
    return [one(c) for c in make_prompt_cache(target.model)]
