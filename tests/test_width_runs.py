"""The width controller inside real runs: whatever it chooses, output is exact, and runs
feed it what they should.

With the choice made by a coin per sequence, greedy output equals mlx-lm's plain decoding on
every target family, alone and in a batch with joins and cancellations, and every batched
row's cache equals a fresh prefill. Seeded sampling keeps fixed widths. A first round is not
timed as a typical cost; a batch starts from its pair's last batch; a round speculates for the
sequence whose draft hits and decodes the others plainly in it; one sequence decoding plainly
probes on the lookup's cue.
"""

from __future__ import annotations

import random
import weakref

import pytest

from dflash_mlx import Session, stream_generate, tiny
from dflash_mlx import batch as batch_module
from dflash_mlx import generate as generate_module
from dflash_mlx.batch import Batch, batch_generate
from dflash_mlx.speculate import SamplingParams, SpeculationConfig
from dflash_mlx.speculate import width as width_module
from dflash_mlx.speculate.width import PassCosts, WidthControl
from support.engine import (GATED, Oracle, OracleDraft, float32_pair, make_draft4,
                            mlx_lm_greedy)
from support.batch_run import check_caches
from support.rows_oracle import Plan, RowsOracleDraft


def test_seeded_sampling_keeps_fixed_widths(pairs):
    """The device defaults adapt; a seeded sampling call does not (its draws depend on the
    widths), nor does a config that asks for fixed widths."""
    config = SpeculationConfig.for_pair(pairs["qwen3"][0])
    assert config.adaptive and not SpeculationConfig().adaptive
    assert generate_module.adaptive_control(config, SamplingParams()) is not None
    assert generate_module.adaptive_control(config, SamplingParams(0.7)) is not None
    assert generate_module.adaptive_control(config, SamplingParams(0.7, seed=3)) is None
    assert generate_module.adaptive_control(config.replace(block_size=1), SamplingParams()) is None
    assert generate_module.adaptive_control(SpeculationConfig(), SamplingParams()) is None


# ------------------------------------------------------------------ exactness under any choice


class Coin(WidthControl):
    """Speculates or not at random, per sequence: exactness must hold whatever the
    controller decides (in a batch: every row, some rows, none)."""

    rng = random.Random(0)

    def choose(self, keys, fixed=False):
        return [fixed or self.rng.random() < 0.5 for _ in keys]


@pytest.fixture(scope="module")
def pairs(tmp_path_factory):
    root = tmp_path_factory.mktemp("width")
    draft = tiny.make_draft(root / "draft", tiny.draft_config(block_size=8))
    draft4 = make_draft4(root / "draft4")
    targets = {
        "qwen3": tiny.make_target(root / "qwen3"),
        "llama": tiny.make_target(root / "llama", model_type="llama", seed=5),
        "gemma3": tiny.make_target(root / "gemma3", **GATED),
        "hybrid": tiny.make_hybrid_target(root / "hybrid"),
    }
    return {k: (float32_pair(v, draft4 if k == "gemma3" else draft, OracleDraft),
                float32_pair(v, draft4 if k == "gemma3" else draft, RowsOracleDraft))
            for k, v in targets.items()}


def reference(model, prompt, n):
    ref = mlx_lm_greedy(model, prompt, n)
    return ref[: ref.index(tiny.EOS_ID) + 1] if tiny.EOS_ID in ref else ref


@pytest.mark.parametrize("family", ["qwen3", "llama", "gemma3", "hybrid"])
def test_any_choice_of_width_decodes_greedy_exactly(pairs, family, monkeypatch):
    """An oracle draft wrong 30% of the time, so speculative rounds accept ragged counts."""
    monkeypatch.setattr(generate_module, "WidthControl", Coin)
    pair = pairs[family][0]
    config = SpeculationConfig(block_size=6, adaptive=True)
    for seed in range(6):
        Coin.rng = random.Random(seed)
        rng = random.Random(100 + seed)
        prompt = [rng.randrange(256) for _ in range(rng.randint(2, 30))]
        ref = reference(pair.target.model, prompt, 32)
        pair.draft.oracle = Oracle(ref, len(prompt), 0.3, seed)
        session = Session.new(pair, config)
        events = list(stream_generate(pair, prompt, config, max_tokens=32, session=session))
        assert {e.block_size == 1 for e in events[:-1]} == {True, False}  # both kinds ran
        assert any(e.accepted > 0 for e in events)
        assert [t for e in events for t in e.tokens] == ref
        assert pair.target.cache_length(session.target_cache) == len(session.tokens) - 1


@pytest.mark.parametrize("family", ["qwen3", "llama", "gemma3", "hybrid"])
def test_any_choice_in_a_batch_with_joins_and_cancels(pairs, family, monkeypatch):
    monkeypatch.setattr(batch_module, "WidthControl", Coin)
    pair = pairs[family][1]
    config = SpeculationConfig(block_size=5, adaptive=True)
    for seed in range(3):
        Coin.rng = random.Random(seed)
        rng = random.Random(200 + seed)
        prompts = [[rng.randrange(256) for _ in range(rng.randint(2, 30))] for _ in range(4)]
        batch, check = Batch(pair, config), check_caches(pair)
        oracles = {i: Oracle(reference(pair.target.model, p, 28), len(p), 0.1 + 0.2 * i, seed)
                   for i, p in enumerate(prompts)}
        pair.draft.plan = Plan(batch, oracles)
        for p in prompts[:3]:
            batch.add(p, max_tokens=28)
        outs, kinds, step, mixed = {i: [] for i in range(4)}, set(), 0, False
        while batch.running:
            events = batch.step()
            for ev in events:
                outs[ev.index] += ev.tokens
                kinds.add(ev.block_size > 1)
            mixed |= len({ev.block_size > 1 for ev in events}) > 1
            step += 1
            if step == 2:
                batch.add(prompts[3], max_tokens=28)
            if step == 4 and 1 in batch.running:
                batch.cancel(1)
                outs.pop(1)
            check(batch)  # each batched row's cache is a fresh prefill
        pair.draft.plan = None
        assert kinds == {True, False} and mixed  # some rounds held both kinds of rows
        for i, out in outs.items():
            assert out == reference(pair.target.model, prompts[i], 28), f"sequence {i}"




class Recording(WidthControl):
    """The real controller, keeping what each round recorded."""

    log: list = []

    def record(self, keys, speculated, seconds, committed=(), width=1):
        Recording.log.append((tuple(keys), kind(speculated), seconds))
        super().record(keys, speculated, seconds, committed, width)


def faked(seconds: dict) -> type:
    """A recording controller whose timed rounds take `seconds[kind]` (a plain round 1.0)."""

    class Faked(Recording):
        def record(self, keys, speculated, secs, committed=(), width=1):
            secs = secs and {False: 1.0, **seconds}[kind(speculated)]
            super().record(keys, speculated, secs, committed, width)

    return Faked


def kind(speculated) -> bool | str:
    """A round's kind: True (all speculated), False (none) or "mixed"."""
    flags = {speculated} if isinstance(speculated, bool) else set(speculated)
    return flags.pop() if len(flags) == 1 else "mixed"


def test_a_first_round_is_not_a_typical_cost_in_a_batch_as_alone(pairs, monkeypatch):
    """A round holding a sequence's first (new shapes, a joiner's context) times nothing, as
    `stream_generate`'s first round does not: else one slow first round makes speculation look
    dear and the batch decodes plainly where one stream would not."""
    monkeypatch.setattr(batch_module, "WidthControl", Recording)
    monkeypatch.setattr(generate_module, "WidthControl", Recording)
    monkeypatch.setattr(width_module, "_PAST", weakref.WeakKeyDictionary())  # start cold
    pair = pairs["qwen3"][0]
    config = SpeculationConfig(block_size=5, adaptive=True, pass_costs=None)
    prompt = list(range(3, 20))
    pair.draft.oracle = Oracle(reference(pair.target.model, prompt, 12), len(prompt), 0.3, 0)
    for run in (lambda: stream_generate(pair, prompt, config, max_tokens=12),
                lambda: batch_generate(pair, [prompt], config, max_tokens=12)):
        Recording.log = []
        list(run())
        assert Recording.log[0][1:] == (True, None)  # speculated, not timed
        # (a plain round read ahead may be untimed: the run's first and last reads)
        assert all(secs is not None for _, wide, secs in Recording.log[1:] if wide)
        assert any(secs is not None for _, wide, secs in Recording.log[1:] if not wide)
    pair.draft.oracle = None
    # a sequence joining a running batch: its first round is not timed either
    Recording.log = []
    batch = Batch(pair, config)
    batch.add(prompt, max_tokens=12)
    batch.step()
    batch.step()
    batch.add(prompt[:9], max_tokens=12)
    batch.step()
    batch.close()
    assert [secs is None for _, _, secs in Recording.log] == [True, False, True]


def test_a_batch_starts_from_the_last_batch_of_its_pair(pairs, monkeypatch):
    """`batch_generate` starts from the round costs the pair's last batch at that block size
    measured: where speculation did not pay, the next call measures its acceptance in its
    first round and decodes plainly from its second, where a cold batch still times a
    speculative round; another block size starts cold. Output is the same either way."""

    # a speculative round of two sequences costs 12 plain ones
    monkeypatch.setattr(batch_module, "WidthControl", faked({True: 12.0, "mixed": 6.5}))
    monkeypatch.setattr(width_module, "_PAST", weakref.WeakKeyDictionary())
    pair = pairs["qwen3"][0]
    prompts = [list(range(3, 20)), list(range(5, 14))]
    outputs, seconds = [], []
    for block in (5, 5, 4):
        config = SpeculationConfig(block_size=block, adaptive=True, pass_costs=None)
        Recording.log = []
        out = [[], []]
        for ev in batch_generate(pair, prompts, config, max_tokens=10):
            out[ev.index] += ev.tokens
        outputs.append(out)
        seconds.append([kind for _, kind, _ in Recording.log[:2]])
    # measured, remembered, a new block size measures
    assert seconds == [[True, True], [True, False], [True, True]]
    assert outputs[0] == outputs[1] == outputs[2]


def test_a_batch_speculates_for_the_sequence_its_draft_hits(pairs, monkeypatch):
    """Two sequences, an oracle draft always right for one and always wrong for the other;
    seconds faked as a packed pass costs (all speculate 1.5, one 1.2, none 1.0): the batch
    settles on rounds where the first speculates and the second decodes plainly, and each
    output is still its own greedy decoding."""

    monkeypatch.setattr(batch_module, "WidthControl", faked({True: 1.5, "mixed": 1.2}))
    monkeypatch.setattr(width_module, "_PAST", weakref.WeakKeyDictionary())
    pair = pairs["qwen3"][1]
    config = SpeculationConfig(block_size=5, adaptive=True, pass_costs=None)
    prompts = [list(range(3, 20)), list(range(5, 14))]
    refs = [reference(pair.target.model, p, 40) for p in prompts]
    batch = Batch(pair, config)
    pair.draft.plan = Plan(batch, {i: Oracle(r, len(p), float(i), i)
                                   for i, (p, r) in enumerate(zip(prompts, refs))})
    Recording.log = []
    try:
        for p in prompts:
            batch.add(p, max_tokens=40)
        outs, rounds = [[], []], []
        while batch.running:
            events = batch.step()
            for ev in events:
                outs[ev.index] += ev.tokens
            rounds.append({ev.index: ev.block_size > 1 for ev in events})
    finally:
        pair.draft.plan = None
        batch.close()
    assert outs == refs
    assert sum(r == {0: True, 1: False} for r in rounds) >= 3
    assert [k for _, k, _ in Recording.log].count("mixed") >= 3


def test_a_cue_turns_one_sequences_plain_round_into_a_probe(pairs, monkeypatch):
    """While one sequence decodes plainly the loop reads the lookup's cue before each round,
    and a cue makes that round speculative: with a cue every time, no two plain rounds follow
    each other; with none, they do. A draft that always misses; output is greedy either way.
    (The floor aside: it would hold back probes this draft's misses have not paid for.)"""
    monkeypatch.setattr(width_module, "FLOOR_ALLOWANCE", float("inf"))
    pair = pairs["qwen3"][0]
    costs = PassCosts(((1, 1.0), (5, 1.2)), draft=0.2, block=5)  # a draft that misses: plain
    config = SpeculationConfig(block_size=5, adaptive=True, pass_costs=costs, lookup=True)
    prompt = list(range(3, 20))
    ref = reference(pair.target.model, prompt, 24)
    try:
        for cued in (False, True):
            pair.draft.oracle = Oracle(ref, len(prompt), 1.0, 0)
            monkeypatch.setattr(generate_module, "Cue", lambda: (lambda tokens: cued))
            events = list(stream_generate(pair, prompt, config, max_tokens=24))
            assert [t for e in events for t in e.tokens] == ref
            wide = [e.block_size > 1 for e in events[:-1]]
            twice_plain = any(not a and not b for a, b in zip(wide, wide[1:]))
            assert twice_plain is not cued and wide.count(False) > 3
    finally:
        pair.draft.oracle = None
