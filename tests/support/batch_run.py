"""Driving a `Batch` in tests: tiny pairs of every target family with an oracle draft per
row, a driver with joins and cancels, and the check that every row's cache is a fresh prefill
after a round (shared by the batch tests)."""

from __future__ import annotations

import random

import mlx.core as mx
import pytest
from mlx_lm.models.cache import ArraysCache

from dflash_mlx import stream_generate, tiny
from dflash_mlx.batch import Batch
from dflash_mlx.speculate.batch_cache import row_lengths
from dflash_mlx.speculate.batch_state import RaggedStateCache
from support.engine import GATED, Oracle, float32_pair, make_draft4, mlx_lm_greedy
from support.rows_oracle import Plan, RowsOracleDraft


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("batch")
    return {
        "qwen3": tiny.make_target(root / "qwen3"),
        "llama": tiny.make_target(root / "llama", model_type="llama", seed=5),
        "gemma3": tiny.make_target(root / "gemma3", **GATED),
        "hybrid": tiny.make_hybrid_target(root / "hybrid"),
        "draft": tiny.make_draft(root / "draft", tiny.draft_config(block_size=8)),
        "draft4": make_draft4(root / "draft4"),
    }


@pytest.fixture(scope="module")
def pairs(dirs):
    return {name: float32_pair(dirs[name], dirs["draft4" if name == "gemma3" else "draft"],
                               RowsOracleDraft)
            for name in ("qwen3", "llama", "gemma3", "hybrid")}


def reference(model, prompt: list[int], n: int) -> list[int]:
    ref = mlx_lm_greedy(model, prompt, n)
    return ref[: ref.index(tiny.EOS_ID) + 1] if tiny.EOS_ID in ref else ref


def prompts_for(seed: int, n: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(256) for _ in range(rng.randint(2, 40))] for _ in range(n)]


def drive(pair, prompts, config, n, p_wrong=None, seed=0, join=None, cancel=None, check=None,
          sampling=None, ragged=None):
    """Run a `Batch` to the end: {index: tokens}. `join`: (after step k, prompt) adds one;
    `cancel`: (after step k, index) drops one; `check(batch)` runs after every step.
    `p_wrong`: per-sequence oracle error rates (None: the draft's own proposals). `ragged`: a
    list that gets, per round, whether its rows accepted different numbers of tokens."""
    batch = Batch(pair, config)
    oracles = {}
    pair.draft.plan = Plan(batch, oracles) if p_wrong is not None else None
    everything = list(prompts) + ([join[1]] if join else [])

    def add(i, prompt):
        if p_wrong is not None:
            oracles[i] = Oracle(reference(pair.target.model, prompt, n), len(prompt),
                                p_wrong[i % len(p_wrong)], seed * 100 + i)
        assert batch.add(prompt, max_tokens=n, sampling=sampling and sampling[i]) == i

    for i, p in enumerate(prompts):
        add(i, p)
    outs, steps = {i: [] for i in range(len(everything))}, 0
    while batch.running:
        events = batch.step()
        for ev in events:
            outs[ev.index] += ev.tokens
        if ragged is not None:
            ragged.append(len({ev.accepted for ev in events}) > 1)
        steps += 1
        if join and steps == join[0]:
            add(len(prompts), join[1])
        if cancel and steps == cancel[0]:
            assert batch.cancel(cancel[1])
        if check:
            check(batch)
    pair.draft.plan = None
    return outs


def single(pair, prompt, config, n, sampling=None):
    if isinstance(pair.draft, RowsOracleDraft):
        pair.draft.plan = None
    return [t for e in stream_generate(pair, prompt, config, max_tokens=n, sampling=sampling)
            for t in e.tokens]


def _fresh_rows(target, tokens):
    """Per layer: a fresh prefill's (keys, values), or (conv, state) of a recurrent layer."""
    cache = target.make_cache()
    target(mx.array([tokens]), cache, taps=False)
    return [(c[0], c[1]) if isinstance(c, ArraysCache) else
            (c.keys[..., : len(tokens), :], c.values[..., : len(tokens), :]) for c in cache]


def _close(got, want):
    scale = float(mx.abs(want).max()) + 1e-6
    assert float(mx.abs(got - want).max()) / scale < 1e-4


def check_caches(pair):
    """After a round: each row's target cache is a fresh prefill of its tokens but the last
    (all of them while a plain round launched ahead is running: it wrote the last one; a
    sliding-window row at least the window's last entries of it; a recurrent layer's row the
    same conv and recurrent state), and its draft cache plus its pending taps cover its
    tokens but the last."""

    def check(batch):
        ahead = {id(r) for r in batch._ahead.rows} if batch._ahead is not None else set()
        for b, index in enumerate(batch.rows):
            committed = batch.tokens(index)
            row = batch._seqs[b].row
            tokens = committed[: len(committed) - (id(row) not in ahead)]
            assert row_lengths(batch.target_cache)[b] == len(tokens)
            assert all(c.lengths()[b] == len(tokens) for c in batch.target_cache
                       if hasattr(c, "lengths"))
            if batch.draft_cache is not None:
                pending = 0 if row.pending is None else row.pending.shape[1]
                assert batch.draft_cache[0].pos[b] + pending == len(committed) - 1
            for c, (k, v) in zip(batch.target_cache, _fresh_rows(pair.target, tokens)):
                if isinstance(c, RaggedStateCache):
                    _close(c[0][b: b + 1], k)
                    _close(c[1][b: b + 1], v)
                    continue
                got_k, got_v = c.rows(b)
                held = got_k.shape[2]  # a window row may hold only its last entries
                if getattr(c, "window", None):
                    assert held >= min(len(tokens), c.window)
                _close(got_k, k[..., len(tokens) - held:, :])
                _close(got_v, v[..., len(tokens) - held:, :])
    return check
