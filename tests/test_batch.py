"""The batched round is exact: every sequence of a batch gets what it would get alone.

Greedy: each sequence's output equals its own `stream_generate` run and mlx-lm's plain greedy
decoding, with prompts of different lengths, ragged acceptance (an oracle draft that is wrong at
a different rate per sequence), a sequence joining mid-way, one cancelled mid-batch, per-row
logits processors, block size 1, on sliding-window targets (batched: the window is the mask's)
and hybrid GatedDeltaNet targets (batched: each row replays the steps it accepted). After every
round each sequence's cache rows equal a fresh prefill of its tokens (a recurrent layer's row:
its conv and recurrent state). A batch that rolls every row back by the same amount (what one write index for all
rows would do) must fail the same check.

Sampling: the first token of each sequence of a batch follows the target's distribution
(chi-square), with other sequences, greedy and sampled, in the same batch; a sampler that skips
the residual must fail it.
"""

from __future__ import annotations

import random

import mlx.core as mx
import numpy as np
import pytest

from dflash_mlx import Session, tiny
from dflash_mlx.batch import Batch, batch_generate, serial_reason
from dflash_mlx.errors import InvalidArgumentError
from dflash_mlx.models.dflash import DFlashDraftModel
from dflash_mlx.speculate import SamplingParams, SpeculationConfig
from dflash_mlx.speculate import batch_round as batch_round_module
from dflash_mlx.speculate.batch_cache import row_lengths, set_lengths
from dflash_mlx.speculate.batch_state import RaggedStateCache
from dflash_mlx.speculate.processors import Processing
from dflash_mlx.speculate.sampling import rejection_sample_device
from support.batch_run import (check_caches, dirs, drive, pairs, prompts_for,  # noqa: F401
                               reference, single)
from support.engine import Oracle, float32_pair
from support.rows_oracle import Plan, one_hot_logits
from support.sampling import pick, target_rows
from support.stats import chi_square
from support.tiers import slow_after

V = tiny.VOCAB_SIZE

class Fixed:
    def __init__(self, rows: list[list[int]]):
        self.rows = rows


class FixedRowsDraft(DFlashDraftModel):
    """A real draft whose proposals are fixed ids, one list per row."""

    fixed: Fixed | None = None

    def proposal_logits(self, hidden):
        if self.fixed is None:
            return super().proposal_logits(hidden)
        ids = [r[: hidden.shape[-2]] for r in self.fixed.rows]
        return one_hot_logits(ids, hidden)


CASES = [(s, b) for s in range(4) for b in (3, 5, 8)]


@pytest.mark.parametrize("family", ["qwen3", "llama", "gemma3", "hybrid"])
@pytest.mark.parametrize("case", slow_after(CASES, keep=2, ids=[f"s{s}-b{b}" for s, b in CASES]))
def test_greedy_batch_equals_each_sequence_alone(pairs, family, case):
    """Ragged prompts and ragged acceptance (oracle error rates 0 .. 0.9 per row); gemma3's
    sliding-window layers (a window of 8) wrap many times; the hybrid's recurrent rows go back
    to different steps of one pass."""
    seed, block = case
    pair = pairs[family]
    prompts = prompts_for(seed, 5)
    config = SpeculationConfig(block_size=block, lookup=False)
    ragged = []
    outs = drive(pair, prompts, config, 40, p_wrong=[0.0, 0.2, 0.5, 0.9, 0.35], seed=seed,
                 ragged=ragged,
                 check=check_caches(pair) if family in ("gemma3", "hybrid") else None)
    assert sum(ragged) >= 5  # rows accepted different counts in one pass, many times
    for i, p in enumerate(prompts):
        ref = reference(pair.target.model, p, 40)
        assert outs[i] == ref, f"sequence {i} (prompt of {len(p)}) differs from mlx-lm"
        assert outs[i] == single(pair, p, config, 40)


def test_defaults_cut_and_lookup_give_ragged_widths(pairs):
    """The device's defaults (confidence cut, context lookup) and the random draft: rows verify
    different widths in one pass; outputs are still each sequence's own."""
    pair = pairs["qwen3"]
    config = SpeculationConfig.for_pair(pair).replace(min_confidence=0.05, lookup=True)
    prompts = prompts_for(11, 4) + [[7, 8, 9, 7, 8, 9, 7, 8, 9, 7, 8]]
    outs = drive(pair, prompts, config, 32)
    for i, p in enumerate(prompts):
        assert outs[i] == single(pair, p, config, 32) == reference(pair.target.model, p, 32)


def test_block_size_1_is_batched_plain_decoding(pairs):
    pair = pairs["llama"]
    prompts = prompts_for(3, 4)
    batch = Batch(pair, SpeculationConfig(block_size=1))
    assert batch.draft_cache is None and batch.serial is None
    outs = {i: [] for i in range(4)}
    for ev in batch_generate(pair, prompts, SpeculationConfig(block_size=1), max_tokens=24):
        assert ev.block_size == 1 and ev.drafted == []
        outs[ev.index] += ev.tokens
    for i, p in enumerate(prompts):
        assert outs[i] == reference(pair.target.model, p, 24)


@pytest.mark.parametrize("family", ["qwen3", "gemma3", "hybrid"])
def test_join_midway_and_cancel_keep_the_others_exact(pairs, family):
    """A long prompt joins after 2 rounds (every row shifts right), a sequence is cancelled
    after 4; the rest match mlx-lm and every cache is a fresh prefill after every round."""
    pair = pairs[family]
    prompts = prompts_for(21, 3)
    late = prompts_for(22, 1)[0] + list(range(60, 110))  # longer than any running row
    config = SpeculationConfig(block_size=5, lookup=False)
    victim = 2 if family == "hybrid" else 1  # the hybrid's sequence 1 stops at once
    outs = drive(pair, prompts, config, 30, p_wrong=[0.1, 0.4, 0.7, 0.2], join=(2, late),
                 cancel=(4, victim), check=check_caches(pair))
    for i, p in enumerate(prompts + [late]):
        ref = reference(pair.target.model, p, 30)
        if i == victim:
            assert 0 < len(outs[i]) < len(ref) and outs[i] == ref[: len(outs[i])]
        else:
            assert outs[i] == ref, f"sequence {i} differs"


def test_rows_grow_after_the_longest_left(pairs):
    """The longest row leaves, so every row left starts past column 0; the rows then grow past
    their buffer (the model's mask is built before a layer writes: nothing may move mid-pass)."""
    pair = pairs["qwen3"]
    short, long = prompts_for(61, 1)[0][:4], prompts_for(62, 1)[0] + list(range(40, 120))
    batch = Batch(pair, SpeculationConfig(block_size=1))
    batch.add(short, max_tokens=90)
    batch.add(long, max_tokens=90)
    out, check = [], check_caches(pair)
    for ev in batch.step():
        out += ev.tokens if ev.index == 0 else []
    assert batch.cancel(1)
    while batch.running:
        for ev in batch.step():
            out += ev.tokens
        check(batch)
    assert out == reference(pair.target.model, short, 90)


SCHEDULES = list(range(8))


@pytest.mark.parametrize("seed", slow_after(SCHEDULES, keep=2))
def test_random_joins_and_cancels(pairs, seed):
    """Sequences join and leave at random round boundaries; whoever runs to the end matches
    mlx-lm, whoever is cancelled has a prefix of it, and the caches stay fresh prefills."""
    pair = pairs[("qwen3", "gemma3", "llama", "hybrid")[seed % 4]]
    rng = random.Random(seed)
    config = SpeculationConfig(block_size=rng.choice([3, 5, 8]), lookup=False)
    prompts = prompts_for(100 + seed, 7)
    batch = Batch(pair, config)
    oracles, outs, cancelled = {}, {}, set()
    pair.draft.plan = Plan(batch, oracles)
    waiting = list(enumerate(prompts))
    check = check_caches(pair)
    while waiting or batch.running:
        for _ in range(rng.randint(0, 2) if batch.running else 1):
            if waiting:
                i, p = waiting.pop(0)
                oracles[i] = Oracle(reference(pair.target.model, p, 28), len(p),
                                    rng.choice([0.0, 0.3, 0.8]), seed * 100 + i)
                assert batch.add(p, max_tokens=28) == i
                outs[i] = []
        if len(batch.running) > 1 and rng.random() < 0.15:
            victim = rng.choice(batch.running)
            batch.cancel(victim)
            cancelled.add(victim)
        for ev in batch.step():
            outs[ev.index] += ev.tokens
        check(batch)
    pair.draft.plan = None
    for i, p in enumerate(prompts):
        ref = reference(pair.target.model, p, 28)
        assert outs[i] == (ref[: len(outs[i])] if i in cancelled else ref), f"sequence {i}"


def test_dflash2_and_draft_free_batches(dirs, tmp_path):
    """A DFlash 2 draft (its selector walks each row) and draft-free lookup speculation."""
    from dflash_mlx import load

    d2 = tiny.make_dflash2_draft(tmp_path / "d2")
    prompts = prompts_for(31, 3) + [[9, 8, 7, 9, 8, 7, 9, 8, 7, 9]]
    for pair, config in [
        (load(dirs["qwen3"], d2, draft_bits=16, weights="float32"),
         SpeculationConfig(block_size=5, lookup=False)),
        (load(dirs["qwen3"], None, weights="float32"),
         SpeculationConfig(block_size=4, draft_free=True)),
    ]:
        outs = {i: [] for i in range(len(prompts))}
        for ev in batch_generate(pair, prompts, config, max_tokens=24):
            outs[ev.index] += ev.tokens
        for i, p in enumerate(prompts):
            assert outs[i] == reference(pair.target.model, p, 24)
            assert outs[i] == single(pair, p, config, 24)


def test_uniform_rollback_breaks_it(pairs, monkeypatch):
    """The checks above can fail: rolling every row back to the longest row's length (one
    write index for the whole batch) leaves rejected rows in the shorter rows' caches."""
    pair = pairs["qwen3"]
    real = batch_round_module.set_lengths

    def uniform(caches, lengths):
        held = caches[0].lengths()
        drop = min(h - n for h, n in zip(held, lengths))  # the same for every row
        real(caches, [h - drop for h in held])

    monkeypatch.setattr(batch_round_module, "set_lengths", uniform)
    prompts = prompts_for(5, 4)
    with pytest.raises(AssertionError):
        outs = drive(pair, prompts, SpeculationConfig(block_size=5, lookup=False), 30,
                     p_wrong=[0.0, 0.6, 0.9, 0.3])
        assert all(outs[i] == reference(pair.target.model, p, 30) for i, p in enumerate(prompts))


def test_processors_apply_per_row(pairs):
    pair = pairs["llama"]
    prompts = prompts_for(8, 3)
    sampling = [SamplingParams(processing=Processing(repetition_penalty=1.5)),
                SamplingParams(processing=Processing(logit_bias={5: 3.0, 17: 2.0})),
                SamplingParams()]
    config = SpeculationConfig(block_size=4, lookup=False)
    outs = drive(pair, prompts, config, 24, p_wrong=[0.3], sampling=sampling)
    for i, p in enumerate(prompts):
        assert outs[i] == single(pair, p, config, 24, sampling[i])
    assert outs[2] == reference(pair.target.model, prompts[2], 24)


def test_sliding_window_targets_are_batched(pairs):
    assert serial_reason(pairs["gemma3"]) is None
    assert Batch(pairs["gemma3"]).serial is None


def test_hybrid_targets_are_batched(pairs):
    assert serial_reason(pairs["hybrid"]) is None
    assert Batch(pairs["hybrid"]).serial is None


def test_a_recurrent_row_goes_back_only_within_the_last_pass(pairs):
    """A GatedDeltaNet row can return to any step of the last pass (its inputs are kept) and
    then holds a fresh prefill's state; before that pass, or past what it holds, is refused,
    not guessed."""
    pair = pairs["hybrid"]
    pair.draft.plan = None
    prompts = prompts_for(71, 2)
    batch = Batch(pair, SpeculationConfig(block_size=5, lookup=False, adaptive=False))
    for p in prompts:
        batch.add(p, max_tokens=30)
    batch.step()
    batch.step()
    state = next(c for c in batch.target_cache if isinstance(c, RaggedStateCache))
    held = row_lengths(batch.target_cache)
    with pytest.raises(ValueError, match="holds tokens"):
        state.set_lengths([state.base[0] - 1, held[1]])
    with pytest.raises(ValueError, match="holds tokens"):
        state.set_lengths([held[0] + 1, held[1]])
    set_lengths(batch.target_cache, [state.base[0], held[1]])  # row 0: none of the last pass
    fresh = pair.target.make_cache()
    pair.target(mx.array([batch.tokens(batch.rows[0])[: state.base[0]]]), fresh, taps=False)
    for c, want in zip(batch.target_cache, fresh):
        if isinstance(c, RaggedStateCache):
            for got, ref in ((c[0][:1], want[0]), (c[1][:1], want[1])):
                assert float(mx.abs(got - ref).max()) <= 1e-4 * float(mx.abs(ref).max())


def test_trees_are_refused(pairs):
    pair = pairs["qwen3"]
    with pytest.raises(InvalidArgumentError, match="tree"):
        Batch(pair, SpeculationConfig(block_size=5, tree=8))
    with pytest.raises(InvalidArgumentError):
        list(batch_generate(pair, [[1, 2]], max_tokens=[4, 5]))


def test_events_carry_the_stream_generate_fields(pairs):
    pair = pairs["qwen3"]
    prompts = prompts_for(2, 2)
    events = list(batch_generate(pair, prompts, SpeculationConfig(block_size=4), max_tokens=9,
                                 logprobs=2))
    for i in range(2):
        mine = [e for e in events if e.index == i]
        assert [e.generation_tokens for e in mine] == list(np.cumsum([len(e.tokens)
                                                                      for e in mine]))
        assert mine[-1].finish_reason in ("stop", "length") and mine[-1].generation_tokens <= 9
        assert all(len(e.logprobs) == len(e.tokens) for e in mine)
        assert all(e.prompt_tokens == len(prompts[i]) - 1 for e in mine)


# -- sampling ------------------------------------------------------------------------------

PROMPTS_T = ([84, 104, 101, 32, 113, 117, 105, 99, 107, 32], [40, 50, 60, 70])
SETTINGS_T = [
    ((SamplingParams(1.0), "top"), (SamplingParams(0.7, 1.0, 20), "mid"), 800),
    ((SamplingParams(1.3, 0.8, 0), "mid"), (SamplingParams(1.0), "least"), 1500),
]


@pytest.fixture(scope="module")
def fixed_pair(dirs):
    return float32_pair(dirs["qwen3"], dirs["draft"], FixedRowsDraft)


def first_tokens(pair, settings, n: int, seed: int = 500):
    """First token of each sampled sequence over `n` seeded batches; every batch also holds a
    greedy sequence in the middle row."""
    rows = [target_rows(pair, p, s, 1)[0] for p, (s, _) in zip(PROMPTS_T, settings)]
    proposals = [pick(r, kind) for r, (_, kind) in zip(rows, settings)]
    pair.draft.fixed = Fixed([[proposals[0]] * 2, [0, 0], [proposals[1]] * 2])
    config = SpeculationConfig(block_size=2, lookup=False)
    # prefilled once: each batch copies them (a batched target leaves the sessions as they are)
    sessions = [Session.new(pair, config) for _ in range(3)]
    first = np.empty((2, n), np.int64)
    a, b = settings[0][0], settings[1][0]
    for k in range(n):
        batch = Batch(pair, config)
        batch.add(PROMPTS_T[0], max_tokens=2, session=sessions[0], sampling=SamplingParams(
            a.temperature, a.top_p, a.top_k, seed=seed + k))
        batch.add([3, 1, 4, 1, 5], max_tokens=2, session=sessions[1])
        batch.add(PROMPTS_T[1], max_tokens=2, session=sessions[2], sampling=SamplingParams(
            b.temperature, b.top_p, b.top_k, seed=10**6 + seed + k))
        events = batch.step()
        first[0, k], first[1, k] = events[0].tokens[0], events[2].tokens[0]
        assert events[0].drafted == [proposals[0]] and events[2].drafted == [proposals[1]]
        batch.close()
    pair.draft.fixed = None
    return first, rows


@pytest.mark.parametrize("case", slow_after(SETTINGS_T, keep=1))
def test_first_tokens_follow_the_target_in_a_batch(fixed_pair, case):
    *settings, n = case
    first, rows = first_tokens(fixed_pair, settings, n)
    for got, row in zip(first, rows):
        result = chi_square(got, row)
        assert result.ok, result


def test_a_sampler_without_the_residual_fails(fixed_pair, monkeypatch):
    def broken(drafted, probs, q, key):
        out = rejection_sample_device(drafted, probs, q, key)
        nxt = mx.random.categorical(mx.log(probs[out[0]]), key=mx.random.split(key)[1])
        return mx.stack([out[0], nxt.astype(mx.int32)])  # BUG: p, not max(p - q, 0)

    monkeypatch.setattr(batch_round_module, "rejection_sample_device", broken)
    first, rows = first_tokens(fixed_pair, SETTINGS_T[0][:2], 400)
    assert not chi_square(first[0], rows[0]).ok  # the top token proposed: drawn too often


def test_sliding_window_rows_hold_about_a_window(pairs):
    """Rows decoding far past the window (8) keep about a window of entries, not their whole
    history, and stay exact (their last entries are a fresh prefill's)."""
    pair = pairs["gemma3"]
    prompts = prompts_for(81, 3)
    config = SpeculationConfig(block_size=5, lookup=False, adaptive=False)
    check, widest, dropped = check_caches(pair), 0, 0

    def watch(batch):
        nonlocal widest, dropped
        check(batch)
        if batch.rows:
            widest = max(widest, batch.target_cache[0].keys.shape[2])
            dropped = max(dropped, *batch.target_cache[0].dropped)

    outs = drive(pair, prompts, config, 150, p_wrong=[0.0, 0.4, 0.8], check=watch)
    for i, p in enumerate(prompts):
        assert outs[i] == reference(pair.target.model, p, 150)
    history = max(len(p) + len(outs[i]) for i, p in enumerate(prompts))
    assert dropped > 0 and widest < history  # a whole history would not fit


def test_aligned_rows_take_a_single_sequences_mask():
    """Rows that start together and end together take a single sequence's mask: none for one
    token, the causal fast path for several (the same attention as the per-row mask); any
    padding, raggedness or a reachable window brings the per-row mask back."""
    from dflash_mlx.speculate.batch_cache import RaggedKVCache
    from dflash_mlx.speculate.batch_window import RaggedWindowCache
    from mlx_lm.models.cache import KVCache

    def filled(cache, lengths):
        rows = []
        for n in lengths:
            c = KVCache()
            c.update_and_fetch(mx.zeros((1, 1, n, 4)), mx.zeros((1, 1, n, 4)))
            rows.append(c)
        cache.add(*rows)
        return cache

    same = filled(RaggedKVCache(), [6, 6])
    assert same.make_mask(1) is None and same.make_mask(3) == "causal"
    assert same.make_mask(1, return_array=True).shape == (2, 1, 1, 7)
    q, k, v = (mx.random.normal((2, 2, n, 8), key=mx.random.key(i))
               for i, n in enumerate((3, 9, 9)))
    rows = same.make_mask(3, return_array=True)
    attend = lambda m: mx.fast.scaled_dot_product_attention(q, k, v, scale=0.3, mask=m)  # noqa
    assert mx.allclose(attend("causal"), attend(rows), atol=1e-6)
    ragged = filled(RaggedKVCache(), [6, 4])
    assert ragged.make_mask(1).shape == (2, 1, 1, 7)
    same.set_lengths([6, 5])  # one row rolled back
    assert not isinstance(same.make_mask(1), (str, type(None)))
    window = filled(RaggedWindowCache(8), [7])
    assert window.make_mask(1) is None  # the 8th token sees all 8
    window = filled(RaggedWindowCache(8), [8])
    mask = window.make_mask(1)  # the 9th does not see the 1st
    assert mask.shape == (1, 1, 1, 9) and not mask[0, 0, 0, 0].item() and mask[0, 0, 0, 1].item()
