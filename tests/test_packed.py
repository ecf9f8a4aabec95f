"""A packed pass (`models/packed.py`): the feed-forward blocks and the head run on the real
rows only, and every real row's logits and taps are those of the padded pass.

Each family of tiny target (qwen3, llama, gemma3 with sliding windows, hybrid GatedDeltaNet)
runs one (B, W) pass over a batch's caches twice from the same state, padded and packed; the
real rows must agree and each layer's feed-forward block must have seen only the real rows
(R = sum of widths), so the saving is real. The swapped modules are back after the pass, also
when it raises. A batched draft pass skips the block rows of the sequences that draft nothing
and still absorbs every row's context.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.cache import KVCache

from dflash_mlx.batch import Batch
from dflash_mlx.models.packed import packed
from dflash_mlx.speculate import SpeculationConfig
from dflash_mlx.speculate.batch_draft import draft_rows
from dflash_mlx.speculate.batch_cache import row_lengths, set_lengths
from dflash_mlx.speculate.batch_window import ragged_caches
from support.batch_run import dirs, pairs  # noqa: F401

WIDTHS = [5, 1, 3]


class _Spy:
    """Records the shapes a module is called with."""

    def __init__(self, module, seen: list):
        self.module, self.seen = module, seen

    def __call__(self, x, *args, **kwargs):
        self.seen.append(tuple(x.shape))
        return self.module(x, *args, **kwargs)

    def __getattr__(self, name):
        return getattr(self.module, name)


def valid(cache) -> list[np.ndarray]:
    """Each row's cached keys and values (what lies past a row's end is scratch)."""
    return [np.array(a[b, :, lo:hi]) for b, (lo, hi) in enumerate(zip(cache.left, cache.end))
            for a in cache.state]


def _state(target, prompts: list[list[int]]):
    caches = ragged_caches(target)
    for c in caches:  # one empty row per prompt, as a batch's prefill starts
        c.add(*[KVCache() for _ in prompts])
    target(mx.array(prompts), caches, taps=False)
    set_lengths(caches, [len(p) for p in prompts])
    mx.eval([c.state for c in caches])
    return caches


@pytest.mark.parametrize("family", ["qwen3", "llama", "gemma3", "hybrid"])
def test_real_rows_equal_the_padded_pass(pairs, family):
    target = pairs[family].target
    prompts = [[(7 * b + i) % 200 + 3 for i in range(12)] for b in range(len(WIDTHS))]
    ids = mx.array([[(11 * b + i) % 200 + 3 for i in range(max(WIDTHS))]
                    for b in range(len(WIDTHS))])
    caches = _state(target, prompts)
    base = row_lengths(caches)
    padded, padded_taps = target(ids, caches, taps=True)
    mx.eval(padded, padded_taps)
    set_lengths(caches, base)
    seen: list = []
    layer = target.layers[0]
    layer["mlp"] = _Spy(layer["mlp"], seen)
    try:
        with packed(target, WIDTHS, max(WIDTHS)):
            logits, taps = target(ids, caches, taps=True)
            mx.eval(logits, taps)
    finally:
        layer["mlp"] = layer["mlp"].module
    assert seen == [(1, sum(WIDTHS), target.hidden_size)]
    for b, w in enumerate(WIDTHS):
        np.testing.assert_allclose(np.array(logits[b, :w]), np.array(padded[b, :w]),
                                   rtol=1e-4, atol=1e-4)
        np.testing.assert_allclose(np.array(taps[b, :w]), np.array(padded_taps[b, :w]),
                                   rtol=1e-4, atol=1e-4)
        assert (logits[b, :w].argmax(-1) == padded[b, :w].argmax(-1)).all().item()
        assert mx.isfinite(logits[b]).all().item()  # padding holds finite copies


def test_nothing_is_swapped_without_padding_and_everything_comes_back(pairs):
    target = pairs["qwen3"].target
    mlps = [layer["mlp"] for layer in target.layers]
    with packed(target, [4, 4], 4):
        assert [layer["mlp"] for layer in target.layers] == mlps
    with pytest.raises(RuntimeError):
        with packed(target, [4, 1], 4):
            assert all(layer["mlp"] is not m for layer, m in zip(target.layers, mlps))
            raise RuntimeError("a pass that fails")
    assert all(layer["mlp"] is m for layer, m in zip(target.layers, mlps))
    assert target.head_module is (target.model.get("lm_head") or
                                  target.model["model"]["embed_tokens"])


def test_a_draft_pass_skips_the_rows_that_draft_nothing(pairs):
    """In a round where only some sequences draft, the draft's feed-forward blocks run on
    those rows' block (the trained width) and one slot of each other row: the drafting rows'
    hidden states are those of the full pass, and every row's context is absorbed alike."""
    pair = pairs["qwen3"]
    draft = pair.draft
    batch = Batch(pair, SpeculationConfig(block_size=5, adaptive=False))
    try:
        for p in ([5, 9, 13, 17, 21, 25, 29], [7, 11, 15, 19]):
            batch.add(p, max_tokens=16)
        batch.step()  # both join and run a round: taps pending for the next draft pass
        rows = [s.row for s in batch._seqs]
        mask = draft.config.mask_token_id
        block = mx.array([[r.tokens[-1]] + [mask] * 4 for r in rows])
        pending = [r.pending for r in rows]
        snaps = [c.snapshot() for c in batch.draft_cache]
        full = draft_rows(draft, block, pending, batch.draft_cache)
        after = [(c.snapshot(), valid(c)) for c in batch.draft_cache]
        for c, s in zip(batch.draft_cache, snaps):
            c.restore(s)
        seen: list = []
        layer = draft.layers[0]
        layer["mlp"] = _Spy(layer["mlp"], seen)
        try:
            part = draft_rows(draft, block, pending, batch.draft_cache, [True, False])
        finally:
            layer["mlp"] = layer["mlp"].module
        trained = draft.config.block_size
        assert seen == [(1, trained + 1, draft.config.hidden_size)]
        np.testing.assert_allclose(np.array(part[0]), np.array(full[0]), rtol=1e-4, atol=1e-4)
        for c, (snap, entries) in zip(batch.draft_cache, after):
            assert c.snapshot() == snap
            for a, b in zip(valid(c), entries):
                np.testing.assert_array_equal(a, b)
    finally:
        batch.close()
