"""Prompts prefilled together (`batch_prefill.prefill_together`) leave each session exactly as
its own `generate.prefill` does: the target's cache rows, the draft's context (with and
without a draft window, whose rows before the window are skipped) and the pending taps, over
several chunks and ragged lengths (a one-token prompt too), a recurrent (GatedDeltaNet)
layer's states too; and a batch of fresh prompts, prefilled together, decodes what each
decodes alone."""

from __future__ import annotations

import mlx.core as mx
import pytest
from mlx_lm.models.cache import ArraysCache

from dflash_mlx import Session, batch_prefill, generate, stream_generate, tiny
from dflash_mlx.batch import batch_generate
from dflash_mlx.models import hybrid
from dflash_mlx.models.dflash import DFlashDraftModel
from dflash_mlx.speculate import SpeculationConfig
from support.engine import float32_pair

PROMPTS = [list(range(3, 40)), [7], [11, 12, 13, 14, 15, 16, 17, 18, 19], list(range(50, 71))]


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("batch-prefill")
    return float32_pair(tiny.make_target(root / "t"),
                        tiny.make_draft(root / "d", tiny.draft_config(block_size=8)),
                        DFlashDraftModel)


def _close(a, b) -> bool:
    if a is None or b is None:
        return a is None and b is None
    return a.shape == b.shape and \
        float(mx.abs(a - b).max()) <= 1e-4 * (float(mx.abs(b).max()) + 1e-6)


@pytest.mark.parametrize("window", [None, 6])
def test_together_equals_one_at_a_time(pair, monkeypatch, window):
    # several chunks: 8 columns per row and pass, as one prefill's 8
    monkeypatch.setattr(batch_prefill, "prefill_step", lambda: 8 * len(PROMPTS))
    monkeypatch.setattr(batch_prefill, "MIN_CHUNK", 1)
    monkeypatch.setattr(generate, "prefill_step", lambda: 8)
    config = SpeculationConfig(block_size=5, draft_window=window)
    together = [Session.new(pair, config) for _ in PROMPTS]
    rows = batch_prefill.prefill_together(pair, together, PROMPTS)
    for i, (p, s) in enumerate(zip(PROMPTS, together)):
        alone = Session.new(pair, config)
        generate.prefill(pair, alone, p)
        assert s.tokens == alone.tokens == p
        for a, b in zip([c.export(i) for c in rows], alone.target_cache):
            assert a.offset == b.offset == len(p) - 1
            assert _close(a.keys[..., : a.offset, :] if a.offset else None,
                          b.keys[..., : b.offset, :] if b.offset else None)
            assert _close(a.values[..., : a.offset, :] if a.offset else None,
                          b.values[..., : b.offset, :] if b.offset else None)
        for a, b in zip(s.draft_cache, alone.draft_cache):
            assert (a.offset, a.start) == (b.offset, b.start)
            assert _close(a.keys, b.keys) and _close(a.values, b.values)
        assert _close(s.pending, alone.pending)


def test_fresh_prompts_decode_what_each_decodes_alone(pair, monkeypatch):
    monkeypatch.setattr(batch_prefill, "prefill_step", lambda: 8)
    config = SpeculationConfig(block_size=5, lookup=False)
    calls = []
    real = batch_prefill.prefill_together
    monkeypatch.setattr("dflash_mlx.batch.prefill_together",
                        lambda *a: calls.append(len(a[2])) or real(*a))
    outs = {i: [] for i in range(len(PROMPTS))}
    for ev in batch_generate(pair, PROMPTS, config, max_tokens=16):
        outs[ev.index] += ev.tokens
    # lengths 37, 21, 9 share passes (44 tokens of padding); the one-token prompt would pad 36
    # more (80 > 64 tokens of slack), so it goes alone
    assert calls == [3, 1]
    for i, p in enumerate(PROMPTS):
        alone = [t for e in stream_generate(pair, p, config, max_tokens=16) for t in e.tokens]
        assert outs[i] == alone, f"sequence {i}"


def test_groups_keep_padding_within_a_quarter_or_the_slack():
    assert batch_prefill.groups([]) == []
    assert batch_prefill.groups([10, 10, 10]) == [[0, 1, 2]]
    # 60 and 30 pad 30 (<= 64); adding 5 would pad 85
    assert batch_prefill.groups([5, 60, 30], slack=64) == [[1, 2], [0]]
    # 60 and 30 pad 30 > 16 and > 90 / 4; 30 and 5 pad 25 > 16
    assert batch_prefill.groups([5, 60, 30], slack=16) == [[1], [2], [0]]
    # long prompts: a quarter of their tokens (padding 200 <= 450, then 500 <= 625; not 4000)
    assert batch_prefill.groups([1000, 800, 700], slack=0) == [[0, 1, 2]]
    assert batch_prefill.groups([4000, 1000], slack=0) == [[0], [1]]


def test_recurrent_rows_prefilled_together_equal_alone(tmp_path, monkeypatch):
    """A hybrid (GatedDeltaNet) target's prompts of different lengths in passes too long to
    replay (over `REPLAY_MAX` columns): the padding is masked in the pass, so each row's conv
    and recurrent state is its own prefill's; then they decode what each decodes alone."""
    pair = float32_pair(tiny.make_hybrid_target(tmp_path / "h"),
                        tiny.make_draft(tmp_path / "d", tiny.draft_config(block_size=8)),
                        DFlashDraftModel)
    prompts = [[(7 * i + j) % 200 + 3 for j in range(n)] for i, n in enumerate((150, 121, 97))]
    monkeypatch.setattr(batch_prefill, "prefill_step", lambda: 600)  # 200 columns a row
    config = SpeculationConfig(block_size=5, lookup=False)
    together = [Session.new(pair, config) for _ in prompts]
    rows = batch_prefill.prefill_together(pair, together, prompts)
    assert max(map(len, prompts)) > hybrid.REPLAY_MAX
    for i, p in enumerate(prompts):
        alone = Session.new(pair, config)
        generate.prefill(pair, alone, p)
        states = [(c.export(i), b) for c, b in zip(rows, alone.target_cache)
                  if isinstance(b, ArraysCache)]
        assert states
        for a, b in states:
            assert _close(a[0], b[0]) and _close(a[1], b[1])
    outs = {i: [] for i in range(len(prompts))}
    for ev in batch_generate(pair, prompts, config, max_tokens=16):
        outs[ev.index] += ev.tokens
    for i, p in enumerate(prompts):
        alone = [t for e in stream_generate(pair, p, config, max_tokens=16) for t in e.tokens]
        assert outs[i] == alone, f"sequence {i}"
