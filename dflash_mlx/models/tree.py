"""One target pass over a draft tree.

Row i of the pass holds one tree node: it sits at position `cache length + depth` and attends
to the whole cached context plus its own ancestors (and itself), so its logits and K/V are
those a plain forward over its path would give. For the duration of the call each attention
module is wrapped per instance (restored in `finally`; no mlx-lm class is touched):

- its `rope` child by a stand-in that rotates every row at its own position (the rows become
  the batch axis, so one `mx.fast.rope` call takes a vector of offsets);
- the module itself, in its decoder layer, by a stand-in that replaces the causal mask with the
  tree's boolean mask.

Only architectures whose attention applies `self.rope(x, offset=cache.offset)` to queries and
keys and passes the mask through unchanged qualify (`ARCHITECTURES`), with plain or quantized
KV caches (rows can be moved and trimmed exactly). Hybrid and sliding-window targets are
refused: their caches hold no per-row state that could be compacted to one path.
"""

from __future__ import annotations

from contextlib import contextmanager

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import KVCache, QuantizedKVCache
from mlx_lm.models.rope_utils import Llama3RoPE, SuScaledRoPE, YarnRoPE

from ..errors import SpeculationUnsupportedError

# mlx-lm modules read and checked: queries and keys go through `self.rope(x, offset=...)`, the
# mask reaches scaled_dot_product_attention as given
ARCHITECTURES = ("llama", "qwen2", "qwen3")
# rope modules that hand `offset` to mx.fast.rope as is (so a vector of offsets works) and do
# not depend on the sequence length
ROPES = (nn.RoPE, Llama3RoPE, SuScaledRoPE, YarnRoPE)


def unsupported(target) -> str | None:
    """Why a tree cannot be verified on `target` (None: it can)."""
    model = target.model
    arch = type(model).__module__.rsplit(".", 1)[-1]
    if arch not in ARCHITECTURES:
        return f"a {arch} target (trees cover {', '.join(ARCHITECTURES)})"
    bad = {t.__name__ for t in target.cache_types} - {"KVCache", "QuantizedKVCache"}
    if bad:
        return f"a target with {', '.join(sorted(bad))} layers"
    for layer in target.layers:
        rope = getattr(getattr(layer, "self_attn", None), "rope", None)
        if not isinstance(rope, ROPES):
            return f"a target whose attention uses {type(rope).__name__} positions"
    return None


def require_tree(target) -> None:
    reason = unsupported(target)
    if reason is not None:
        raise SpeculationUnsupportedError(f"tree speculation does not support {reason}")


class _TreeRope:
    """Stands in for one attention's rope: row i at position offset + depths[i]."""

    def __init__(self, rope, depths: mx.array):
        self._rope, self._depths = rope, depths

    def __call__(self, x: mx.array, offset=0) -> mx.array:
        # (1, heads, rows, dim) -> (rows, heads, 1, dim): one offset per batch element
        y = self._rope(x.transpose(2, 1, 0, 3), offset=offset + self._depths)
        return y.transpose(2, 1, 0, 3)

    def __getattr__(self, name):
        return getattr(self._rope, name)


class _TreeAttention:
    """Stands in for one attention module: the tree's mask instead of the causal one."""

    def __init__(self, attn, mask: mx.array):
        self._attn, self._mask = attn, mask

    def __call__(self, x: mx.array, mask=None, cache=None) -> mx.array:
        return self._attn(x, self._mask, cache)

    def __getattr__(self, name):
        return getattr(self._attn, name)


@contextmanager
def _tree_attention(layers, depths: mx.array, mask: mx.array):
    saved = []
    try:
        for layer in layers:
            attn = layer["self_attn"]
            saved.append((layer, attn, attn["rope"]))
            # item assignment keeps the modules' key order and bypasses nn.Module.__setattr__
            attn["rope"] = _TreeRope(attn["rope"], depths)
            layer["self_attn"] = _TreeAttention(attn, mask)
        yield
    finally:
        for layer, attn, rope in reversed(saved):
            layer["self_attn"] = attn
            attn["rope"] = rope


def tree_forward(target, tokens: list[int], depths: list[int], visible, cache: list,
                 taps: bool = True) -> tuple[mx.array, mx.array | None]:
    """Logits (1, rows, V) and taps for a tree's rows appended to `cache`.

    Args:
        tokens, depths: per row (row 0: the root, depth 0).
        visible: (rows, rows) bool, row i sees row j iff j is i or an ancestor of i.
    """
    require_tree(target)
    if len(tokens) == 1:  # a bare root is a plain one-token step
        return target(mx.array([tokens]), cache, taps=taps)
    base = target.cache_length(cache)
    rows = len(tokens)
    mask = mx.concatenate([mx.ones((rows, base), dtype=mx.bool_), mx.array(visible)], axis=1)
    with _tree_attention(target.layers, mx.array(depths, dtype=mx.int32), mask):
        return target(mx.array([tokens]), cache, taps=taps)


def _parts(c) -> list[mx.array]:
    if not isinstance(c, (KVCache, QuantizedKVCache)):
        raise SpeculationUnsupportedError(f"cannot compact a {type(c).__name__}")
    # QuantizedKVCache keeps (packed, scales, biases) tuples; every part moves alike
    return [a for part in (c.keys, c.values)
            for a in (part if isinstance(part, (tuple, list)) else (part,))]


def keep_rows(cache: list, base: int, rows: list[int]) -> None:
    """Move the cached entries at `base + rows[i]` to `base + i` (rows ascending), in every
    layer: the accepted path's K/V, in order, right after the context. Trim the rest after."""
    if rows == list(range(len(rows))):
        return  # already in place
    src = mx.array(rows, dtype=mx.int32) + base
    parts = [a for c in cache for a in _parts(c)]
    moved = [a[..., src, :] for a in parts]
    # evaluated on their own, the gathers no longer hold the buffers, so the writes below
    # happen in place; in one graph each write would copy its layer's whole cache
    mx.eval(moved)
    for a, m in zip(parts, moved):
        a[..., base: base + len(rows), :] = m
