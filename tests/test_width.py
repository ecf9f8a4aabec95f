"""The load-adaptive width (`speculate/width.py`): what it chooses.

The controller's rule is checked with scripted round costs and acceptance: it measures
speculation, then plain decoding, then keeps the faster; a draft that stops paying moves it to
plain decoding with probes that grow rarer, and a probe that finds acceptance back returns it
to speculation; costs are kept per batch size, so one load can speculate while a heavier one
decodes plainly; a round speculates for the sequences whose draft pays and decodes the others
plainly in it where that commits more per second (timed per (batch size, speculating
sequences)), and those left out are probed. That no choice changes output, and what real runs
feed the controller: `test_width_runs.py`.
"""

from __future__ import annotations

import pytest

from dflash_mlx.speculate import width
from dflash_mlx.speculate.width import (FLOOR_ALLOWANCE, FLOOR_SHARE, NARROW, PROBE_FIRST,
                                        PROBE_MAX, PROBE_SHARE, PassCosts, WidthControl)


def run_rounds(control, keys, rounds, spec_s, plain_s, tau):
    """Drive `control` for `rounds` rounds with fixed costs; `tau(i)`: tokens a speculative
    round commits per sequence at round i. Returns the choices."""
    choices = []
    for i in range(rounds):
        wide = control.speculate(keys)
        control.record(keys, wide, spec_s if wide else plain_s,
                       [tau(i)] * len(keys) if wide else [1] * len(keys))
        choices.append(wide)
    return choices


def test_measures_both_kinds_then_keeps_the_faster():
    c = WidthControl()
    # speculation commits 2 tokens a round at 1.4 plain steps: it pays (1.43x)
    choices = run_rounds(c, [0], 40, spec_s=1.4, plain_s=1.0, tau=lambda i: 2)
    assert choices[:2] == [True, False]  # one of each kind first
    assert all(choices[2:])
    # 1.3 tokens at 1.4 steps does not (0.93x): plain, with probes every 4, 8, 16 ... rounds
    c = WidthControl()
    choices = run_rounds(c, [0], 300, spec_s=1.4, plain_s=1.0, tau=lambda i: 1.3)
    wide = [i for i, w in enumerate(choices) if w]  # the first round, then the probes
    gaps = [b - a - 1 for a, b in zip(wide, wide[1:])]
    assert gaps[:4] == [PROBE_FIRST, 2 * PROBE_FIRST, 4 * PROBE_FIRST, 8 * PROBE_FIRST]
    assert max(gaps) == PROBE_MAX and c.probes == len(wide) - 1
    assert sum(choices) / len(choices) < 0.1  # nearly all of it plain


def test_probes_of_a_wide_batch_cost_a_bounded_share():
    """8 sequences the draft misses: a probe costs 3 plain rounds and commits what one does,
    so it loses 2; probes come rarely enough that they cost at most PROBE_SHARE / 8 of the
    time (the wider the batch, the less a probe is likely to find speculation paying; a single
    sequence, losing 0.1 a probe, probes every 4, 8, ... rounds as above)."""
    c = WidthControl()
    keys = list(range(8))
    choices = run_rounds(c, keys, 3000, spec_s=3.0, plain_s=1.0, tau=lambda i: 1)
    wide = [i for i, w in enumerate(choices) if w]
    gaps = [b - a - 1 for a, b in zip(wide, wide[1:])]
    assert len(gaps) >= 5 and min(gaps) >= 2 * 8 / PROBE_SHARE
    assert max(gaps) < 2 * 8 / PROBE_SHARE + 2  # and no rarer: acceptance may come back
    plain = len(choices) - len(wide)
    assert c.probes * 2.0 <= PROBE_SHARE / 8 * plain * 1.05
    two = WidthControl()  # two sequences: probes four times as often
    choices = run_rounds(two, keys[:2], 3000, spec_s=3.0, plain_s=1.0, tau=lambda i: 1)
    assert two.probes >= 3.5 * c.probes


def test_a_probe_is_charged_what_it_cost():
    """A probe's draft also catches up on the plain rounds before it, so it costs more than a
    steady speculative round (here 6 plain rounds, not 3): the next probe waits until the
    probes' share of the time is PROBE_SHARE / 8 at that cost."""
    c = WidthControl()
    keys = list(range(8))
    choices, wide = [], True
    for _ in range(5000):
        after_plain = not wide
        wide = c.speculate(keys)
        c.record(keys, wide, (6.0 if after_plain else 3.0) if wide else 1.0, [1] * 8)
        choices.append(wide)
    probes = [i for i, w in enumerate(choices) if w][2:]
    gaps = [b - a - 1 for a, b in zip(probes, probes[1:])]
    assert len(gaps) >= 3 and min(gaps) >= 5 * 8 / PROBE_SHARE  # each loses 6 - 1 plain rounds


def test_a_controller_starts_from_its_prior():
    """A new batch of the same pair starts from the last one's round costs, not its
    acceptance (that belongs to the prompts): it measures its own in its first round, then
    decides at once where a cold one would still time both kinds of rounds; it keeps none of
    the last batch's sequences."""
    keys = list(range(4))

    def first_rounds(control, tau, rounds):
        assert control.speculate(keys) is True  # acceptance unknown: measured first
        control.record(keys, True, None, [tau] * 4, 5)  # a first round times nothing
        return [control.speculate(keys) for _ in range(rounds)]

    poor = WidthControl()
    run_rounds(poor, keys, 10, spec_s=3.0, plain_s=1.0, tau=lambda i: 1.2)
    warm = WidthControl(prior=poor)
    assert not warm._tau_all.n and not warm._tau
    assert first_rounds(warm, 1.2, PROBE_FIRST) == [False] * PROBE_FIRST
    assert first_rounds(WidthControl(), 1.2, 1) == [True]  # cold: speculation timed next
    good = WidthControl()
    run_rounds(good, keys, 10, spec_s=1.5, plain_s=1.0, tau=lambda i: 3)
    assert first_rounds(WidthControl(prior=good), 3, 3) == [True] * 3
    # the same costs with this batch's prompts missing: plain from its second round
    assert first_rounds(WidthControl(prior=good), 1.0, 2) == [False] * 2
    run_rounds(WidthControl(prior=good), keys, 5, spec_s=1.0, plain_s=1.0, tau=lambda i: 1)
    assert good._tau_all.value == pytest.approx(3.0)  # the prior is copied, not shared
    assert good._spec[4].value == pytest.approx(1.5)


def test_returns_to_speculation_when_acceptance_comes_back():
    c = WidthControl()
    # a stretch the draft misses (τ 1), then one it predicts (τ 4)
    choices = run_rounds(c, [0], 200, spec_s=1.4, plain_s=1.0,
                         tau=lambda i: 1 if i < 100 else 4)
    assert sum(choices[20:100]) < 20
    back = choices.index(True, 100)
    assert back <= 100 + PROBE_MAX + 1 and all(choices[back + 2:])


def test_costs_are_kept_per_batch_size():
    """At 1 sequence a speculative round is cheap, at 8 it costs 3 plain rounds: the same
    acceptance speculates alone and decodes plainly under load."""
    c = WidthControl()
    one, eight = list(range(1)), list(range(8))
    for _ in range(10):
        for keys, spec_s in ((one, 1.3), (eight, 3.0)):
            wide = c.speculate(keys)
            c.record(keys, wide, spec_s if wide else 1.0, [2] * len(keys))
    assert c.speculate(one) is True
    assert c.speculate(eight) is False


def test_a_shrinking_batch_borrows_the_larger_size_cost_ratio():
    """Eight rows decode plainly (a speculative round costs 3 plain ones, τ 2); as rows finish
    one by one, each smaller batch keeps decoding plainly on the ratio the 8-row batch
    measured, instead of spending a speculative round to time each new size. A smaller
    batch's ratio is never borrowed for a larger one: 8 rows measured alone decide alone."""
    c = WidthControl()
    keys = list(range(8))
    choices = run_rounds(c, keys, 6, spec_s=3.0, plain_s=1.0, tau=lambda i: 2)
    assert choices[:2] == [True, False] and not any(choices[2:])
    for n in range(7, 0, -1):
        for key in keys[n:]:
            c.forget(key)
        assert c.speculate(keys[:n]) is False  # (a probe is not due within these rounds)
        c.record(keys[:n], False, 1.0)
    assert c.probes == 0
    small = WidthControl()
    run_rounds(small, [0], 4, spec_s=1.2, plain_s=1.0, tau=lambda i: 2)
    assert small.speculate(keys) is True  # nothing timed at 8 rows yet: measure it


def test_a_shrunk_batch_weighs_its_timed_mixed_rounds_in_seconds():
    """Seven rows left of eight, nothing timed at seven but a round where one speculates
    (0.14 s, 1.4 of the eight's plain rounds): that round is weighed against the eight's
    seconds, not against the borrowed ratio's units (a plain round of "1.0" made a 0.14 s
    round look seven times cheaper, so one sequence speculated round after round at a
    loss)."""
    c = WidthControl()
    keys = list(range(8))
    c.record(keys, True, 0.25, [3] + [1] * 7, 5)
    c.record(keys, False, 0.1)
    c.forget(7)
    c.record(keys[:7], [True] + [False] * 6, 0.14, [3] + [1] * 6, 5)
    # 9 tokens in 0.14 s against 7 in at most 0.1 s
    assert c.choose(keys[:7]) == [False] * 7


def test_an_untimed_round_of_some_rows_is_guessed_from_those_timed():
    """A round where one of eight speculates, timed at 1.6 plain rounds against 2.65 for all
    eight, shows what such a round costs whatever its k (0.27 of the way); a round where two
    speculate, not timed yet, is guessed with that share on top of 2 / 8 of the way (1.75,
    not 1.41), so two sequences at τ 3 are not tried there at a loss."""
    c = WidthControl()
    keys = list(range(8))
    c.record(keys, True, 2.65, [3, 3] + [1] * 6, 5)
    c.record(keys, False, 1.0)
    c.record(keys, [True] + [False] * 7, 1.6, [3] + [1] * 7, 5)
    assert c._mixed_s(8, 2, 2.65, 1.0) == pytest.approx(1.75, abs=0.01)
    assert c.choose(keys) == [False] * 8


def test_one_sequence_stays_on_a_near_tie_and_a_batch_leaves():
    """A draft that paid (τ 2 at 1.5 plain rounds) falls to τ 1.44, 4% behind plain decoding:
    one sequence keeps speculating (within MARGIN: noise), a batch of two decodes plainly."""
    def tau(i):
        return 2 if i < 10 else 1.44

    alone = WidthControl()
    choices = run_rounds(alone, [0], 120, spec_s=1.5, plain_s=1.0, tau=tau)
    assert choices[:2] == [True, False] and all(choices[2:])
    both = WidthControl()
    choices = run_rounds(both, [0, 1], 120, spec_s=1.5, plain_s=1.0, tau=tau)
    assert all(choices[2:10]) and both.plain_rounds >= 60


def drive(control, keys, rounds, seconds, tau):
    """Drive `control` with rounds choosing per sequence; `seconds[k]`: a round where k
    sequences speculate; `tau(i, key)`: what a speculating sequence commits at round i."""
    choices = []
    for i in range(rounds):
        which = control.choose(keys)
        control.record(keys, which, seconds[sum(which)],
                       [tau(i, k) if w else 1 for k, w in zip(keys, which)], 5)
        choices.append(tuple(which))
    return choices


def test_sequences_keep_their_own_acceptance():
    """τ is per sequence, and a round speculates for the sequences whose gain covers their
    rows: with "a" at τ 4 and "b" at 1, a round where only "a" speculates (1.2 plain rounds:
    "b"'s row runs alone in the feed-forward blocks) commits 5 tokens, beating both
    speculating (5 in 1.5) and plain decoding (2 in 1), in any key order. A new sequence
    borrows the others' mean."""
    c = WidthControl()
    keys = ["a", "b"]
    seconds = {0: 1.0, 1: 1.2, 2: 1.5}
    choices = drive(c, keys, 8, seconds, lambda i, k: 4 if k == "a" else 1)
    choices += drive(c, keys[::-1], 2, seconds, lambda i, k: 4 if k == "a" else 1)
    assert choices[:2] == [(True, True), (False, False)]  # each kind measured first
    assert choices[2:] == [(True, False)] * 6 + [(False, True)] * 2
    assert c.mixed_rounds == 8 and c._mixed[(2, 1)].value == 1.2  # timed like the others
    c.forget("a")
    for _ in range(10):  # alone with "c", which has no τ yet: it borrows b's (1)
        which = c.choose(["b", "c"])
        c.record(["b", "c"], which, 1.0 if not any(which) else 1.5, [1, 1], 5)
    assert c.plain_rounds >= 5


def test_a_round_of_some_rows_that_costs_as_much_as_all_is_left():
    """Not timed yet, a round of k speculating sequences out of n is guessed at k / n of the
    way from a plain round to a speculative one; timed as dear as one of all (a target whose
    layers could not skip the padding), every sequence speculates again."""
    c = WidthControl()
    choices = drive(c, ["a", "b"], 8, {0: 1.0, 1: 1.5, 2: 1.5},
                    lambda i, k: 4 if k == "a" else 1)
    assert choices[2:4] == [(True, False)] * 2  # tried (its first round catches up: untimed)
    assert choices[4:] == [(True, True)] * 4  # 5 / 1.5 either way: all speculate


def test_a_sequence_left_out_is_probed_and_joins_when_its_draft_hits():
    """A sequence that decodes plainly beside speculating ones is probed like a batch that
    decodes plainly (every sequence speculates in a probe), at most PROBE_SHARE / n of the
    time; once its draft hits, it speculates again."""
    c = WidthControl()

    def tau(i, k):
        return 4 if k == "a" or i >= 150 else 1

    choices = drive(c, ["a", "b"], 400, {0: 1.0, 1: 1.2, 2: 1.5}, tau)
    probes = [i for i, w in enumerate(choices[:150]) if w == (True, True)][1:]
    gaps = [b - a - 1 for a, b in zip(probes, probes[1:])]
    # a probe loses 1.5 - 5 * 1.2 / 5 = 0.3 plain rounds: one per 0.3 * 2 / share rounds
    assert len(gaps) >= 2 and min(gaps) >= 0.3 * 2 / PROBE_SHARE
    assert all(w == (True, False) for i, w in enumerate(choices[:150]) if i not in probes
               and i >= 2)
    assert choices[-50:] == [(True, True)] * 50


def test_measured_costs_speculate_for_some_rows():
    """With pass costs: two sequences at τ 4 and 1 verify 6 rows where only the first
    speculates (1.49 passes with the draft) against 10 (1.83): 5 / 1.49 beats 5 / 1.83 and
    plain decoding's 2 / 1.05."""
    c = WidthControl(CPU)
    c.record(["a", "b"], True, None, [4, 1], 5)
    assert c.choose(["a", "b"]) == [True, False]
    for _ in range(9):  # the same costs, but "a" misses now: its τ falls to 1.3
        c.record(["a", "b"], True, None, [1, 1], 5)
    assert c.choose(["a", "b"]) == [False, False]


def test_fixed_rounds_always_speculate_and_seconds_none_is_not_a_cost():
    c = WidthControl()
    run_rounds(c, [0], 20, spec_s=2.0, plain_s=1.0, tau=lambda i: 1)
    assert c.speculate([0]) is False or c.probes > 0
    assert c.speculate([0], fixed=True) is True
    c = WidthControl()
    c.record([0], True, None, [3])  # a first round that also absorbed the prompt
    assert c.speculate([0]) is True  # its cost is still unknown: measure it


# a CPU-like curve: a pass of 8 rows 1.3x one row, then about linear (65 rows: 6x)
CPU = PassCosts(((1, 1.0), (2, 1.05), (4, 1.15), (8, 1.3), (9, 1.5), (17, 2.0), (33, 3.2),
                 (65, 6.0)), draft=0.2, block=5)


def test_pass_costs_interpolate_and_extend():
    assert CPU.verify(1) == 1.0 and CPU.verify(8) == 1.3
    assert CPU.verify(3) == pytest.approx(1.1)  # halfway between 2 and 4
    assert CPU.verify(130) == pytest.approx(12.0)  # past the widest: its cost per row
    # 8 sequences at width 5: a 40-row verify and a draft pass grown like the target's
    assert CPU.round(8, 5) == pytest.approx(CPU.verify(40) + 0.2 * CPU.verify(40) / CPU.verify(5))


def test_measured_costs_decide_without_timing_plain_rounds():
    """With pass costs nothing is timed (seconds are ignored): alone, τ 2 at width 5 pays
    (2 / 1.43 > 1); eight sequences with the same τ verify 40 rows, which does not."""
    c = WidthControl(CPU)
    for keys in ([0], list(range(8))):
        c.record(keys, True, 99.0, [2] * len(keys), 5)
    assert c.speculate([0]) is True
    assert c.speculate(list(range(8))) is False
    assert c._spec == {} and c._plain == {}  # no round seconds were kept
    low = WidthControl(CPU)
    low.record([0], True, None, [1], 5)  # a draft that misses: τ 1 at 1.43 steps
    assert low.speculate([0]) is False


def test_a_cue_probes_one_plainly_decoding_sequence_at_once(monkeypatch):
    """A cue (its lookup was just right) turns one sequence's next plain round into a probe;
    the blind probes' schedule is left as it was; a batch of several ignores it. (The floor
    aside: it would hold back a probe this draft's first miss has not paid for; below.)"""
    monkeypatch.setattr(width, "FLOOR_ALLOWANCE", float("inf"))
    c = WidthControl(CPU)
    c.record([0], True, None, [1], 5)  # the draft misses: plain decoding wins
    assert [c.speculate([0]) for _ in range(2)] == [False, False] and c.plain
    c.cue()
    assert c.speculate([0]) is True and (c.cued, c.probes) == (1, 0)
    c.record([0], True, None, [1], 5)  # it did not pay
    assert c.speculate([0]) is False  # one cue, one probe
    # the blind probe comes after as many plain rounds as without the cue
    twin = WidthControl(CPU)
    twin.record([0], True, None, [1], 5)
    alone = [twin.speculate([0]) for _ in range(20)].index(True)
    assert 2 + 1 + [c.speculate([0]) for _ in range(20)].index(True) == alone > 3
    batch = WidthControl(CPU)
    batch.record([0, 1], True, None, [1, 1], 5)
    batch.cue()
    assert batch.speculate([0, 1]) is False and batch.cued == 0


def test_rounds_wider_than_the_measured_passes_are_timed():
    """A curve measured up to 8 rows decides one sequence at width 5 from its costs; two
    sequences verify 10 rows, past it, where the linear extension overstates a CPU's cost
    (measured: 1.55 plain rounds, extended: 1.9), so those rounds are timed and decide."""
    narrow = PassCosts(((1, 1.0), (4, 1.26), (8, 1.43)), 0.24, 5)
    c = WidthControl(narrow)
    c.record([0], True, 99.0, [2], 5)
    assert c.speculate([0]) is True and c._spec == {}
    two = ["a", "b"]
    choices = run_rounds(c, two, 12, spec_s=1.5, plain_s=1.0, tau=lambda i: 1.7)
    assert choices[:2] == [True, False] and all(choices[2:])  # 3.4 / 1.5 > 2 / 1
    assert narrow.round(2, 5) / narrow.verify(2) > 1.7  # what the extension would have said



def cued_misses(control, rounds):
    """One sequence whose draft always misses (a speculative round commits 1 token) and whose
    lookup cues every plain round, as `stream_generate` drives it, priced with CPU. Returns
    per round (speculated, rows verified, tokens so far, plain rounds lost so far)."""
    out, tokens, lost = [], 0, 0.0
    for _ in range(rounds):
        if control.plain:
            control.cue()
        wide = control.speculate([0])
        rows = min(5, control.rows or 5) if wide else 1
        control.record([0], wide, None, [1], rows)
        tokens += 1
        lost += CPU.round(1, rows) - 1 if wide else 0.0
        out.append((wide, rows, tokens, lost))
    return out


def test_the_floor_bounds_what_one_sequence_loses(monkeypatch):
    """A draft that always misses, and a cue before every plain round: each cued probe loses
    0.39 plain rounds, so unchecked they take one sequence to 0.84x plain decoding. The floor
    lets a speculative round after plain ones run only while the loss so far stays within
    FLOOR_ALLOWANCE plain rounds and FLOOR_SHARE of the tokens, narrowing it to NARROW
    drafted slots where that fits and a full one does not: the loss never passes that bound
    by more than one round's, and the ratio ends above 0.97x."""
    rounds = cued_misses(WidthControl(CPU), 300)
    full, narrow = CPU.round(1, 5) - 1, CPU.round(1, 1 + NARROW) - 1
    for _, _, tokens, lost in rounds:
        assert lost <= FLOOR_ALLOWANCE + FLOOR_SHARE * tokens + full
    tokens, lost = rounds[-1][2:]
    assert tokens / (tokens + lost) > 0.97
    assert any(rows == 1 + NARROW for _, rows, _, _ in rounds)  # narrow probes ran
    assert sum(w for w, _, _, _ in rounds) >= 300 * FLOOR_SHARE / full  # it still probes
    assert narrow < full
    monkeypatch.setattr(width, "FLOOR_ALLOWANCE", float("inf"))  # no floor
    tokens, lost = cued_misses(WidthControl(CPU), 300)[-1][2:]
    assert tokens / (tokens + lost) < 0.9


def test_the_floor_leaves_a_paying_draft_and_batches_alone(monkeypatch):
    """A sequence whose draft has paid has saved more than its probes lose when it stops
    paying, so it probes as it would with no floor; a batch of several is not held to one
    sequence's floor: its probes are the same under a floor that would refuse every one."""

    def choices(keys, allowance, tau):
        monkeypatch.setattr(width, "FLOOR_ALLOWANCE", allowance)
        c = WidthControl(CPU)
        out = run_rounds(c, keys, 400, spec_s=None, plain_s=None, tau=tau)
        return out, c.rows

    paid = lambda i: 3 if i < 10 else 1  # noqa: E731
    one, rows = choices([0], FLOOR_ALLOWANCE, paid)
    assert one == choices([0], float("inf"), paid)[0] and rows is None
    assert one != choices([0], -float("inf"), paid)[0]  # (where a floor would bind)
    assert all(one[:10]) and 4 < sum(one[10:]) < 60
    keys = list(range(4))
    four = choices(keys, FLOOR_ALLOWANCE, lambda i: 1)
    assert four == choices(keys, -float("inf"), lambda i: 1) and 2 < sum(four[0]) < 20
