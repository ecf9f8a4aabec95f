"""The `slow` tier: long statistical and real-model tests that `pytest -q` leaves out and
`pytest -q -m slow` (run by CI after the default tier) runs."""

import pytest


def slow_after(cases, keep: int = 1, ids=None) -> list:
    """Parametrize cases with all but the first `keep` in the slow tier: the default tier still
    runs one of each kind, the slow tier the rest."""
    ids = ids or [None] * len(cases)
    return [pytest.param(c, id=i, marks=() if n < keep else pytest.mark.slow)
            for n, (c, i) in enumerate(zip(cases, ids))]
