"""Plain batched rounds launched one ahead (`speculate/batch_plain.py`) are exact.

While every row decodes plainly the batch builds round t+1 from round t's answers on the
device before reading them. Under random joins (fresh prompts and sessions), cancellations,
switches between speculative and plain rounds and stops at different lengths, every sequence's
greedy output equals mlx-lm's, every cache row is a fresh prefill after every step, and a
sequence that leaves while a round is in flight ends in its session as if none had been
launched. Seeded sampling draws exactly what the same batch draws without launching ahead, and
a row whose logits turn to NaN ends alone.
"""

from __future__ import annotations

import random

import mlx.core as mx
import pytest

from dflash_mlx import Session, stream_generate
from dflash_mlx import batch as batch_module
from dflash_mlx.batch import Batch, batch_generate
from dflash_mlx.speculate import SamplingParams, SpeculationConfig
from dflash_mlx.speculate.guards import NonFiniteLogitsError
from support.batch_run import check_caches, dirs, pairs, prompts_for, reference  # noqa: F401
from support.tiers import slow_after


class Scripted:
    """A width controller that speculates when the script says so."""

    def __init__(self, script: list[bool]):
        self.script, self.n = script, 0
        self.rows = None  # never a narrow probe

    def choose(self, keys, fixed=False) -> list[bool]:
        self.n += 1
        return [self.script[(self.n - 1) % len(self.script)]] * len(keys)

    def record(self, *args, **kwargs):
        pass

    def forget(self, key):
        pass


@pytest.fixture
def launches(monkeypatch):
    """How many plain rounds were launched ahead."""
    count = [0]
    real = batch_module.launch

    def counted(*args, **kwargs):
        count[0] += 1
        return real(*args, **kwargs)

    monkeypatch.setattr(batch_module, "launch", counted)
    return count


def _check_session(pair, s: Session):
    cached = s.tokens[:-1]
    cache = pair.target.make_cache()
    pair.target(mx.array([cached]), cache, taps=False)
    for got, want in zip(s.target_cache, cache):
        assert got.offset == len(cached)
        k = want.keys[..., : len(cached), :]
        err = float(mx.abs(got.keys[..., : got.offset, :] - k).max())
        assert err / (float(mx.abs(k).max()) + 1e-6) < 1e-4


@pytest.mark.parametrize("seed", slow_after(list(range(8)), keep=2))
def test_random_schedules_stay_exact(pairs, launches, seed):
    rng = random.Random(seed)
    pair = pairs["llama" if seed % 2 else "qwen3"]
    pair.draft.plan = None
    block = rng.choice([1, 5])
    config = SpeculationConfig(block_size=block, lookup=False)
    batch = Batch(pair, config)
    if block > 1:  # mostly plain, now and then a speculative round
        batch.control = Scripted([rng.random() < 0.25 for _ in range(11)])
    check = check_caches(pair)
    prompts = prompts_for(300 + seed, 8)
    limits = [rng.randint(3, 30) for _ in prompts]
    sessions, outs, cancelled = {}, {}, set()
    waiting = list(enumerate(prompts))
    while waiting or batch.running:
        for _ in range(rng.randint(0, 2) if batch.running else 1):
            if waiting:
                i, p = waiting.pop(0)
                session = None
                if rng.random() < 0.4:  # a conversation: its prompt's head is cached already
                    session = sessions[i] = Session.new(pair, config)
                    list(stream_generate(pair, p[:2], config, session=session,
                                                      max_tokens=1))
                    p = prompts[i] = session.tokens + p[2:]
                assert batch.add(p, max_tokens=limits[i], session=session) == i
                outs[i] = []
        if len(batch.running) > 1 and rng.random() < 0.15:
            victim = rng.choice(batch.running)
            assert batch.cancel(victim)
            cancelled.add(victim)
        for ev in batch.step():
            outs[ev.index] += ev.tokens
        check(batch)
    assert launches[0] >= 5
    for i, p in enumerate(prompts):
        ref = reference(pair.target.model, p, limits[i])
        assert outs[i] == (ref[: len(outs[i])] if i in cancelled else ref), f"sequence {i}"
        if i in sessions:  # it left its row in its session, nothing launched after it
            assert sessions[i].tokens == p + outs[i]
            _check_session(pair, sessions[i])


def test_seeded_sampling_draws_what_a_plain_round_draws(pairs, launches, monkeypatch):
    pair = pairs["qwen3"]
    pair.draft.plan = None
    prompts = prompts_for(41, 5)
    sampling = [SamplingParams(temperature=0.9, seed=s, top_k=40) for s in range(4)]
    sampling.append(SamplingParams())  # a greedy row among them

    def run():
        outs = {i: [] for i in range(len(prompts))}
        for ev in batch_generate(pair, prompts, SpeculationConfig(block_size=1), sampling,
                                 max_tokens=[20, 9, 20, 14, 20], logprobs=3):
            outs[ev.index].append((ev.tokens, ev.logprobs, ev.top_logprobs))
        return outs

    ahead = run()
    assert launches[0] > 10
    monkeypatch.setattr(batch_module, "can_go_ahead", lambda rows: False)
    launches[0] = 0
    plain = run()
    assert launches[0] == 0
    for i in ahead:  # the same draws; log-probabilities to float rounding (a launched round
        # may still hold a row that left, and a pass of 5 rows rounds unlike one of 4)
        assert [e[0] for e in ahead[i]] == [e[0] for e in plain[i]], f"sequence {i}"
        for (_, lp, top), (_, lp2, top2) in zip(ahead[i], plain[i]):
            assert lp == pytest.approx(lp2, abs=1e-4)
            assert [[t for t, _ in r] for r in top] == [[t for t, _ in r] for r in top2]
    assert [t for e in ahead[4] for t in e[0]] == reference(pair.target.model, prompts[4], 20)


class NaNAfter:
    """The target, whose logits for one row turn to NaN in its call number `after` + 1."""

    def __init__(self, target, row: int, after: int):
        self.target, self.row, self.after, self.calls = target, row, after, 0

    def __getattr__(self, name):
        return getattr(self.target, name)

    def __call__(self, ids, cache, **kwargs):
        logits, taps = self.target(ids, cache, **kwargs)
        self.calls += 1
        if self.calls == self.after + 1 and ids.shape[0] > self.row:
            bad = (mx.arange(ids.shape[0]) == self.row)[:, None, None]
            logits = mx.where(bad, mx.array(float("nan")), logits)
        return logits, taps


def test_a_row_with_nan_logits_ends_alone(pairs, launches):
    import dataclasses

    base = pairs["llama"]
    pair = dataclasses.replace(base, target=NaNAfter(base.target, row=1, after=6))
    prompts = prompts_for(51, 3)
    outs, ends = {i: [] for i in range(3)}, {}
    for ev in batch_generate(pair, prompts, SpeculationConfig(block_size=1), max_tokens=16):
        outs[ev.index] += ev.tokens
        if ev.finish_reason:
            ends[ev.index] = ev
    assert launches[0] > 5
    assert ends[1].finish_reason == "error" and isinstance(ends[1].error, NonFiniteLogitsError)
    for i, p in enumerate(prompts):
        ref = reference(base.target.model, p, 16)
        assert outs[i] == (ref[: len(outs[i])] if i == 1 else ref)
    assert 0 < len(outs[1]) < 16

