"""Target wrapper: one forward over W tokens returning logits and the tapped hidden states.

Taps are the *outputs* of target layers `lid` (HF `hidden_states[lid + 1]`), concatenated in
config order. They are installed around each call by swapping proxies into the model's layer
list and restoring it in `finally`, so the mlx-lm model object is never modified between
calls and no mlx-lm class is patched.
"""

from __future__ import annotations

from contextlib import contextmanager

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import make_prompt_cache

from ..errors import PairMismatchError


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


class Target:
    """An mlx-lm model seen as a DFlash target."""

    def __init__(self, model: nn.Module, tap_ids: list[int] | None = None):
        self.model = model
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

    def set_taps(self, tap_ids: list[int]):
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
        if not taps or not self.tap_ids:
            return self.model(ids, cache=cache), None
        store: list = [None] * len(self.tap_ids)
        with self._taps(store):
            logits = self.model(ids, cache=cache)
        return logits, mx.concatenate(store, axis=-1)

    # -- cache length bookkeeping (overridden for recurrent targets) --
    @staticmethod
    def cache_length(cache: list) -> int:
        return cache[0].offset

    def rewind_point(self, cache: list, length: int) -> int:
        """The longest length ≤ `length` that `truncate` restores exactly (KV caches: any)."""
        return length

    def checkpoint(self, cache: list) -> None:
        """Mark the current contents as a rewind point (a no-op for trimmable caches)."""

    def truncate(self, cache: list, length: int) -> None:
        """Drop every cached position at or after `length`."""
        for c in cache:
            extra = c.offset - length
            if extra > 0:
                c.trim(extra)
