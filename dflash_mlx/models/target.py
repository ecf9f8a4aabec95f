"""Target wrapper: one forward over W tokens returning logits and the tapped hidden states.

Taps are the *outputs* of target layers `lid` (HF `hidden_states[lid + 1]`), concatenated in
config order. They are installed around each call by swapping proxies into the model's layer
list and restoring it in `finally`, so the mlx-lm model object is never modified between
calls and no mlx-lm class is patched.

Speculation rolls the target cache back after every rejected draft, so a `Target` names the
cache types it can return to any earlier length exactly (`exact_caches`; subclasses add
theirs). A target with any other cache type runs plain AR only: pairing it with a draft
(`set_taps`) raises `SpeculationUnsupportedError`, and its caches rewind only to the start.
"""

from __future__ import annotations

from contextlib import contextmanager

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import KVCache, QuantizedKVCache, make_prompt_cache

from ..errors import DFlashError, PairMismatchError, SpeculationUnsupportedError


class RollbackError(DFlashError):
    """A target cache was asked to return to a length it cannot reproduce exactly."""


class _Tap:
    """Stands in for one layer during a call and keeps its output."""

    def __init__(self, layer, store: list, slots: list[int]):
        self._layer, self._store, self._slots = layer, store, slots

    def __call__(self, *args, **kwargs):
        out = self._layer(*args, **kwargs)
        for slot in self._slots:  # a layer may be tapped more than once
            self._store[slot] = out[0] if isinstance(out, tuple) else out
        return out

    def __getattr__(self, name):
        return getattr(self._layer, name)


def _find(obj, paths: list[str]):
    for path in paths:
        cur = obj
        for part in path.split("."):
            cur = getattr(cur, part, None) if cur is not None else None
        if cur is not None:
            return cur
    return None


def _text_args(model) -> dict:
    args = getattr(model, "args", None)
    out = dict(vars(args)) if args is not None else {}
    text = out.get("text_config")
    if isinstance(text, dict):
        out = {**out, **text}
    return out


class _CountedCache(list):
    """mlx-lm's per-layer caches plus the token count (some cache types keep no offset)."""

    length = 0


class Target:
    """An mlx-lm model seen as a DFlash target."""

    # trimming by offset leaves these exactly as a prefill of the kept tokens would (exact
    # types: a subclass may keep state `trim` does not know about)
    exact_caches: tuple[type, ...] = (KVCache, QuantizedKVCache)

    def __init__(self, model: nn.Module, tap_ids: list[int] | None = None):
        self.model = model
        self.cache_types = [type(c) for c in make_prompt_cache(model)]
        self.layers = _find(model, ["model.layers", "language_model.model.layers", "layers"])
        if self.layers is None:
            raise PairMismatchError(
                f"target {type(model).__module__}: no layer list at model.layers; "
                "only mlx-lm decoder models are supported"
            )
        self.embed_tokens = _find(
            model, ["model.embed_tokens", "language_model.model.embed_tokens", "embed_tokens"]
        )
        head = _find(model, ["lm_head", "language_model.lm_head"])
        self._head = head if head is not None else self.embed_tokens.as_linear
        self.head_module = head if head is not None else self.embed_tokens  # rows = vocabulary
        args = _text_args(model)
        self.hidden_size = args.get("hidden_size")
        self.vocab_size = args.get("vocab_size")
        self.context_length = args.get("max_position_embeddings")
        self.tap_ids: list[int] = []
        if tap_ids is not None:
            self.set_taps(tap_ids)

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    @property
    def unsupported(self) -> list[tuple[int, str]]:
        """(layer, cache type) of every layer whose cache this target cannot roll back."""
        return [(i, t.__name__) for i, t in enumerate(self.cache_types)
                if t not in self.exact_caches]

    def require_rollback(self) -> None:
        """Refuse speculation unless every layer's cache rolls back exactly."""
        bad = self.unsupported
        if bad:
            (i, name), more = bad[0], len(bad) - 1
            others = f" (and {more} more layer{'s' * (more > 1)})" if more else ""
            raise SpeculationUnsupportedError(
                f"target layer {i} uses a cache of type {name}{others}, which the engine "
                "cannot roll back after a rejected draft; run it without a draft (--no-draft)"
            )

    def set_taps(self, tap_ids: list[int]):
        """Tap these layers for a draft (pairing with a draft: speculation must be exact)."""
        self.require_rollback()
        bad = [i for i in tap_ids if not 0 <= i < self.num_layers]
        if bad:
            raise PairMismatchError(
                f"draft taps target layer(s) {bad}, but the target has {self.num_layers} "
                f"layers (0..{self.num_layers - 1})"
            )
        self.tap_ids = list(tap_ids)

    def embed(self, ids: mx.array) -> mx.array:
        return self.embed_tokens(ids)

    def lm_head(self, h: mx.array) -> mx.array:
        return self._head(h)

    def make_cache(self) -> list:
        if self.unsupported:
            return _CountedCache(make_prompt_cache(self.model))
        return make_prompt_cache(self.model)

    @contextmanager
    def _taps(self, store: list):
        saved = {i: self.layers[i] for i in self.tap_ids}
        try:
            for i, layer in saved.items():
                slots = [s for s, lid in enumerate(self.tap_ids) if lid == i]
                self.layers[i] = _Tap(layer, store, slots)
            yield
        finally:
            for i, layer in saved.items():
                self.layers[i] = layer

    def __call__(
        self, ids: mx.array, cache: list, taps: bool = True
    ) -> tuple[mx.array, mx.array | None]:
        """Logits (1, W, V) and taps (1, W, n_taps * hidden) for W tokens appended to `cache`."""
        if isinstance(cache, _CountedCache):
            cache.length += ids.shape[1]  # before the call: a cut-short call counts as dirty
        if not taps or not self.tap_ids:
            return self.model(ids, cache=cache), None
        store: list = [None] * len(self.tap_ids)
        with self._taps(store):
            logits = self.model(ids, cache=cache)
        return logits, mx.concatenate(store, axis=-1)

    # -- cache length bookkeeping (overridden for recurrent and sliding-window targets) --
    @staticmethod
    def cache_length(cache: list) -> int:
        if isinstance(cache, _CountedCache):
            return cache.length
        return cache[0].offset

    def rewind_point(self, cache: list, length: int) -> int:
        """The longest length ≤ `length` that `truncate` restores exactly (KV caches: any)."""
        if isinstance(cache, _CountedCache) and length < cache.length:
            return 0  # caches it cannot roll back only start over
        return length

    def checkpoint(self, cache: list) -> None:
        """Mark the current contents as a rewind point (a no-op for trimmable caches)."""

    def truncate(self, cache: list, length: int) -> None:
        """Drop every cached position at or after `length`."""
        if isinstance(cache, _CountedCache):
            if length >= cache.length:
                return
            if length:
                i, name = self.unsupported[0]
                raise RollbackError(
                    f"cannot rewind target layer {i} ({name}) to {length} tokens exactly; "
                    "start a new session"
                )
            cache[:] = make_prompt_cache(self.model)
            cache.length = 0
            return
        for c in cache:
            extra = c.offset - length
            if extra > 0:
                c.trim(extra)

    def refill(self, cache: list, layers: list, length: int, saved=None) -> None:
        """`cache` now holds `layers`, `length` tokens in all (a batch's row written back;
        `saved`: a checkpoint, for targets that keep them)."""
        cache[:] = layers
        if isinstance(cache, _CountedCache):
            cache.length = length
