"""Load-adaptive verify width: speculate only while it pays, on this machine, now.

A speculative round costs a draft pass and a wider verify pass; it pays when the tokens it
commits per second beat plain decoding's. Both sides are measured as generation goes: the
seconds of each kind of round per batch size (a wide verify of many rows costs more than a
few, so the answer changes with the load) and each sequence's tokens per speculative round
(τ). Before every round `WidthControl.speculate` picks the faster kind for the whole batch:
speculation at the configured width, or width 1 (plain decoding, no draft pass). While plain
decoding wins it still probes speculation now and then, less often each time a probe shows it
does not pay, so acceptance that returns is noticed.

Output never depends on the choice: greedy tokens are the target's argmax at any width and
sampling is exact at any width. Only a seeded sampling request must keep its widths fixed
(the random keys it draws depend on them), so a batch holding one speculates every round.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence

# Averages are plain means over the first rounds, then moving averages with this weight on the
# newest: a round's seconds vary a few %, its committed tokens from 1 to the block.
TIME_EMA = 0.2
TAU_EMA = 0.1
PROBE_EMA = 0.3  # a probe is the only news of acceptance while plain decoding runs: it counts more
# Leave speculation only when it is clearly behind (one slow round or a few misses are noise);
# come back as soon as it is ahead.
MARGIN = 0.05
PROBE_FIRST = 4  # plain rounds before the first probe of speculation
PROBE_MAX = 32  # the longest run of plain rounds between two probes (one probe: ~3% of them)


class _Mean:
    """The mean of the first 1/weight values, then an exponential moving average."""

    def __init__(self, weight: float):
        self.weight, self.n, self.value = weight, 0, 0.0

    def feed(self, x: float, weight: float | None = None) -> float:
        self.n += 1
        self.value += max(1 / self.n, weight or self.weight) * (x - self.value)
        return self.value


class WidthControl:
    """Chooses, round by round, between speculation and plain decoding for a batch.

    One instance lives as long as its batch (or one `stream_generate` call) and learns this
    machine's round costs per batch size; sequences come and go by their keys.
    """

    def __init__(self):
        self._spec: dict[int, _Mean] = {}  # batch size -> seconds per speculative round
        self._plain: dict[int, _Mean] = {}  # batch size -> seconds per plain round
        self._tau: dict[Hashable, _Mean] = {}  # sequence -> tokens per speculative round
        self._tau_all = _Mean(TAU_EMA)  # every sequence's, for those not measured yet
        self._wait, self._since = PROBE_FIRST, 0
        self._wide = True  # what the last choice was
        self._catching_up = False  # this round's draft first takes the plain rounds' context
        self.plain_rounds = self.probes = 0  # what it did, for reports and tests

    def speculate(self, keys: Sequence[Hashable], fixed: bool = False) -> bool:
        """Whether this round of the sequences `keys` speculates; `fixed`: it must (a seeded
        sampling request is in the batch)."""
        n = len(keys)
        spec, plain = self._spec.get(n), self._plain.get(n)
        if fixed or spec is None or not self._tau_all.n:
            return self._spec_round()  # measure speculation first
        if plain is None:
            return self._plain_round()  # then plain decoding, once
        known = [self._tau[k].value for k in keys if k in self._tau]
        fill = sum(known) / len(known) if known else self._tau_all.value
        gain = sum(self._tau[k].value if k in self._tau else fill for k in keys) / spec.value
        if gain >= n / plain.value * (1 - MARGIN if self._wide else 1):
            self._wait, self._since = PROBE_FIRST, 0
            return self._spec_round()
        if self._since >= self._wait:  # a probe: has acceptance come back?
            self._since, self._wait = 0, min(2 * self._wait, PROBE_MAX)
            self.probes += 1
            return self._spec_round()
        return self._plain_round()

    def _spec_round(self) -> bool:
        # after plain rounds the draft first catches up on their context: not a typical cost
        self._catching_up = not self._wide
        self._wide = True
        return True

    def _plain_round(self) -> bool:
        self._since += 1
        self.plain_rounds += 1
        self._wide = False
        return False

    def record(self, keys: Sequence[Hashable], speculated: bool, seconds: float | None,
               committed: Sequence[int] = ()):
        """One round's outcome: its seconds (None: not typical, e.g. a draft catching up on
        a whole prompt) and, when it speculated, each sequence's committed token count."""
        weight = None
        if speculated and self._catching_up:
            seconds, weight = None, PROBE_EMA
        if seconds is not None and seconds > 0:
            table = self._spec if speculated else self._plain
            table.setdefault(len(keys), _Mean(TIME_EMA)).feed(seconds)
        if speculated:
            for k, c in zip(keys, committed):
                self._tau.setdefault(k, _Mean(TAU_EMA)).feed(c, weight)
                self._tau_all.feed(c)

    def forget(self, key: Hashable):
        """A sequence left."""
        self._tau.pop(key, None)
