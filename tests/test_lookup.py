"""Context lookup: the rule itself, and that decoding stays exact when it fills draft slots.

Checked here: `find` gives what followed the latest earlier occurrence of the longest suffix
n-gram (3, then 2; never 1) and how long that match is; `merge` looks up after the draft's own
slots and switches to the lookup only at a slot it disagrees with where the draft is unsure or
the text is being copied; greedy decoding with the
lookup on equals mlx-lm greedy over many prompts and block sizes while the lookup really fills
(and gets accepted on) slots; sampling with a lookup-filled first slot still follows the
target's distribution, first token and the one after it; the CLI's switch and summary line.
"""

from __future__ import annotations

import dflash_mlx  # noqa: F401  (first: preloads OpenBLAS before mlx)
import numpy as np
import pytest

from dflash_mlx import stream_generate, tiny
from dflash_mlx.generate import BlockEvent
from dflash_mlx.models.dflash import DFlashDraftModel
from dflash_mlx.speculate.lookup import (LOOKUP_CONFIDENCE, MATCH_CAP, UNSURE, Cue, Hint, find,
                                         merge)
from dflash_mlx.cli.render import stats_lines
from dflash_mlx.stats import Stats
from dflash_mlx.speculate.sampling import SamplingParams
from support.engine import float32_pair, mlx_lm_greedy
from support.sampling import target_rows
from support.stats import chi_square
from tui.turn import LOOKUP, TARGET, token_labels
from tui.widgets.provenance import label_class


def continuation(ctx, k):
    return find(ctx, k)[0]


def test_find_prefers_the_longest_latest_match():
    #        0  1  2  3  4  5  6  7  8  9 10 11 12
    ctx = [1, 2, 3, 9, 9, 7, 2, 3, 5, 6, 1, 2, 3]
    # suffix [1, 2, 3] occurs at 0 (followed by 9, 9, 7); the later [2, 3] at 6 loses to it
    assert continuation(ctx, 4) == [9, 9, 7, 2]
    assert continuation(ctx, 2) == [9, 9]
    # only the 2-gram [2, 3] repeats: its latest earlier occurrence (at 6) wins
    assert continuation([4, 2, 3, 8, 2, 3, 5, 0, 2, 3], 3) == [5, 0, 2]
    # a lone repeated token is not enough; nothing repeats; too short; k = 0
    assert find([5, 1, 7, 8, 1], 3) == ([], 0)
    assert continuation([1, 2, 3, 4], 3) == []
    assert continuation([1, 2], 3) == []
    assert find(ctx, 0) == ([], 0)
    # the continuation may run into the suffix itself (a repeating run)
    assert continuation([7, 7, 7, 7], 4) == [7]


def test_find_measures_how_much_the_match_shares():
    text = list(range(10, 20))
    # the last 8 tokens (12..19) repeat text's 12..19: the 3-gram match shares all 8
    assert find(text + [50] + text[2:], 2) == ([50, 12], 8)
    assert find(text + [50] + text[3:], 2) == ([50, 13], 7)
    # a 2-gram match preceded by different tokens shares just the 2
    assert find([4, 7, 8, 5, 6, 9, 0, 7, 8], 2) == ([5, 6], 2)
    # capped: a long repeated run stops counting at MATCH_CAP
    assert find([3] * 200, 1) == ([3], MATCH_CAP)


def test_a_cue_is_a_lookup_that_was_just_right_and_proposes_more():
    """Round by round: the lookup's guess for the next token, checked against the token the
    round then committed. A miss, no guess, or a round that committed several tokens (the
    guess was for its first) is no cue."""
    cue = Cue()
    text = [5, 6, 7, 8, 1, 5, 6]
    assert cue(text) is False  # no guess yet (the lookup guesses 7)
    assert cue(text + [7]) is True  # it was right, and it guesses 8
    assert cue(text + [7, 9]) is False  # it guessed 8
    assert cue(text + [7, 9, 2]) is False  # no guess: nothing followed "9" before
    assert cue(text + [7, 9, 2, 4]) is False
    again = Cue()
    again(text)
    assert again(text + [7, 8]) is False  # two tokens: the guess was for the first
    assert again(text + [7, 8, 1]) is True  # from there on one a round again


def test_merge_switches_only_where_the_draft_is_unsure_or_the_text_is_copied():
    sure, unsure = UNSURE + 0.1, UNSURE - 0.1
    ctx = [7, 8, 5, 6, 9, 0, 7, 8]  # [7, 8] was followed by 5, 6, 9 (a 2-token match)
    # confident draft everywhere: kept, although the lookup disagrees at slot 2
    assert merge([5, 2, 3], [sure] * 3, ctx) == ([5, 2, 3], [sure] * 3, None)
    # slot 2 unsure and different: the lookup takes over from there, its slots count as likely
    tokens, conf, start = merge([5, 2, 3, 4], [sure, unsure, 0.3, 0.2], ctx)
    assert (tokens, start) == ([5, 6, 9, 0], 1)
    assert conf[:1] == [sure] and all(c >= LOOKUP_CONFIDENCE for c in conf[1:])
    # unsure but agreeing: nothing to switch to at that slot; a later disagreement switches
    assert merge([5, 6, 3], [unsure] * 3, ctx)[::2] == ([5, 6, 9], 2)
    # the lookup continues the draft's own slots: after a sure 5 that the context's [3, 4]
    # never preceded, [4, 5] was followed by 6
    ctx2 = [4, 5, 6, 1, 3, 4, 9, 9, 0, 3, 4]
    assert merge([5, 2, 7], [sure, unsure, unsure], ctx2)[::2] == ([5, 6, 1], 1)
    # copying (the match shares COPYING tokens) overrides even a sure slot; one fewer does not
    text = list(range(10, 20))
    assert merge([51, 52], [sure, sure], text + [50] + text[2:])[::2] == ([50, 12], 0)
    assert merge([51, 52], [sure, sure], text + [50] + text[3:])[2] is None
    # a short lookup shortens the block; no match changes nothing
    assert merge([1, 2, 3, 4], [unsure] * 4, [1, 2, 9, 1, 2])[::2] == ([9, 1, 2], 0)
    assert merge([1, 2], [unsure] * 2, [1, 2, 3])[2] is None
    assert Hint([9], start=1).flags(3) == [False, True, True]
    assert Hint([9]).flags(2) == [False, False]


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("lookup")
    p = float32_pair(tiny.make_target(root / "target"), tiny.make_draft(root / "draft"),
                     DFlashDraftModel)
    p.min_confidence = 0.0
    return p


def _repetitive_prompt(rng) -> list[int]:
    """Random bytes with a few of its own trigrams repeated, so the lookup has matches."""
    base = [int(t) for t in rng.integers(3, 250, size=int(rng.integers(8, 24)))]
    for _ in range(3):
        s = int(rng.integers(0, len(base) - 3))
        base += base[s:s + 3] + [int(t) for t in rng.integers(3, 250, size=2)]
    return base


@pytest.mark.parametrize("block", [3, 5, 8])
def test_greedy_with_lookup_is_exact(pair, block):
    rng = np.random.default_rng(block)
    filled = accepted = 0
    for _ in range(6):
        prompt = _repetitive_prompt(rng)
        reference = mlx_lm_greedy(pair.target.model, prompt, 40)
        for min_confidence in (0.0, 0.05):
            events = list(stream_generate(pair, prompt, block_size=block, max_tokens=40,
                                          min_confidence=min_confidence, lookup=True,
                                          adaptive=False))  # speculate every round
            out = [t for e in events for t in e.tokens]
            n = reference.index(tiny.EOS_ID) + 1 if tiny.EOS_ID in reference else len(reference)
            assert out == reference[:n]
            for e in events:
                assert len(e.lookup_flags) in (0, len(e.drafted))
                filled += sum(e.lookup_flags)
                accepted += sum(f and a for f, a in zip(e.lookup_flags, e.accept_flags))
        off = [t for e in stream_generate(pair, prompt, block_size=block, max_tokens=40,
                                          lookup=False) for t in e.tokens]
        assert off == out
    # the lookup really proposed, and the target really took some of it
    assert filled > 0 and accepted > 0


TEMP = 0.6


def _prompt_with_a_mid_lookup(pair, params) -> tuple[list[int], int]:
    """A prompt ending in a trigram seen before, followed then by a token the target gives
    probability in [0.1, 0.9] here: the lookup's slot 1 is then sometimes accepted, sometimes
    rejected, and both paths of the sampler are exercised."""
    head, tri = [84, 104, 101, 32], [113, 117, 105]
    for cand in range(3, 250):
        prompt = head + tri + [cand, 99, 107] + tri
        p = target_rows(pair, prompt, params, 1)[0][cand]
        if 0.1 <= p <= 0.9:
            return prompt, cand
    raise AssertionError("no candidate with a mid probability")


@pytest.mark.slow
def test_sampling_with_a_lookup_slot_stays_exact(pair):
    params = SamplingParams(TEMP)
    prompt, cand = _prompt_with_a_mid_lookup(pair, params)
    n = 1200
    first, second = np.empty(n, np.int64), np.empty(n, np.int64)
    led = 0
    for i in range(n):
        toks, events = [], list(stream_generate(pair, prompt, block_size=3, max_tokens=2,
                                                temperature=TEMP, seed=5000 + i, lookup=True))
        for ev in events:
            toks += ev.tokens
        first[i], second[i] = toks[0], toks[1]
        e0 = events[0]
        led += bool(e0.lookup_flags) and e0.lookup_flags[0] and e0.drafted[0] == cand
    assert led > n * 0.9  # the lookup's token was what slot 1 proposed (the draft is unsure)
    row0 = target_rows(pair, prompt, params, 1)[0]
    assert chi_square(first, row0).ok
    assert 0.05 < np.mean(first == cand) < 0.95
    t = int(np.bincount(first).argmax())
    after = second[first == t]
    assert len(after) >= 200
    assert chi_square(after, target_rows(pair, prompt + [t], params, 1)[0]).ok


def test_stats_and_summary_count_lookup_slots(pair):
    rng = np.random.default_rng(11)
    stats = Stats()
    for _ in range(3):
        for ev in stream_generate(pair, _repetitive_prompt(rng), block_size=5, max_tokens=40,
                                  adaptive=False):  # every round speculates
            stats.add(ev)  # the pair's default: lookup on
    assert stats.lookup_slots > 0 and 0 <= stats.lookup_accepted <= stats.lookup_slots
    d = stats.as_dict()
    assert (d["lookup_slots"], d["lookup_accepted"]) == (stats.lookup_slots,
                                                         stats.lookup_accepted)
    line = next(x for x in stats_lines(stats, 0.1, 5) if x.startswith("Context lookup"))
    assert f"{stats.lookup_accepted} of {stats.lookup_slots}" in line


def test_chat_labels_accepted_lookup_slots():
    """The chat tints a token by where it came from: LOOKUP for an accepted lookup slot."""
    e = BlockEvent(tokens=[1, 2, 3, 4], text="abcd", drafted=[1, 2, 3, 5], accepted=3,
                   accept_flags=[True, True, True, False], draft_s=0.01, verify_s=0.02,
                   block_size=5, prompt_tokens=7, reused_tokens=0, prompt_s=0.1,
                   generation_tokens=4, lookup_flags=[False, True, True, True])
    # slot 4 was filled by the lookup but rejected: the target's own token stands there
    assert token_labels(e) == [1, LOOKUP, LOOKUP, TARGET]
    assert label_class(LOOKUP) == "prov-l" and label_class(TARGET) == "prov-t"
