"""A batch's pass without its padding's feed-forward work: rows of different widths, packed.

A batched verify pass is one (B, W) array: every sequence's rows, the narrower ones padded to
the widest. Attention needs that shape (each row its own cache), but the feed-forward blocks
and the output head treat every position alone, and on a CPU they are most of a pass's work.
While `packed(target, widths, W)` is open, each decoder layer's `mlp` and the head run on the
real rows only (one (1, R) array, R = sum of widths) and their outputs are spread back to the
(B, W) shape, every padding position holding a copy of its sequence's last real row: finite
values that no real row reads (padding comes after a sequence's real rows, and attention is
causal). A round of one sequence at width 5 beside plain rows then costs about what its real
rows cost, which is what lets the width controller choose widths per sequence.

The modules are swapped in for the call and restored in `finally`, as the taps are; no mlx-lm
class is patched. A model whose layers have no `mlp` runs padded (exact, only not cheaper).
"""

from __future__ import annotations

from contextlib import contextmanager

import mlx.core as mx


class _Rows:
    """Where the real rows of a (B, W) batch lie in its flattened positions, and back."""

    def __init__(self, widths: list[int], width: int):
        self.shape = (len(widths), width)
        take, spread, start = [], [], 0
        for b, w in enumerate(widths):
            take += [b * width + i for i in range(w)]
            spread += [start + min(i, w - 1) for i in range(width)]
            start += w
        self.take, self.spread = mx.array(take), mx.array(spread)

    def run(self, f, x: mx.array) -> mx.array:
        if tuple(x.shape[:2]) != self.shape:  # not this pass's activations
            return f(x)
        rest = x.shape[2:]
        y = f(x.reshape(-1, *rest)[self.take][None])[0]
        return y[self.spread].reshape(*self.shape, *y.shape[1:])


class _Packed:
    """Stands in for a module whose positions are independent; calls it on real rows only."""

    def __init__(self, module, rows: _Rows, head_only: bool = False):
        self._module, self._rows, self._head_only = module, rows, head_only

    def __call__(self, x, *args, **kwargs):
        if self._head_only:  # a tied embedding's lookup: nothing to save
            return self._module(x, *args, **kwargs)
        return self._rows.run(lambda v: self._module(v, *args, **kwargs), x)

    def as_linear(self, x):  # a tied head: the embedding read as the output projection
        return self._rows.run(self._module.as_linear, x)

    def __getattr__(self, name):
        return getattr(self._module, name)


def _slots(target) -> list[tuple[object, str]]:
    """(parent, key) of every module a packed target pass swaps: the layers' `mlp`s, the head."""
    out = _mlps(target.layers)
    head = target.head_module
    for parent in (target.model, getattr(target.model, "language_model", None),
                   getattr(target.model, "model", None),
                   getattr(getattr(target.model, "language_model", None), "model", None)):
        for key in ("lm_head", "embed_tokens"):
            if parent is not None and parent.get(key) is head:
                out.append((parent, key))
    return out


def _mlps(layers) -> list[tuple[object, str]]:
    return [(layer, "mlp") for layer in layers if "mlp" in layer]


@contextmanager
def _swapped(slots: list[tuple[object, str]], widths: list[int], width: int):
    if all(w == width for w in widths):  # nothing padded: nothing to skip
        yield
        return
    rows = _Rows(widths, width)
    saved = [(parent, key, parent[key]) for parent, key in slots]
    try:
        for parent, key, module in saved:  # item assignment: nn.Module is a dict
            parent[key] = _Packed(module, rows, head_only=key == "embed_tokens")
        yield
    finally:
        for parent, key, module in reversed(saved):
            parent[key] = module


def packed(target, widths: list[int], width: int):
    """Run `target`'s feed-forward blocks and head on the real rows of the next (B, `width`)
    pass, sequence b's first `widths[b]` positions."""
    return _swapped(_slots(target), widths, width)


def packed_layers(layers, widths: list[int], width: int):
    """The same for a draft's layers (their `mlp`s): its block's rows of a sequence that
    drafts nothing this round are not needed at all (the context it absorbs goes through
    the attention's keys and values, not these)."""
    return _swapped(_mlps(layers), widths, width)
