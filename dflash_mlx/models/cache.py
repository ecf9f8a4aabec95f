"""The draft's context cache: K/V of the target's context only, at absolute positions."""

from __future__ import annotations

import mlx.core as mx


class ContextCache:
    """Context-only K/V of one draft layer, kept in temporal order at absolute positions.

    Block K/V are never stored, so a rejected block leaves nothing to crop. `max_rows`
    bounds memory for sliding-window layers; `offset` stays absolute for RoPE and masks.

    The rows live in buffers allocated `step` rows at a time and written in place, so a
    round costs what its new rows cost, not what the context costs. Buffer row 0 holds
    absolute position `_base`; rows `[start, offset)` are the ones the draft reads. With
    `max_rows` the rows before `start` are left in place and dropped only when the buffer is
    full (one copy of at most `max_rows` rows every `step` appended rows).
    """

    step = 256

    def __init__(self, max_rows: int | None = None):
        self.max_rows = max_rows
        self.offset = 0  # absolute position after the last stored row
        self.start = 0  # absolute position of the first row the draft reads
        self._base = 0  # absolute position of buffer row 0
        self._k = self._v = None

    def _reserve(self, n: int, like_k: mx.array, like_v: mx.array):
        """Make room for `n` rows after `offset`, compacting away rows before `start`."""
        used = self.offset - self._base
        if self._k is not None and used + n <= self._k.shape[2]:
            return
        keep = self.offset - self.start
        rows = ((keep + n + self.step - 1) // self.step + 1) * self.step
        B, H, _, Dk = like_k.shape
        k = mx.zeros((B, H, rows, Dk), like_k.dtype)
        v = mx.zeros((B, H, rows, like_v.shape[3]), like_v.dtype)
        if self._k is not None and keep > 0:
            lo = self.start - self._base
            k[:, :, :keep] = self._k[:, :, lo:lo + keep]
            v[:, :, :keep] = self._v[:, :, lo:lo + keep]
        self._k, self._v, self._base = k, v, self.start

    def _write(self, k: mx.array, v: mx.array) -> int:
        self._reserve(k.shape[2], k, v)
        at = self.offset - self._base
        self._k[:, :, at:at + k.shape[2]] = k
        self._v[:, :, at:at + k.shape[2]] = v
        return at

    @classmethod
    def holding(cls, keys: mx.array | None, values: mx.array | None, offset: int,
                max_rows: int | None = None) -> "ContextCache":
        """A cache whose readable rows are `keys`/`values` (1, H, n, D), the last at absolute
        position `offset - 1` (a sequence leaving a batch takes its rows with it)."""
        c = cls(max_rows)
        c.offset = offset
        c.start = c._base = offset - (0 if keys is None else keys.shape[2])
        if keys is not None and keys.shape[2]:
            c._k, c._v = keys, values
        return c

    def append(self, k: mx.array, v: mx.array):
        self._write(k, v)
        self.offset += k.shape[2]
        if self.max_rows is not None:
            self.start = max(self.start, self.offset - self.max_rows)

    def with_block(self, k: mx.array, v: mx.array) -> tuple[mx.array, mx.array]:
        """Keys and values of the stored context followed by `k`/`v` (a block), without
        copying the context: the block is written into the free rows after `offset`, which
        the next append overwrites. `offset` does not move."""
        at = self._write(k, v)
        lo = self.start - self._base
        return self._k[:, :, lo:at + k.shape[2]], self._v[:, :, lo:at + k.shape[2]]

    def skip(self, n: int):
        """Advance the absolute position without storing rows (window-limited prefill)."""
        assert self.size() == 0, "skip() only on an empty cache"
        self.offset += n
        self.start = self._base = self.offset
        self._k = self._v = None

    def trim(self, n: int) -> int:
        """Drop the last `n` positions. Going back past `start` (rows a window already
        dropped) empties the cache at the new, still absolute, position: the draft then sees
        less context for a while, which costs acceptance, never exactness."""
        n = min(n, self.offset)
        if n > 0:
            self.offset -= n
            self.start = min(self.start, self.offset)
            if self.offset <= self._base:  # nothing valid left in the buffer
                self._base = self.offset
        return n

    def size(self) -> int:
        return self.offset - self.start

    def _view(self, buf: mx.array | None) -> mx.array | None:
        if buf is None or self.size() == 0:
            return None
        lo = self.start - self._base
        return buf[:, :, lo:lo + self.size()]

    @property
    def keys(self) -> mx.array | None:
        """The rows the draft reads, `[start, offset)`, oldest first (None when empty)."""
        return self._view(self._k)

    @property
    def values(self) -> mx.array | None:
        return self._view(self._v)

    @property
    def state(self):
        """The buffers (for `mx.eval`), or () when nothing was ever stored."""
        return (self._k, self._v) if self._k is not None else ()
