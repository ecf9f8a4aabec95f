"""The draft's context cache: K/V of the target's context only, at absolute positions."""

from __future__ import annotations

import mlx.core as mx


class ContextCache:
    """Context-only K/V of one draft layer, kept in temporal order at absolute positions.

    Block K/V are never stored, so a rejected block leaves nothing to crop. `max_rows`
    bounds memory for sliding-window layers; `offset` stays absolute for RoPE and masks.
    """

    def __init__(self, max_rows: int | None = None):
        self.max_rows = max_rows
        self.offset = 0  # absolute position after the last stored row
        self.start = 0  # absolute position of the first stored row
        self.keys = self.values = None

    def append(self, k: mx.array, v: mx.array):
        if self.keys is None:
            self.keys, self.values = k, v
        else:
            self.keys = mx.concatenate([self.keys, k], axis=2)
            self.values = mx.concatenate([self.values, v], axis=2)
        self.offset += k.shape[2]
        if self.max_rows is not None and self.keys.shape[2] > self.max_rows:
            drop = self.keys.shape[2] - self.max_rows
            self.keys, self.values = self.keys[:, :, drop:], self.values[:, :, drop:]
            self.start += drop

    def skip(self, n: int):
        """Advance the absolute position without storing rows (window-limited prefill)."""
        assert self.keys is None, "skip() only before the first append"
        self.offset += n
        self.start += n

    def trim(self, n: int) -> int:
        """Drop the last `n` positions. Going back past `start` (rows a window already
        dropped) empties the cache at the new, still absolute, position: the draft then sees
        less context for a while, which costs acceptance, never exactness."""
        n = min(n, self.offset)
        if n > 0:
            self.offset -= n
            keep = max(self.offset - self.start, 0)
            self.start = min(self.start, self.offset)
            if keep == 0:
                self.keys = self.values = None
            else:
                self.keys, self.values = self.keys[:, :, :keep], self.values[:, :, :keep]
        return n

    def size(self) -> int:
        return self.offset - self.start

    @property
    def state(self):
        return (self.keys, self.values) if self.keys is not None else ()
