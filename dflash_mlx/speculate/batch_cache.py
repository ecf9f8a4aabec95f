"""Caches of a batch of sequences whose lengths differ and move by different amounts each round.

mlx-lm's `BatchKVCache` keeps its rows left-padded with a per-row `offset` (each row's RoPE
position) but one write index for all rows, so every row grows by the same amount. A batched
verify pass accepts a different number of tokens per sequence: with one write index the rejected
rows would stay behind as holes. Here each row also has its own end: left padding as in
`BatchKVCache` (a row starts at `left[b]`), ragged ends (it stops at `end[b]`). A pass of W
tokens writes row b's keys at `end[b] .. end[b] + W` (a scatter, not a copy of the history) and
rolling a row back is only moving its end: whatever lies past it is masked out and overwritten
by the next pass. So after every round each row holds exactly its sequence's tokens, at the
positions a fresh prefill would give them.

`RaggedKVCache` serves one layer of a standard-attention target (mlx-lm models call
`update_and_fetch`, `make_mask` and read `offset`); `RaggedContextCache` holds one draft layer's
context rows, at absolute positions, as the draft's single-sequence `ContextCache` does.
Sequences join with `add` (their own prefill, then a copy) or `extend` (rows prefilled together)
and leave with `filter`. Every copy of a buffer is made one layer at a time, so the batch
holds its K/V about once, not twice, while rows join, leave or grow.
"""

from __future__ import annotations

import mlx.core as mx
from mlx_lm.models.cache import KVCache

from ..models.cache import ContextCache


class _Rows:
    """A (B, H, capacity, D) key/value buffer pair with per-row `left` and `end` indices."""

    # growth: what the rows need plus an eighth (at least `step`), in multiples of `step`: a
    # copy every few dozen rounds, and little reserved that no row uses (a batch holds many
    # rows; mlx-lm's 256 positions ahead per row would be most of a short chat's KV)
    step = 32
    cut_on_growth = True  # growing drops the columns before every row (indices move)

    def __init__(self):
        self.keys = self.values = None
        self.left: list[int] = []  # buffer index of each row's first valid entry
        self.end: list[int] = []  # buffer index after each row's last valid entry

    @property
    def batch_size(self) -> int:
        return len(self.end)

    @property
    def state(self):
        return () if self.keys is None else (self.keys, self.values)

    def _reserve(self, n: int, like_k: mx.array, like_v: mx.array, cut: bool | None = None):
        """Room for `n` entries after every row's end; rows before the common left edge go
        (when `cut`, by default `cut_on_growth`)."""
        need = max(self.end) + n
        if self.keys is not None and need <= self.keys.shape[2]:
            return
        cut = min(self.left) if (self.cut_on_growth if cut is None else cut) else 0
        want = need - cut + max(self.step, (need - cut) // 8)
        cap = (want + self.step - 1) // self.step * self.step
        B, H, _, dk = like_k.shape
        k = mx.zeros((B, H, cap, dk), like_k.dtype)
        v = mx.zeros((B, H, cap, like_v.shape[3]), like_v.dtype)
        if self.keys is not None:
            used = max(self.end) - cut
            k[..., :used, :] = self.keys[..., cut: cut + used, :]
            v[..., :used, :] = self.values[..., cut: cut + used, :]
            # copied now, so the old buffer goes before the next layer grows: a growth holds
            # one layer twice, not the whole batch's K/V
            mx.eval(k, v)
        self.keys, self.values = k, v
        self.left = [x - cut for x in self.left]
        self.end = [x - cut for x in self.end]

    def expect(self, valid: list[int] | None):
        """Rows' real tokens in the next pass: K/V rows need not know (what a row writes past
        its end is masked, then overwritten)."""

    def _scatter(self, k: mx.array, v: mx.array):
        """Write (B, H, n, D) at each row's end (the ends do not move)."""
        self._reserve(k.shape[2], k, v)
        B, H, n, _ = k.shape
        if len(set(self.end)) == 1:  # rows end together (one sequence): a slice, no scatter
            e = self.end[0]
            self.keys[..., e: e + n, :] = k
            self.values[..., e: e + n, :] = v
            return
        cols = (mx.array(self.end)[:, None] + mx.arange(n)[None])[:, None, :]
        rows, heads = mx.arange(B)[:, None, None], mx.arange(H)[None, :, None]
        self.keys[rows, heads, cols] = k
        self.values[rows, heads, cols] = v

    def filter(self, keep: list[int]):
        """Keep only these rows (in this order)."""
        if not keep:
            self.keys = self.values = None
            self.left, self.end = [], []
            return
        if self.keys is not None:
            idx = mx.array(keep)
            self.keys, self.values = self.keys[idx], self.values[idx]
        self.left = [self.left[i] for i in keep]
        self.end = [self.end[i] for i in keep]

    def _add(self, rows: list[tuple[mx.array | None, mx.array | None, int]]):
        """New rows, each holding its `n` entries `k`/`v` (1, H, n, D) from column 0, built in
        one buffer and appended with one copy of the rest."""
        width = max((n for _, _, n in rows), default=0)
        like = next(((k, v) for k, v, n in rows if n), None)
        keys = values = None
        if like is not None:
            (_, H, _, dk), dv = like[0].shape, like[1].shape[3]
            keys = mx.zeros((len(rows), H, width, dk), like[0].dtype)
            values = mx.zeros((len(rows), H, width, dv), like[1].dtype)
            for i, (k, v, n) in enumerate(rows):
                if n:
                    keys[i: i + 1, :, :n] = k
                    values[i: i + 1, :, :n] = v
        self._append(len(rows), keys, values, [0] * len(rows), [n for _, _, n in rows])

    def extend(self, other: "_Rows"):
        """Append `other`'s rows where they lie in its buffer (rows need not end together)."""
        self._append(other.batch_size, other.keys, other.values, other.left, other.end)

    def _append(self, n: int, keys, values, left: list[int], end: list[int]):
        """Rows `keys`/`values` (n, H, <= capacity, D) or None (all empty) after these: one
        copy of both, or none when this holds no row."""
        if self.batch_size == 0:
            self.keys, self.values = keys, values
        elif self.keys is not None or keys is not None:
            self.keys = _stack(self.batch_size, self.keys, n, keys)
            self.values = _stack(self.batch_size, self.values, n, values)
        self.left, self.end = self.left + left, self.end + end

    def rows(self, b: int) -> tuple[mx.array, mx.array] | tuple[None, None]:
        """Row b's valid entries (1, H, n, D), oldest first."""
        if self.keys is None or self.end[b] == self.left[b]:
            return None, None
        lo, hi = self.left[b], self.end[b]
        return self.keys[b: b + 1, :, lo:hi], self.values[b: b + 1, :, lo:hi]


def _stack(n1: int, a: mx.array | None, n2: int, b: mx.array | None) -> mx.array:
    """Rows of `a` then of `b` (either may be None: zeros), in one buffer as wide as the
    wider, written in place into it."""
    like = a if a is not None else b
    cap = max(x.shape[2] for x in (a, b) if x is not None)
    H, d = like.shape[1], like.shape[3]
    out = mx.zeros((n1 + n2, H, cap, d), like.dtype)
    if a is not None:
        out[:n1, :, : a.shape[2]] = a
    if b is not None:
        out[n1:, :, : b.shape[2]] = b
    return out


class RaggedKVCache(_Rows):
    """One target layer's K/V for a batch: left-padded rows with per-row ends.

    Between calls each row holds exactly its sequence's tokens; `offset` is each row's length
    (its next RoPE position), an array as in `BatchKVCache`.
    """

    @property
    def offset(self) -> mx.array:
        return mx.array([e - l for l, e in zip(self.left, self.end)])

    # The model builds its mask from `end` before a layer writes: indices must not move
    # inside a pass, so the columns no row uses any more go when rows leave (`filter`).
    cut_on_growth = False

    def lengths(self) -> list[int]:
        return [e - l for l, e in zip(self.left, self.end)]

    def filter(self, keep: list[int]):
        super().filter(keep)
        cut = min(self.left, default=0)
        if cut and self.keys is not None:
            self.keys, self.values = self.keys[..., cut:, :], self.values[..., cut:, :]
            self.left = [x - cut for x in self.left]
            self.end = [x - cut for x in self.end]

    def update_and_fetch(self, keys: mx.array, values: mx.array):
        self._scatter(keys, values)
        n = keys.shape[2]
        self.end = [e + n for e in self.end]
        top = max(self.end)
        return self.keys[..., :top, :], self.values[..., :top, :]

    def aligned(self) -> bool:
        """Every row starts at column 0 and ends at the same column (one sequence, or rows of
        one length): the mask is a single sequence's."""
        return not any(self.left) and len(set(self.end)) == 1

    def make_mask(self, N: int, return_array: bool = False, window_size=None, **kwargs):
        """(B, 1, N, S): query t of row b sees its own entries up to itself."""
        if window_size is not None:
            raise ValueError("RaggedKVCache has no sliding window")
        if self.aligned() and not return_array:  # as mlx-lm's KVCache: one token sees every
            return None if N == 1 else "causal"  # entry, several the causal fast path
        return self._rows_mask(N)

    def _rows_mask(self, N: int, window: int | None = None) -> mx.array:
        """Query t of row b sees its row's entries up to itself (fewer than `window` back)."""
        S = max(self.end) + N
        j = mx.arange(S)[None, None, None, :]
        left = mx.array(self.left)[:, None, None, None]
        upto = (mx.array(self.end)[:, None] + mx.arange(N)[None])[:, None, :, None]
        mask = (j >= left) & (j <= upto)
        return mask if window is None else mask & (upto - j < window)

    def set_lengths(self, lengths: list[int]):
        """Row b keeps its first `lengths[b]` tokens (rollback: the rest is masked, then
        overwritten)."""
        for b, n in enumerate(lengths):
            if n > self.end[b] - self.left[b]:
                raise ValueError(f"row {b} holds {self.end[b] - self.left[b]} tokens, not {n}")
        self.end = [l + n for l, n in zip(self.left, lengths)]

    def add(self, *caches) -> None:
        """Append sequences from their own (prefilled) mlx-lm `KVCache`s."""
        self._add([(None, None, 0) if c.keys is None else
                   (c.keys[..., : c.offset, :], c.values[..., : c.offset, :], c.offset)
                   for c in caches])

    def export(self, b: int) -> KVCache:
        """Row b as a single-sequence mlx-lm `KVCache` of its own (a copy: the batch's buffer
        is not kept alive by it)."""
        c = KVCache()
        k, v = self.rows(b)
        if k is not None:
            c.keys, c.values, c.offset = mx.contiguous(k), mx.contiguous(v), k.shape[2]
        return c

    def is_trimmable(self) -> bool:
        return False  # rows roll back one by one: `set_lengths`

    def empty(self) -> bool:
        return self.keys is None

    @property
    def nbytes(self) -> int:
        return 0 if self.keys is None else self.keys.nbytes + self.values.nbytes


class RaggedContextCache(_Rows):
    """One draft layer's context K/V for a batch (the batched `models.cache.ContextCache`).

    Row b's entry at buffer index `end[b] - 1` is absolute position `pos[b] - 1`: positions stay
    absolute for RoPE and the masks, whatever the padding. `max_rows` bounds what the draft
    reads (a sliding-window layer, `--draft-window`) through the mask; the entries before it are
    dropped when the buffer grows.
    """

    def __init__(self, max_rows: int | None = None):
        super().__init__()
        self.max_rows = max_rows
        self.pos: list[int] = []  # absolute position after each row's last entry
        self.incoming: list[int] = []  # per row: context rows the next `append` brings

    @property
    def offset(self) -> mx.array:
        """Each row's absolute position of its next entry (block slot 0)."""
        return mx.array(self.pos)

    def visible_from(self) -> list[int]:
        """Per row, the buffer index of the first entry the draft reads."""
        if self.max_rows is None:
            return list(self.left)
        return [max(l, e - self.max_rows) for l, e in zip(self.left, self.end)]

    def _reserve(self, n, like_k, like_v):
        # entries a window can never read again go with the next growth
        self.left = self.visible_from()
        super()._reserve(n, like_k, like_v)

    def append(self, k: mx.array, v: mx.array):
        """Context K/V (B, H, P, D) padded to the longest; row b keeps `incoming[b]` of them."""
        self._scatter(k, v)
        self.end = [e + n for e, n in zip(self.end, self.incoming)]
        self.pos = [p + n for p, n in zip(self.pos, self.incoming)]
        self.incoming = [0] * self.batch_size

    def with_block(self, k: mx.array, v: mx.array) -> tuple[mx.array, mx.array]:
        """The stored context followed, per row, by its block (B, H, L, D); ends do not move."""
        self._scatter(k, v)
        top = max(self.end) + k.shape[2]
        return self.keys[..., :top, :], self.values[..., :top, :]

    def block_mask(self, L: int, window: int | None, causal: bool) -> mx.array:
        """(B, 1, L, S) for block queries: the row's visible context, then its own block, with
        the draft layer's own window and causality (as `Attention._mask`, per row)."""
        S = max(self.end) + L
        j = mx.arange(S)[None, None, None, :]
        end = mx.array(self.end)[:, None, None, None]
        lo = mx.array(self.visible_from())[:, None, None, None]
        t = mx.arange(L)[None, None, :, None]
        context = (j >= lo) & (j < end)
        block = (j >= end) & (j < end + L)
        if window is not None:  # distance from query t (at end + t) to a context entry
            context = context & ((end + t - j) < window)
        if causal:
            block = block & (j - end <= t)
        # full size: the CPU's grouped attention tiles it per query head
        return mx.broadcast_to(context | block, (self.batch_size, 1, L, S))

    def snapshot(self) -> tuple:
        return list(self.end), list(self.pos)

    def restore(self, snap: tuple):
        self.end, self.pos = list(snap[0]), list(snap[1])
        self.incoming = [0] * self.batch_size

    def filter(self, keep: list[int]):
        super().filter(keep)
        self.pos = [self.pos[i] for i in keep]
        self.incoming = [0] * len(keep)

    def add(self, *caches) -> None:
        """Append sequences from their own `ContextCache`s (their pending taps absorbed)."""
        self._add([(c.keys, c.values, c.size()) for c in caches])
        self.pos += [c.offset for c in caches]
        self.incoming += [0] * len(caches)

    def rows(self, b: int):
        lo, hi = self.visible_from()[b], self.end[b]
        if self.keys is None or hi == lo:
            return None, None
        return self.keys[b: b + 1, :, lo:hi], self.values[b: b + 1, :, lo:hi]


    def export(self, b: int) -> ContextCache:
        """Row b as a single-sequence draft `ContextCache` of its own."""
        k, v = self.rows(b)
        if k is not None:
            k, v = mx.contiguous(k), mx.contiguous(v)
        return ContextCache.holding(k, v, self.pos[b], self.max_rows)


def row_lengths(caches: list) -> list[int]:
    """Each row's token count, as the batch's K/V layers hold it."""
    return next(c for c in caches if isinstance(c, RaggedKVCache)).lengths()


def set_lengths(caches: list[RaggedKVCache], lengths: list[int]):
    for c in caches:
        c.set_lengths(lengths)


def filter_rows(caches: list | None, keep: list[int]):
    """Keep these rows of every layer, one layer copied at a time (each layer's old buffer
    goes before the next is copied)."""
    for c in caches or ():
        c.filter(keep)
        mx.eval(c.state)
