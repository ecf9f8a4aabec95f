"""The device path: an in-place draft context cache, per-chunk draft prefill, top-k by
partition, and one host sync per greedy round."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from dflash_mlx import SpeculationConfig, load, stream_generate, tiny
from dflash_mlx import generate as gen
from dflash_mlx.generate import Session, prefill
from dflash_mlx.models.cache import ContextCache
from dflash_mlx.speculate.sampling import SamplingParams, sampling_probs
from support.engine import Oracle, OracleDraft, RecordingTarget, float32_pair, mlx_lm_greedy


@pytest.fixture(scope="module")
def tiny_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("device")
    return tiny.make_target(root / "target"), tiny.make_draft(root / "draft")


# -- the context cache against a list of rows --------------------------------------------------

@pytest.mark.parametrize("max_rows", [None, 7, 300])
def test_context_cache_matches_a_plain_list_of_rows(max_rows):
    """Appends, trims and block reads of every size, across many buffer growths and
    compactions: the rows read are always exactly the newest `max_rows` rows, in order."""
    rng = np.random.default_rng(0)
    cache, rows, start = ContextCache(max_rows), [], 0  # rows[i] is position i
    allocations = 0
    last_buffer = None
    for step in range(300):
        op = rng.integers(0, 10)
        if op < 7:
            n = int(rng.integers(1, 40 if step % 50 == 0 else 6))
            new = [rng.standard_normal((1, 2, 1, 4)).astype(np.float32) for _ in range(n)]
            k = mx.array(np.concatenate(new, axis=2))
            cache.append(k, -k)
            rows += new
            if max_rows is not None:
                start = max(start, len(rows) - max_rows)
        elif op < 9:
            n = int(rng.integers(0, 8))
            cache.trim(n)
            rows = rows[: max(len(rows) - n, 0)]
            start = min(start, len(rows))
        else:
            block = mx.array(rng.standard_normal((1, 2, 5, 4)).astype(np.float32))
            keys, values = cache.with_block(block, block)
            want = np.concatenate(rows[start:] + [np.array(block)], axis=2)
            np.testing.assert_array_equal(np.array(keys), want)
            np.testing.assert_array_equal(np.array(values[:, :, : len(rows) - start]),
                                          -want[:, :, : len(rows) - start])
        assert (cache.offset, cache.start, cache.size()) == (len(rows), start, len(rows) - start)
        if rows[start:]:
            np.testing.assert_array_equal(np.array(cache.keys),
                                          np.concatenate(rows[start:], axis=2))
        else:
            assert cache.keys is None
        mx.eval(cache.state)
        buffer = cache.state[0].shape if cache.state else None
        allocations += buffer != last_buffer
        last_buffer = buffer
    # buffers are reallocated in steps, not per append
    assert allocations < 20


def test_with_block_does_not_copy_the_context():
    """The block read is a view of the cache's own buffer: nothing proportional to the context
    is allocated per round (measured as MLX's active memory)."""
    cache = ContextCache()
    k = mx.random.normal((1, 2, 4000, 64))
    cache.append(k, k)
    mx.eval(cache.state)
    block = mx.random.normal((1, 2, 8, 64))
    mx.eval(block)
    keys, values = cache.with_block(block, block)
    mx.eval(keys, values)
    before = mx.get_active_memory()
    for _ in range(5):
        cache.append(block[:, :, :2], block[:, :, :2])
        keys, values = cache.with_block(block, block)
        out = (keys.sum() + values.sum())
        mx.eval(out)
        del keys, values, out
    grown = mx.get_active_memory() - before
    assert grown < k.nbytes // 4, grown  # a copy of the context would be >= k.nbytes


# -- the draft fed per prefill chunk -----------------------------------------------------------

@pytest.mark.parametrize("window", [None, 24])
def test_draft_fed_per_chunk_proposes_what_a_whole_prompt_draft_does(tiny_dirs, monkeypatch,
                                                                     window):
    """Prefill in 16-token chunks (the draft absorbing each) gives the draft the same context
    as one pass over the whole prompt, and leaves at most one chunk pending."""
    pair = load(*tiny_dirs, weights="float32")
    prompt = list(range(20, 120))
    monkeypatch.setattr(gen, "prefill_step", lambda: 16)
    session = Session.new(pair, SpeculationConfig(draft_window=window))
    prefill(pair, session, prompt)
    assert session.pending.shape[1] <= 16
    assert session.draft_cache[0].offset + session.pending.shape[1] == len(prompt) - 1
    whole = Session.new(pair, SpeculationConfig(draft_window=window))
    _, taps = pair.target(mx.array([prompt[:-1]]), whole.target_cache)
    block = mx.array([[prompt[-1]] + [tiny.MASK_ID] * 4])
    a = pair.draft(block, session.pending, session.draft_cache)
    b = pair.draft(block, taps, whole.draft_cache)
    np.testing.assert_allclose(np.array(a), np.array(b), rtol=1e-4, atol=1e-4)


def test_prefill_step_is_per_device():
    want = 512 if mx.default_device() == mx.cpu else 2048
    assert gen.prefill_step() == want


# -- top-k by partition ------------------------------------------------------------------------

@pytest.mark.parametrize("top_k", [1, 3, 10, 63])
def test_top_k_keeps_exactly_what_a_sort_keeps(top_k):
    rng = np.random.default_rng(top_k)
    # few distinct values: ties at the k-th value are everywhere
    logits = rng.integers(-4, 5, size=(6, 64)).astype(np.float32)
    logits[0] = 1.0  # all tied
    got = np.array(sampling_probs(mx.array(logits), SamplingParams(1.0, 1.0, top_k)))
    kth = np.sort(logits, axis=-1)[:, 64 - top_k][:, None]
    kept = logits >= kth
    np.testing.assert_array_equal(got > 0, kept)
    want = np.where(kept, np.exp(logits - logits.max(-1, keepdims=True)), 0.0)
    np.testing.assert_allclose(got, want / want.sum(-1, keepdims=True), rtol=1e-5)


# -- host syncs --------------------------------------------------------------------------------

class SyncCounter:
    """Counts every way the host can wait for the device: tolist, item, scalar conversions,
    mx.eval and numpy conversions of an mx.array."""

    def __init__(self, monkeypatch):
        self.n = 0
        for name in ("tolist", "item", "__bool__", "__int__", "__float__", "__index__"):
            self._wrap(monkeypatch, mx.array, name)
        for name in ("eval", "synchronize"):
            self._wrap(monkeypatch, mx, name)
        for name in ("array", "asarray"):
            real = getattr(np, name)

            def conv(x, *a, _real=real, **kw):
                self.n += isinstance(x, mx.array)
                return _real(x, *a, **kw)
            monkeypatch.setattr(np, name, conv)

    def _wrap(self, monkeypatch, owner, name):
        real = getattr(owner, name, None)
        if real is None:
            return

        def counted(*a, **kw):
            self.n += 1
            return real(*a, **kw)
        monkeypatch.setattr(owner, name, counted)


@pytest.mark.parametrize("block_size", [2, 5])
def test_one_host_sync_per_greedy_round(tiny_dirs, monkeypatch, block_size):
    pair = load(*tiny_dirs, weights="float32")
    prompt = list(range(30, 50))
    ref = mlx_lm_greedy(pair.target.model, prompt, 24)
    config = SpeculationConfig(block_size=block_size, lookup=False, min_confidence=0.0)
    counter = SyncCounter(monkeypatch)
    seen, out = [], []
    for ev in stream_generate(pair, prompt, config, max_tokens=24):
        seen.append(counter.n)
        out += ev.tokens
    monkeypatch.undo()
    assert len(seen) > 3
    assert [b - a for a, b in zip(seen, seen[1:])] == [1] * (len(seen) - 1)
    assert out == ref


def test_one_host_sync_per_sampled_round(tiny_dirs, monkeypatch):
    pair = load(*tiny_dirs, weights="float32")
    config = SpeculationConfig(block_size=4, lookup=False, min_confidence=0.0)
    counter = SyncCounter(monkeypatch)
    seen = [counter.n for _ in stream_generate(pair, list(range(30, 50)), config,
                                                max_tokens=16, temperature=0.8, seed=3)]
    monkeypatch.undo()
    assert [b - a for a, b in zip(seen, seen[1:])] == [1] * (len(seen) - 1)


def test_oracle_rounds_stay_exact_with_one_sync(tiny_dirs, monkeypatch):
    """Every accept pattern (an oracle draft, sometimes wrong) still gives mlx-lm's greedy."""
    pair = float32_pair(*tiny_dirs, OracleDraft, RecordingTarget)
    prompt = list(range(60, 75))
    ref = mlx_lm_greedy(pair.target.model, prompt, 30)
    pair.draft.oracle = Oracle(ref, len(prompt), 0.3, 7)
    config = SpeculationConfig(block_size=5, lookup=False, min_confidence=0.0)
    out = [t for ev in stream_generate(pair, prompt, config, max_tokens=30) for t in ev.tokens]
    assert out == ref
