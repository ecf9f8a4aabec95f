"""Load-adaptive verify width: speculate only while it pays, on this machine, now.

A speculative round costs a draft pass and a wider verify pass; it pays when the tokens it
commits per second beat plain decoding's. The cost of each kind of round depends on the batch
size (a wide verify of many rows costs more than a few, so the answer changes with the load):
with `PassCosts`, this machine's measured cost of a target pass of R rows (the CPU's cost
curve, `cpu/cost.py`, timed once and cached), it is computed for the widths that curve
measured; past them, and without one, the seconds of each kind of round are measured as
generation goes. Each sequence's tokens per speculative round
(τ) and the rows a speculative pass verifies are measured as it goes. Before every round
`WidthControl.choose` picks which sequences speculate at the configured width and which
decode plainly (width 1) inside the round: the k of highest τ, for the k whose round commits
the most tokens per second (a batched pass runs a plain row's feed-forward work on its one
row only, `models/packed.py`, so a round of some speculating rows costs less than one of all;
such a round is timed per (batch size, k) like the others). While plain decoding wins it
still probes speculation now and then, less often each time a probe shows it does not pay,
so acceptance that returns is noticed; one sequence also probes at once on a cue (`cue`: its
context lookup has just been right, news that costs no pass). With pass costs one sequence is
held to a floor: it speculates again after plain rounds only while what its speculation saved
so far, plus a small allowance, covers a miss (a narrow probe where only that fits), so an
answer the draft rarely predicts loses a bounded few per cent to plain decoding, not a probe's
cost each time. A batch starts from the round seconds the last batch of the same pair measured
(`remembered`), so a new batch measures only its own acceptance (one speculative round), not
the costs of both kinds of rounds again.

Output never depends on the choice: greedy tokens are the target's argmax at any width and
sampling is exact at any width. Only a seeded sampling request must keep its widths fixed
(the random keys it draws depend on them), so a batch holding one speculates every round.
"""

from __future__ import annotations

import copy
import weakref
from bisect import bisect_left
from collections.abc import Hashable, Sequence
from dataclasses import dataclass

# A round's seconds: the fastest of the last few of its kind (a busy machine only adds time,
# and adds it to both kinds alike; it reads a speculative round, whose seconds spread with its
# width, further below what it runs at than a plain one, yet the unbiased mean did not speed
# held-out batches: docs/measurements.md, 2026-12-07). Committed tokens (1 to the block per
# round): a plain mean over the first rounds, then a moving average with this weight on the
# newest.
TIME_WINDOW = 8
TAU_EMA = 0.1
PROBE_EMA = 0.3  # a probe is the only news of acceptance while plain decoding runs: it counts more
# One sequence leaves speculation only when it is clearly behind (one slow round or a few
# misses are noise); it comes back as soon as it is ahead. A batch of several leaves on a tie:
# its speculative round verifies every speculating row, on a CPU it rarely pays, and on held-out
# batches the margin cost 2-6% at 2, 4 and 8 sequences (docs/measurements.md, 2026-12-06 night).
MARGIN = 0.05
PROBE_FIRST = 4  # plain rounds before the first probe of speculation
PROBE_MAX = 32  # then twice as many after each probe that did not pay, up to this many
# ... and never so often that probes cost more than this share of plain decoding's time,
# divided by the batch's sequences: the wider the batch, the more rows a speculative pass
# verifies per plain pass's row, so the less likely a probe finds speculation paying. 0.06,
# not 0.03: chosen on the held-out prompts' recorded rounds, where an answer that starts with
# little acceptance came back to speculation sooner; divided by the sequences: chosen on
# held-out batches (docs/measurements.md, 2026-12-05 and 2026-12-06)
PROBE_SHARE = 0.06
# One sequence's floor against plain decoding: after plain rounds it speculates again only while
# what its speculative rounds have saved so far (net, in plain rounds), plus FLOOR_ALLOWANCE
# plain rounds and FLOOR_SHARE of the tokens it committed, covers what the round loses if the
# draft misses; short of that, a narrow probe (NARROW drafted slots: a miss loses less), else
# plain decoding. Chosen on held-out records (docs/measurements.md, 2026-12-08): no answer of
# 48-96 tokens below 0.97x plain decoding, for 2.5-3.5% of the mean.
FLOOR_ALLOWANCE = 0.6
FLOOR_SHARE = 0.02
NARROW = 1


class _Mean:
    """The mean of the first 1/weight values, then an exponential moving average."""

    def __init__(self, weight: float):
        self.weight, self.n, self.value = weight, 0, 0.0

    def feed(self, x: float, weight: float | None = None) -> float:
        self.n += 1
        self.value += max(1 / self.n, weight or self.weight) * (x - self.value)
        return self.value


@dataclass
class _Ledger:
    """One sequence against plain decoding, in plain rounds (the floor's account)."""

    saved: float = 0.0  # by its speculative rounds alone, net (negative: lost)
    tokens: int = 0  # committed in all its rounds


@dataclass(frozen=True)
class PassCosts:
    """A target pass of R rows and a draft pass, relative to a pass of one row.

    Args:
        rows: (R, cost) pairs, R ascending, (1, 1.0) first: the measured widths.
        draft: one draft pass over one sequence's block.
        block: the block that draft pass was timed at.
    """

    rows: tuple[tuple[int, float], ...]
    draft: float
    block: int

    def verify(self, rows: float) -> float:
        """A pass of `rows` rows (a batch: every sequence's rows together): linear between
        the measured widths, and on from the widest at its cost per row."""
        widths = [r for r, _ in self.rows]
        i = bisect_left(widths, rows)
        if i < len(widths) and widths[i] == rows:
            return self.rows[i][1]
        if i == 0:
            return self.rows[0][1]
        if i == len(widths):
            r, c = self.rows[-1]
            return c * rows / r
        (r0, c0), (r1, c1) = self.rows[i - 1], self.rows[i]
        return c0 + (c1 - c0) * (rows - r0) / (r1 - r0)

    def round(self, n: int, width: float) -> float:
        """A speculative round of `n` sequences verifying `width` rows each: the verify pass
        and a draft pass that grows with its rows as the target's does."""
        draft = self.draft * self.verify(n * self.block) / self.verify(self.block)
        return self.verify(n * width) + draft


class _Fastest:
    """The least of the last TIME_WINDOW values."""

    def __init__(self):
        self.recent: list[float] = []

    def feed(self, x: float):
        self.recent = self.recent[1 - TIME_WINDOW:] + [x]

    @property
    def value(self) -> float:
        return min(self.recent)


class WidthControl:
    """Chooses, round by round, which sequences of a batch speculate and which decode plainly.

    One instance lives as long as its batch (or one `stream_generate` call); sequences come
    and go by their keys. `costs`: this machine's pass costs (None: round seconds measured).
    `prior`: an earlier controller of the same pair on this machine, whose round seconds this
    one starts from. Not its acceptance: that belongs to the prompts (one prompt's draft hits
    1.0 tokens a round, another's 4), so a new batch still measures its own in its first round.
    """

    def __init__(self, costs: PassCosts | None = None, prior: WidthControl | None = None):
        self.costs = costs
        self._width = _Mean(TAU_EMA)  # rows per sequence of a speculative verify pass
        self._spec: dict[int, _Fastest] = {}  # batch size -> seconds per speculative round
        self._plain: dict[int, _Fastest] = {}  # batch size -> seconds per plain round
        self._mixed: dict[tuple[int, int], _Fastest] = {}  # (size, speculating) -> seconds
        self._probe: dict[int, float] = {}  # batch size -> its last probe, in plain rounds
        # what a round of some speculating rows costs whatever their number, as a share of
        # the way from a plain round to a speculative one (see `_mixed_s`)
        self._share = _Fastest()
        self._tau: dict[Hashable, _Mean] = {}  # sequence -> tokens per speculative round
        self._tau_all = _Mean(TAU_EMA)  # every sequence's, for those not measured yet
        self._ledger: dict[Hashable, _Ledger] = {}
        self.rows: int | None = None  # the most rows this round may verify (None: the block)
        self._wait, self._since = PROBE_FIRST, 0
        self._wide = True  # what the last choice was
        self._cued = False  # `cue` since the last choice
        self._catching_up = False  # this round's draft first takes the plain rounds' context
        self.plain_rounds = self.mixed_rounds = self.probes = self.cued = 0  # reports, tests
        # the machine's costs, not the prompts' acceptance, nor the rows their cut verifies
        # (so a server's one client, a batch of one, runs `stream_generate`'s rounds)
        if prior is not None:
            self._spec, self._plain, self._mixed, self._probe, self._share = copy.deepcopy(
                (prior._spec, prior._plain, prior._mixed, prior._probe, prior._share))

    @property
    def plain(self) -> bool:
        """Whether the last choice was plain decoding for every sequence."""
        return not self._wide

    def cue(self):
        """Free news that one sequence's acceptance may be back (its context lookup has just
        predicted its last token: `lookup.Cue`). If the next choice for one sequence would be
        plain decoding, it probes instead: a blind probe most often finds the draft still
        missing, a cued one most often pays (held-out answers: mean of one sequence 1.147x
        without, 1.174x with; docs/measurements.md, 2026-12-07 night)."""
        self._cued = True

    @property
    def measured(self) -> bool:
        """Whether it has seen a speculative round (what a next batch could start from)."""
        return self._tau_all.n > 0

    def speculate(self, keys: Sequence[Hashable], fixed: bool = False) -> bool:
        """Whether every sequence of `keys` speculates this round (one sequence: whether it
        does); `fixed`: they must (a seeded sampling request is in the batch)."""
        return all(self.choose(keys, fixed))

    def choose(self, keys: Sequence[Hashable], fixed: bool = False) -> list[bool]:
        """Which of the sequences `keys` speculate this round; the others decode plainly in
        it (width 1). `fixed`: all must (a seeded sampling request is in the batch)."""
        which = self._choose(keys, fixed)
        # a plain row commits one token: counted now, so a choice made while a plain round
        # still runs (a batch reading ahead) sees the floor's ledger as `stream_generate` does
        for key, spec in zip(keys, which):
            if not spec:
                self._ledger.setdefault(key, _Ledger()).tokens += 1
        return which

    def _choose(self, keys: Sequence[Hashable], fixed: bool) -> list[bool]:
        """Candidates are the rounds where the k sequences of highest τ speculate, k = 0..n; the
        one committing the most tokens per second wins (a round of some speculating rows
        costs what their rows and the others' single rows cost: `models/packed.py`)."""
        n = len(keys)
        cued, self._cued = self._cued and n == 1, False
        self.rows = None
        if fixed or not self._tau_all.n:
            return self._spec_round(n)  # measure acceptance first
        if self._costed(n):
            spec, plain = self.costs.round(n, self._width.value), self.costs.verify(n)
        else:
            spec, plain = self._timed(n)
            if spec is None:
                return self._spec_round(n)  # measure speculation first
            if plain is None:
                return self._plain_round(n)  # then plain decoding, once
        if n == 1 and not self._wide and self._costed(n):  # the floor (priced rounds only)
            self.rows = self._floor_rows(keys[0], spec / plain - 1)
            if self.rows == 1:
                return self._plain_round(n)
        known = [self._tau[k].value for k in keys if k in self._tau]
        fill = sum(known) / len(known) if known else self._tau_all.value
        tau = [self._tau[k].value if k in self._tau else fill for k in keys]
        order = sorted(range(n), key=lambda i: -tau[i])
        tokens = [float(n)]  # committed by the round where the first k of `order` speculate
        for i in order:
            tokens.append(tokens[-1] + tau[i] - 1)
        seconds = [plain] + [self._mixed_s(n, k, spec, plain) for k in range(1, n)] + [spec]
        # one sequence leaves speculation only when clearly behind: plain's rate, discounted
        rates = [t / s for t, s in zip(tokens, seconds)]
        rates[0] *= 1 - MARGIN if self._wide and n == 1 else 1
        best = max(range(n + 1), key=lambda k: (rates[k], k))
        if best == n:
            self._wait, self._since = PROBE_FIRST, 0
            return self._spec_round(n)
        # what a probe (every sequence speculates) loses against the chosen round committing
        # the same tokens, in plain rounds (the last probe's seconds where timed: its draft
        # also catches up on the plain rounds)
        probe = max(spec, self._probe.get(n, 0.0) * plain)
        loss = (probe - tokens[n] * seconds[best] / tokens[best]) / plain
        if cued:  # a probe with good odds: it leaves the blind probes' schedule as it was
            self.cued += 1
            return self._spec_round(n)
        if self._since >= max(self._wait, loss * n / PROBE_SHARE):  # has acceptance come back?
            self._since, self._wait = 0, min(2 * self._wait, PROBE_MAX)
            self.probes += 1
            return self._spec_round(n)
        if best == 0:
            return self._plain_round(n)
        self._since += 1
        self.mixed_rounds += 1
        chosen = set(order[:best])
        return self._spec_round(n, [i in chosen for i in range(n)])

    def _floor_rows(self, key: Hashable, loss: float) -> int | None:
        """The most rows one sequence's next speculative round after plain rounds may verify
        (None: its block; 1: none) so that a miss, losing `loss` plain rounds at full width,
        stays within what its speculation saved so far plus the floor's allowance."""
        ledger = self._ledger.get(key, _Ledger())
        room = ledger.saved + FLOOR_ALLOWANCE + FLOOR_SHARE * ledger.tokens
        if room >= loss:
            return None
        return 1 + NARROW if room >= self.costs.round(1, 1 + NARROW) - 1 else 1

    def _mixed_s(self, n: int, k: int, spec: float, plain: float) -> float:
        """A round of n sequences, k of them speculating: from the pass costs (every row's
        draft pass counted, as in a speculative round), or as timed, or, not timed yet, a
        share of the way from a plain round to a speculative one: k / n of it, on top of what
        the rounds of some speculating rows timed so far cost whatever their k (the draft
        pass over every row, attention over the padded rows, no reading ahead: on a CPU 0.2
        to 0.5 of the way). The least of those, so a guess on the cheap side: such a round
        is tried once and then known."""
        if self._costed(n):
            w = self._width.value
            return spec - self.costs.verify(n * w) + self.costs.verify(k * w + n - k)
        if (n, k) in self._mixed:
            return self._mixed[(n, k)].value
        share = self._share.value if self._share.recent else 0.0
        return plain + (spec - plain) * (share + (1 - share) * k / n)

    def _costed(self, n: int) -> bool:
        """Whether a speculative round of n sequences is within the measured pass costs: past
        the widest measured pass they are only extrapolated (linearly, while a CPU's cost per
        row falls with the rows), so such rounds are timed instead."""
        return self.costs is not None and n * self.costs.block <= self.costs.rows[-1][0]

    def _timed(self, n: int) -> tuple[float | None, float | None]:
        """Seconds of a speculative and of a plain round of n sequences, as far as known.

        A kind not timed at n yet takes the ratio of the next larger batch size that timed
        both: rows leave one by one as they finish, and each new size would otherwise cost a
        round of each kind to measure. A larger batch's ratio is the safe side: its
        speculative pass has more rows per plain pass's row to verify. Neither timed at n,
        both are the larger size's seconds (still seconds: a round of some speculating rows
        timed at n is weighed against them)."""
        spec, plain = (t[n].value if n in t else None for t in (self._spec, self._plain))
        larger = [m for m in self._spec if m > n and m in self._plain]
        if (spec is not None and plain is not None) or not larger:
            return spec, plain
        m = min(larger)
        ratio = self._spec[m].value / self._plain[m].value
        if spec is None:
            plain = plain or self._plain[m].value
            return plain * ratio, plain
        return spec, spec / ratio

    def _spec_round(self, n: int, which: list[bool] | None = None) -> list[bool]:
        # after plain rounds the draft first catches up on their context: not a typical cost
        self._catching_up = not self._wide
        self._wide = True
        return which or [True] * n

    def _plain_round(self, n: int) -> list[bool]:
        self._since += 1
        self.plain_rounds += 1
        self._wide = False
        return [False] * n

    def record(self, keys: Sequence[Hashable], speculated: bool | Sequence[bool],
               seconds: float | None, committed: Sequence[int] = (), width: int = 1):
        """One round's outcome: which sequences speculated (one bool: all or none), its
        seconds (None: not typical, e.g. a draft catching up on a whole prompt), each
        sequence's committed token count and the rows per sequence its verify pass ran
        (padding included)."""
        n = len(keys)
        which = [speculated] * n if isinstance(speculated, bool) else list(speculated)
        k = sum(which)
        self._account(keys, which, list(committed) or [1] * n, width)
        weight = None
        if k and self._catching_up:
            plain = self._plain.get(n)
            if k == n and seconds is not None and seconds > 0 and plain is not None:
                self._probe[n] = seconds / plain.value
            seconds, weight = None, PROBE_EMA
        if seconds is not None and seconds > 0 and not self._costed(n):
            table, size = ((self._spec, n) if k == n else (self._plain, n) if not k
                           else (self._mixed, (n, k)))
            table.setdefault(size, _Fastest()).feed(seconds)
            if 0 < k < n:
                self._feed_share(n, k, seconds)
        if k:
            self._width.feed(width)
            for key, c, spec in zip(keys, committed, which):
                if spec:  # a plain row's one token says nothing of its draft
                    self._tau.setdefault(key, _Mean(TAU_EMA)).feed(c, weight)
                    self._tau_all.feed(c)

    def _account(self, keys, which: list[bool], committed: list[int], width: int):
        """The floor's ledgers: the tokens of speculating sequences (a plain row's: `choose`),
        and what a speculative round of one sequence saved against plain rounds committing as
        many, priced from the pass costs (without them there is no floor: a round timed before
        any plain one could not be priced, and a draft that paid looked as if it had not)."""
        for key, c, spec in zip(keys, committed, which):
            if spec:
                self._ledger.setdefault(key, _Ledger()).tokens += c
        if len(keys) == 1 and which[0] and self._costed(1):
            self._ledger[keys[0]].saved += committed[0] - self.costs.round(1, width)

    def _feed_share(self, n: int, k: int, seconds: float):
        """The fixed share of a timed round of k speculating sequences of n (`_mixed_s`)."""
        spec, plain = self._timed(n)
        if spec is not None and plain is not None and spec > plain:
            share = ((seconds - plain) / (spec - plain) - k / n) / (1 - k / n)
            self._share.feed(min(max(share, 0.0), 1.0))

    def forget(self, key: Hashable):
        """A sequence left."""
        self._tau.pop(key, None)
        self._ledger.pop(key, None)


# target -> {(draft, block size): the controller of its last batch}: measured things only
_PAST: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def remembered(pair, block: int) -> WidthControl | None:
    """The controller of `pair`'s last batch at this block size (None: none measured yet)."""
    return _PAST.get(pair.target, {}).get((pair.draft_id, block))


def remember(pair, block: int, control: WidthControl):
    """Keep `control` for `pair`'s next batch, if it measured anything."""
    if control.measured:
        _PAST.setdefault(pair.target, {})[(pair.draft_id, block)] = control
