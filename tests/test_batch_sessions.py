"""A batched sequence started from a `Session` ends in it, as a single-sequence run would:
its target cache rows are a fresh prefill of its tokens, its draft context plus pending taps
cover the same positions, and the next turn in that session decodes exactly what a fresh
session does (the server's prompt cache reuses batched replies this way); sliding-window
sessions too, joining from wrapped windows and going back to them, and hybrid (GatedDeltaNet)
sessions; both keep their prompt's end to rewind to, as a single run does."""

from __future__ import annotations

import mlx.core as mx
import pytest
from mlx_lm.models.cache import RotatingKVCache

from dflash_mlx import Session, stream_generate, tiny
from dflash_mlx.batch import Batch
from dflash_mlx.models.dflash import DFlashDraftModel
from dflash_mlx.speculate import SpeculationConfig
from support.batch_run import check_caches
from support.engine import GATED, float32_pair, make_draft4, mlx_lm_greedy


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("batch-sessions")
    return float32_pair(tiny.make_target(root / "t"),
                        tiny.make_draft(root / "d", tiny.draft_config(block_size=8)),
                        DFlashDraftModel)


def _fresh(target, tokens):
    cache = target.make_cache()
    target(mx.array([tokens]), cache, taps=False)
    return [(c.keys[..., : len(tokens), :], c.values[..., : len(tokens), :]) for c in cache]


def _close(a, b) -> bool:
    return float(mx.abs(a - b).max()) / (float(mx.abs(b).max()) + 1e-6) < 1e-4


def _check_session(pair, s: Session):
    cached = s.tokens[:-1]  # the last token is the next round's first slot
    assert all(c.offset == len(cached) for c in s.target_cache)
    for c, (k, v) in zip(s.target_cache, _fresh(pair.target, cached)):
        assert c.keys[..., : c.offset, :].shape == k.shape
        assert _close(c.keys[..., : c.offset, :], k) and _close(c.values[..., : c.offset, :], v)
    pending = 0 if s.pending is None else s.pending.shape[1]
    assert all(d.offset + pending == len(cached) for d in s.draft_cache)


def _tokens(events):
    return [t for e in events for t in e.tokens]


def test_sequences_leave_their_caches_in_their_sessions(pair):
    config = SpeculationConfig(block_size=5, lookup=False, adaptive=False)
    prompts = [[5, 9, 11, 30, 2], [7] * 12 + [40, 41], list(range(60, 90))]
    sessions = [Session.new(pair, config) for _ in prompts]
    batch = Batch(pair, config)
    outs = {}
    for p, s in zip(prompts, sessions):
        outs[batch.add(p, max_tokens=12, session=s)] = []
    steps = 0
    while batch.running:
        for ev in batch.step():
            outs[ev.index] += ev.tokens
        steps += 1
        if steps == 2:
            assert batch.cancel(1)  # a client that leaves: its session still gets its row
    for i, (p, s) in enumerate(zip(prompts, sessions)):
        assert s.tokens == p + outs[i], f"sequence {i}"
        _check_session(pair, s)
    # the next turn in a session the batch left equals it in a fresh session
    follow = [3, 4, 5]
    for p, s, i in zip(prompts, sessions, range(3)):
        turn = p + outs[i] + follow
        cached = len(s.tokens) - 1
        events = list(stream_generate(pair, turn, config, session=s, max_tokens=10))
        fresh = _tokens(stream_generate(pair, turn, config, max_tokens=10))
        assert _tokens(events) == fresh
        # the whole conversation so far was reused, only the follow-up prefilled
        assert events[0].reused_tokens == cached
        assert events[0].prompt_tokens == len(follow)


def _together_then_next_turns(pair, config, prompts, sessions, n: int) -> list:
    """Decode `prompts` in one batch from `sessions` (every cache checked after each round);
    each answer must be its own run's and mlx-lm's and land in its session. Then a next turn
    alone in each session, extending the reply (all reused) or, in session 1, changing it
    (back to the prompt's end, the checkpoint a single run keeps), decodes what a fresh
    session does. Returns the batch's outputs."""
    batch = Batch(pair, config)
    assert batch.serial is None
    outs = {batch.add(p, max_tokens=n, session=s): [] for p, s in zip(prompts, sessions)}
    check = check_caches(pair)
    while batch.running:
        for ev in batch.step():
            outs[ev.index] += ev.tokens
        check(batch)
    for i, (p, s) in enumerate(zip(prompts, sessions)):
        assert outs[i] == _tokens(stream_generate(pair, p, config, max_tokens=n))
        assert outs[i] == mlx_lm_greedy(pair.target.model, p, len(outs[i]))
        assert s.tokens == p + outs[i]
        turn, reused = ((s.tokens + [3, 4, 5], len(s.tokens) - 1) if i != 1 else
                        (p + [9, 8, 7], len(p) - 1))
        events = list(stream_generate(pair, turn, config, session=s, max_tokens=8))
        assert _tokens(events) == _tokens(stream_generate(pair, turn, config, max_tokens=8))
        assert events[0].reused_tokens == reused
    return outs


@pytest.fixture(scope="module")
def window_pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("batch-window-sessions")
    return float32_pair(tiny.make_target(root / "g", **GATED), make_draft4(root / "d"),
                        DFlashDraftModel)


def test_wrapped_sliding_windows_join_and_go_back(window_pair):
    """Sessions whose rotating caches wrapped in a first turn alone (they hold only the
    window's last entries) join a batch, decode together and leave: each answer is its own
    run's and mlx-lm's, and the turn after that, alone in the session, is a fresh session's."""
    pair = window_pair
    config = SpeculationConfig(block_size=5, lookup=False, adaptive=False)
    firsts = [(list(range(3, 40)), 6), ([7] * 12 + [40, 41], 9), ([5, 9], 2)]  # window: 8
    sessions = []
    for p, n in firsts:
        s = Session.new(pair, config)
        list(stream_generate(pair, p, config, session=s, max_tokens=n))
        sessions.append(s)
    # they join from wrapped windows (offset past the window: only its last entries held)
    assert all(c.offset > c.max_size for c in sessions[0].target_cache
               if isinstance(c, RotatingKVCache))
    seconds = [s.tokens + [20, 21, 22] for s in sessions]
    _together_then_next_turns(pair, config, seconds, sessions, 14)


@pytest.fixture(scope="module")
def hybrid_pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("batch-hybrid-sessions")
    return float32_pair(tiny.make_hybrid_target(root / "h"),
                        tiny.make_draft(root / "d", tiny.draft_config(block_size=8)),
                        DFlashDraftModel)


def test_recurrent_sessions_join_and_go_back(hybrid_pair):
    """Hybrid (GatedDeltaNet) sessions, one with a first turn of its own and two fresh, decode
    together and leave, then go on alone (`_together_then_next_turns`)."""
    pair = hybrid_pair
    config = SpeculationConfig(block_size=5, lookup=False, adaptive=False)
    first = Session.new(pair, config)
    list(stream_generate(pair, [3, 14, 15, 92, 6], config, session=first, max_tokens=5))
    sessions = [first, Session.new(pair, config), Session.new(pair, config)]
    prompts = [first.tokens + [20, 21], [7] * 12 + [40, 41], list(range(60, 90))]
    _together_then_next_turns(pair, config, prompts, sessions, 12)
