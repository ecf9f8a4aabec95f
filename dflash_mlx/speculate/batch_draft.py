"""One draft pass for a batch of sequences: each row its own context, positions and block.

The draft's `Attention` reads one `ContextCache` at one position. For the length of a batched
call each layer's `self_attn` is swapped, per instance, for `_RowsAttention`, which runs the same
projections, norms and RoPE over a `RaggedContextCache` at per-row positions and masks each
row to its own context and block (restored in `finally`; the draft class is never patched).
Rows bring different numbers of new context rows (the taps of what each sequence accepted last
round): they come padded to the longest and each row keeps its own count. A row that drafts
nothing this round (it decodes plainly in it) still absorbs its context; its block's slots
skip the feed-forward blocks (`models/packed.py`).

What the draft proposes never changes what the target accepts: these numbers only move the
acceptance rate, never the output.
"""

from __future__ import annotations

from contextlib import contextmanager

import mlx.core as mx

from ..models.block_attention import block_attention
from ..models.packed import packed_layers
from .batch_cache import RaggedContextCache
from .proposal import full_block


class _RowsAttention:
    """Stands in for one draft `Attention` during a batched call."""

    def __init__(self, attn):
        self._attn = attn

    def __getattr__(self, name):
        return getattr(self._attn, name)

    def __call__(self, x: mx.array, ctx: mx.array | None, cache: RaggedContextCache):
        a = self._attn
        B, L, _ = x.shape
        if ctx is not None and ctx.shape[1] > 0:
            kc = a.k_norm(a._heads(a.k_proj(ctx), a.n_kv_heads))
            vc = a._heads(a.v_proj(ctx), a.n_kv_heads)
            cache.append(a.rope(kc, offset=cache.offset), vc)
        pos = cache.offset  # per row: absolute position of block slot 0
        q = a.rope(a.q_norm(a._heads(a.q_proj(x), a.n_heads)), offset=pos)
        kb = a.rope(a.k_norm(a._heads(a.k_proj(x), a.n_kv_heads)), offset=pos)
        vb = a._heads(a.v_proj(x), a.n_kv_heads)
        keys, values = cache.with_block(kb, vb)
        out = block_attention(q, keys, values, a.scale, cache.block_mask(L, a.window, a.causal))
        return a.o_proj(out.transpose(0, 2, 1, 3).reshape(B, L, -1))


@contextmanager
def _rows_attention(draft):
    saved = [(layer, layer["self_attn"]) for layer in draft.layers]
    try:
        for layer, attn in saved:
            # item assignment bypasses nn.Module.__setattr__ and keeps the key order
            layer["self_attn"] = _RowsAttention(attn)
        yield
    finally:
        for layer, attn in saved:
            layer["self_attn"] = attn


def make_draft_caches(draft, window: int | None = None) -> list[RaggedContextCache]:
    """Empty batch caches with the bounds of `draft.make_cache(window)`, layer by layer."""
    return [RaggedContextCache(c.max_rows) for c in draft.make_cache(window)]


def pad_context(pending: list[mx.array | None]) -> tuple[mx.array | None, list[int]]:
    """Per-row pending taps (1, n_b, T) or None, as one (B, max n, T) array and the counts."""
    counts = [0 if p is None else p.shape[1] for p in pending]
    top = max(counts, default=0)
    if top == 0:
        return None, counts
    like = next(p for p in pending if p is not None and p.shape[1])
    rows = []
    for p, n in zip(pending, counts):
        if n == top:
            rows.append(p)
            continue
        fill = mx.zeros((1, top - n, like.shape[2]), like.dtype)
        rows.append(fill if n == 0 else mx.concatenate([p, fill], axis=1))
    return mx.concatenate(rows), counts


def draft_rows(draft, block_ids: mx.array, pending: list[mx.array | None],
               caches: list[RaggedContextCache], drafting: list[bool] | None = None
               ) -> mx.array:
    """Hidden states (B, L, H) of every slot of `block_ids` (B, L), drafted at the trained
    width; the caches absorb each row's pending taps. `drafting`: the rows whose proposals
    are read (the others' slots skip the feed-forward work; None: all). If the pass fails,
    every row's cache is back where it was (its taps stay pending)."""
    if not draft.is_bound:
        raise RuntimeError("draft is not bound to a target; call bind(target) first")
    context, counts = pad_context(pending)
    snaps = [c.snapshot() for c in caches]
    try:
        for c in caches:
            c.incoming = list(counts)
        block = full_block(draft, block_ids)
        width = block.shape[1]
        real = [width if d else 1 for d in drafting or [True] * block.shape[0]]
        with _rows_attention(draft), packed_layers(draft.layers, real, width):
            hidden = draft(block, context, caches)
        return hidden[:, : block_ids.shape[1]]
    except BaseException:
        for c, s in zip(caches, snaps):
            c.restore(s)
        raise
