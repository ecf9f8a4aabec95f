"""Sliding-window drafts: masks by absolute position, bounded caches, --draft-window."""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

from dflash_mlx import SpeculationConfig, load, stream_generate, tiny
from dflash_mlx.models.config import DraftConfig
from dflash_mlx.generate import Session, prefill
from dflash_mlx.models.dflash2 import DFlash2DraftModel
from dflash_mlx.models.cache import ContextCache
from dflash_mlx.models.dflash import Attention, DFlashDraftModel
from dflash_mlx.errors import DFlashError

FIXTURES = Path(__file__).parent / "fixtures" / "checkpoints"
W = 6


def sliding_config(window=W, layer_types=None, is_causal=False, dflash2=False, **over):
    layer_types = layer_types or ["sliding_attention"] * 2
    maker = tiny.dflash2_config if dflash2 else tiny.draft_config
    extra = {} if is_causal is None else {"is_causal": is_causal}
    return maker(layer_types=layer_types, sliding_window=window, **extra, **over)


# -- config semantics -----------------------------------------------------------------------

def test_causality_defaults_and_overrides():
    raw = json.loads((FIXTURES / "muse-glimmer-30b-dflash2.config.json").read_text())
    cfg = DraftConfig.from_dict(raw)
    assert cfg.sliding_window == 2048 and all(cfg.layer_is_sliding(i) for i in range(5))
    assert not any(cfg.layer_is_causal(i) for i in range(5))  # explicit is_causal: false
    raw.pop("is_causal")
    silent = DraftConfig.from_dict(raw)  # upstream default: sliding layers are causal in-block
    assert all(silent.layer_is_causal(i) for i in range(5))
    meta_raw = json.loads((FIXTURES / "muse-glimmer-30b-assistant.config.json").read_text())
    meta_raw.setdefault("vocab_size", 202048)  # the Meta config has none (reference §5.3)
    meta = DraftConfig.from_dict(meta_raw)
    assert not any(meta.layer_is_causal(i) for i in range(5))  # the assistant head: bidirectional
    mixed = sliding_config(layer_types=["sliding_attention", "full_attention"], is_causal=None)
    assert mixed.layer_is_causal(0) and not mixed.layer_is_causal(1)
    v1 = DraftConfig.from_dict(json.loads((FIXTURES / "qwen3-4b-dflash-b16.config.json").read_text()))
    attn = Attention(v1, 0)
    assert attn.window is None and not attn.causal and attn._mask(4, ContextCache()) is None


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("start, offset, L", [(0, 0, 4), (0, 3, 4), (5, 10, 4), (90, 95, 8)])
def test_mask_is_by_absolute_position(causal, start, offset, L):
    cfg = sliding_config(is_causal=causal)
    attn = Attention(cfg, 0)
    cache = ContextCache()
    cache.start, cache.offset = start, offset
    got = np.array(attn._mask(L, cache))
    k_pos = list(range(start, offset)) + list(range(offset, offset + L))
    for qi in range(L):
        q = offset + qi
        for ki, k in enumerate(k_pos):
            if k < offset:  # context key: inside the window
                want = q - k < W
            else:  # block key: always, or causal
                want = (k <= q) if causal else True
            assert got[qi, ki] == want, (qi, k)


# -- bounded caches give exactly the unbounded result --------------------------------------

def _bind(model, tmp_path):
    pair = load(tiny.make_target(tmp_path / "t"), None, weights="float32")
    pair.target.set_taps(model.config.target_layer_ids)
    return model.bind(pair.target)


@pytest.mark.parametrize("dflash2", [False, True])
def test_dropping_old_rows_never_changes_the_output(tmp_path, dflash2):
    """Rows the window dropped were masked anyway: bounded and unbounded caches agree, over
    enough rounds that a ring buffer would have wrapped many times."""
    cfg = sliding_config(dflash2=dflash2)
    mx.random.seed(0)
    model = _bind((DFlash2DraftModel if dflash2 else DFlashDraftModel)(cfg), tmp_path)
    if dflash2:
        tiny.randomize_dflash2(model)
    bounded = model.make_cache()
    unbounded = [ContextCache(None) for _ in bounded]
    assert all(c.max_rows == W - 1 for c in bounded)
    rng = np.random.default_rng(1)
    n_ctx = len(cfg.target_layer_ids) * cfg.hidden_size
    for r in range(40):
        rows = int(rng.integers(0, 5)) if r else 9
        ctx = mx.random.normal((1, rows, n_ctx)) if rows else None
        block = mx.array([[int(rng.integers(0, 256))] + [tiny.MASK_ID] * 4])
        a = model(block, ctx, bounded)
        b = model(block, ctx, unbounded)
        # float32 sums over a different number of keys round differently with the CPU's BLAS
        # kernels (1.2e-5 seen on an AMD machine); a wrong window is off by ~1e-1
        np.testing.assert_allclose(np.array(a), np.array(b), rtol=1e-4, atol=1e-4)
        for cb, cu in zip(bounded, unbounded):
            assert cb.offset == cu.offset and cb.size() == min(cu.size(), W - 1)
            # temporal order: the kept rows are exactly the newest rows
            assert mx.array_equal(cb.keys, cu.keys[:, :, cu.size() - cb.size():])


def test_all_sliding_prefill_keeps_only_the_last_window_rows(tmp_path):
    t = tiny.make_target(tmp_path / "t")
    d = tiny.make_draft(tmp_path / "d", sliding_config())
    pair = load(t, d, weights="float32")
    prompt = list(range(40, 140))
    session = Session.new(pair)
    prefill(pair, session, prompt)
    P = len(prompt)
    assert session.pending.shape[1] == W - 1  # only what the window can ever read
    assert all(c.offset == P - 1 - (W - 1) and c.size() == 0 for c in session.draft_cache)
    # the proposal equals that of a draft fed every prompt row
    full = Session.new(pair)
    full.draft_cache = [ContextCache(None) for _ in full.draft_cache]
    _, taps = pair.target(mx.array([prompt[:-1]]), full.target_cache)
    block = mx.array([[prompt[-1]] + [tiny.MASK_ID] * 4])
    a = pair.draft(block, session.pending, session.draft_cache)
    b = pair.draft(block, taps, full.draft_cache)
    np.testing.assert_allclose(np.array(a), np.array(b), rtol=1e-5, atol=1e-5)
    assert all(c.offset == P - 1 for c in session.draft_cache)  # positions stay absolute


def test_sliding_drafts_are_lossless(tmp_path):
    t = tiny.make_target(tmp_path / "t")
    ar_pair = load(t, None, weights="float32")
    prompt = list(range(60, 90))
    ar = [x for e in stream_generate(ar_pair, prompt, block_size=1, max_tokens=30) for x in e.tokens]
    for i, cfg in enumerate([sliding_config(), sliding_config(is_causal=None),
                             sliding_config(dflash2=True)]):
        maker = tiny.make_dflash2_draft if cfg.is_dflash2 else tiny.make_draft
        pair = load(t, maker(tmp_path / f"d{i}", cfg), weights="float32")
        got = [x for e in stream_generate(pair, prompt, max_tokens=30) for x in e.tokens]
        assert got == ar


# -- --draft-window ---------------------------------------------------------------------------

def test_draft_window_bounds_every_cache(tmp_path):
    t = tiny.make_target(tmp_path / "t")
    d = tiny.make_draft(tmp_path / "d")  # full attention: unbounded without the option
    plain = load(t, d, weights="float32")
    assert plain.draft.context_rows_needed() is None
    pair = load(t, d, weights="float32")
    config = SpeculationConfig.for_pair(pair, draft_window=8)
    assert config.draft_window == 8 and pair.draft.context_rows_needed(8) == 8
    pair.tokenizer._eos_token_ids = set()
    prompt = list(range(30, 70))
    session = Session.new(pair, config)
    events = list(stream_generate(pair, prompt, config, max_tokens=40, session=session))
    assert all(c.size() <= 8 for c in session.draft_cache)
    assert session.draft_cache[0].offset + (0 if session.pending is None
                                            else session.pending.shape[1]) == len(session.tokens) - 1
    ar = [x for e in stream_generate(plain, prompt, block_size=1, max_tokens=40) for x in e.tokens]
    assert [x for e in events for x in e.tokens] == ar  # a window costs acceptance, not exactness
    with pytest.raises(DFlashError, match="draft-window"):
        SpeculationConfig(draft_window=0)


def test_rewinding_past_a_window_keeps_positions_absolute(tmp_path):
    c = ContextCache(4)
    for _ in range(3):
        c.append(mx.zeros((1, 1, 3, 2)), mx.zeros((1, 1, 3, 2)))
    assert (c.start, c.offset, c.size()) == (5, 9, 4)
    c.trim(6)  # back to position 3, before any kept row
    assert (c.start, c.offset, c.size(), c.keys) == (3, 3, 0, None)
    c.append(mx.ones((1, 1, 2, 2)), mx.ones((1, 1, 2, 2)))
    assert (c.start, c.offset, c.size()) == (3, 5, 2)
    # and through a multi-turn session: the second turn rewinds before the window's start
    t = tiny.make_target(tmp_path / "t")
    pair = load(t, tiny.make_draft(tmp_path / "d", sliding_config()), weights="float32")
    ar_pair = load(t, None, weights="float32")
    session = Session.new(pair)
    p1 = list(range(10, 40))
    list(stream_generate(pair, p1, max_tokens=12, session=session))
    p2 = p1[:8] + [3, 4, 5]
    got = [x for e in stream_generate(pair, p2, max_tokens=10, session=session) for x in e.tokens]
    assert got == [x for e in stream_generate(ar_pair, p2, block_size=1, max_tokens=10)
                   for x in e.tokens]
    pending = 0 if session.pending is None else session.pending.shape[1]
    assert session.draft_cache[0].offset + pending == len(session.tokens) - 1
