"""Sliding-window targets (mlx-lm `RotatingKVCache`: Gemma 2/3, gpt-oss, Mistral-style
windows): exact rollback.

`RotatingKVCache.trim` only moves `offset` and `_idx`. Before the window fills nothing was
ever dropped and that is exact; once it has wrapped, the rows of rejected tokens stay in the
buffer, and the next multi-token update (which reorders the buffer from `_idx`) or the next
rotation serves them as context.

So before every call this target records each rotating layer's `state` (keys, values, offset,
keep, max_size, _idx). The record holds references, not copies: a multi-token update builds
new arrays, and a one-token update writes into a new buffer while the record holds the old
one. The buffers are bounded by the window (at most max_size + W − 1 rows), whatever the
context length. Rolling back to `n` tokens inside that call restores the record and re-appends
the first `n − base` rows the call wrote, through the cache's own `update_and_fetch`: the
cache ends exactly as a call over only those tokens would have left it. Plain KV layers trim.
Rewinding further back (multi-turn reuse) reaches any length while no window has wrapped, a
checkpoint taken after each prefill, or the empty cache: `rewind_point` says which.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import RotatingKVCache, make_prompt_cache

from .target import RollbackError, Target

Record = list[tuple[int, tuple]]  # (layer, RotatingKVCache.state) per rotating layer


def _alias(state: tuple) -> tuple:
    """The same state in new array objects: a later in-place write to the cache's buffer
    then leaves these untouched (MLX copies instead of donating a buffer still referenced)."""
    keys, values, *rest = state
    return (None if keys is None else keys[...], None if values is None else values[...], *rest)


class WindowCache(list):
    """mlx-lm's per-layer cache list, plus the length and the last call's record."""

    def __init__(self, caches):
        super().__init__(caches)
        self.length = 0
        self.base = 0  # length before the last call
        self.width = 0  # tokens of the last call
        self.record: Record | None = None  # rotating states before the last call
        self.complete = False  # the last call returned
        self.saved: tuple[int, Record] | None = None  # checkpoint: (length, states)


class WindowTarget(Target):
    """A `Target` whose sliding-window (rotating) KV caches roll back exactly."""

    exact_caches = Target.exact_caches + (RotatingKVCache,)

    def __init__(self, model: nn.Module, tap_ids: list[int] | None = None):
        super().__init__(model, tap_ids)
        self.window_layers = [i for i, t in enumerate(self.cache_types) if t is RotatingKVCache]

    def make_cache(self) -> WindowCache:
        return WindowCache(make_prompt_cache(self.model))

    def _record(self, cache: WindowCache) -> Record:
        return [(i, _alias(cache[i].state)) for i in self.window_layers]

    def __call__(self, ids: mx.array, cache: list, taps: bool = True):
        if not isinstance(cache, WindowCache):
            # a batch's rows roll back by moving their ends (`speculate/batch_window.py`);
            # its window rows drop what no query reads again before the pass builds masks
            if all(hasattr(c, "set_lengths") for c in cache):
                for c in cache:
                    getattr(c, "prepare", lambda n: None)(ids.shape[1])
                return super().__call__(ids, cache, taps)
            raise RollbackError("a sliding-window target needs its own cache: use make_cache()")
        cache.record, cache.complete = self._record(cache), False
        cache.base, cache.width = cache.length, ids.shape[1]
        cache.length += ids.shape[1]  # before the call: a cut-short call is undone to `base`
        out = super().__call__(ids, cache, taps)
        cache.complete = True
        return out

    def refill(self, cache: WindowCache, layers: list, length: int, saved=None) -> None:
        """`cache` now holds `layers`, `length` tokens in all (a batch's row written back);
        `saved`: a checkpoint (length, window states) to rewind to later."""
        cache[:] = layers
        cache.length = cache.base = length
        cache.record, cache.complete, cache.saved = None, False, saved

    def rows_checkpoint(self, caches: list, b: int) -> Record:
        """Row b's window layers now, as `checkpoint` keeps them (copies of its last window
        entries, made now: a view would keep the whole batch's buffer alive)."""
        record = [(i, caches[i].export(b).state) for i in self.window_layers]
        mx.eval([a for _, state in record for a in state[:2] if a is not None])
        return record

    # -- lengths, rollback, rewinds --
    @staticmethod
    def cache_length(cache: WindowCache) -> int:
        return cache.length

    def checkpoint(self, cache: WindowCache) -> None:
        """Remember the rotating states here so a later rewind can come back."""
        cache.saved = (cache.length, self._record(cache))

    def _in_last_call(self, cache: WindowCache, length: int) -> bool:
        return (cache.record is not None and cache.base <= length
                and (cache.complete or length == cache.base))

    def _unwrapped(self, cache: WindowCache) -> bool:
        # no row was ever dropped from a window that never filled: trimming it is exact
        return all(cache[i].offset < cache[i].max_size for i in self.window_layers)

    def rewind_point(self, cache: WindowCache, length: int) -> int:
        """The longest length ≤ `length` that `truncate` can restore exactly."""
        if length >= cache.length or self._in_last_call(cache, length):
            return length
        if self._unwrapped(cache):
            return length
        if cache.saved is not None and cache.saved[0] <= length:
            return cache.saved[0]
        return 0

    def truncate(self, cache: WindowCache, length: int) -> None:
        """Drop every position ≥ `length`: rotating layers are restored, KV layers trimmed."""
        if length >= cache.length:
            return
        if self.rewind_point(cache, length) != length:
            raise RollbackError(
                f"cannot rewind a sliding-window target from {cache.length} to {length} tokens "
                "exactly; re-prefill from a checkpoint (see WindowTarget.rewind_point)"
            )
        window = set(self.window_layers)
        if self._in_last_call(cache, length):
            kept = length - cache.base
            for i, state in cache.record:
                _undo(cache[i], state, kept, cache.width)
        elif self._unwrapped(cache):
            window = set()  # trimmed with the KV layers below
        elif length == 0:
            for i in window:
                c = cache[i]
                c.state = (None, None, 0, c.keep, c.max_size, 0)
        else:
            for i, state in cache.saved[1]:
                cache[i].state = _alias(state)  # the checkpoint stays reusable
        for i, c in enumerate(cache):
            if i not in window and c.offset > length:
                c.trim(c.offset - length)
        cache.length = length
        cache.record = None
        if cache.saved is not None and cache.saved[0] > length:
            cache.saved = None


def _undo(c: RotatingKVCache, before: tuple, kept: int, width: int) -> None:
    """Leave `c` as the first `kept` of the last call's `width` tokens would have."""
    rows = None
    if kept:
        keys, values, offset, *_, idx = c.state
        if offset != before[2] + width:
            raise RollbackError(f"a sliding-window layer holds {offset} tokens, not "
                                f"{before[2]} + {width}")
        # both update paths leave the call's rows just before `_idx`, in order
        start = idx - width
        rows = keys[..., start : start + kept, :], values[..., start : start + kept, :]
    c.state = before
    if rows is not None:
        c.update_and_fetch(*rows)
