"""Goodness-of-fit checks for the sampling tests: chi-square of sampled ids (`chi_square`) or of
tallies (`pooled_chisquare`), small bins pooled either way, and the exact binomial test."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from scipy import stats
from scipy.stats import chisquare

ALPHA = 0.01


@dataclass
class ChiSquare:
    """A goodness-of-fit result. `outside` counts draws of zero-probability tokens."""

    statistic: float
    pvalue: float
    dof: int
    n: int
    outside: int = 0
    expected: float | None = None  # binomial rows: the expected rate (statistic = observed)

    @property
    def ok(self) -> bool:
        return self.outside == 0 and self.pvalue > ALPHA


def chi_square(samples, probs) -> ChiSquare:
    """Chi-square of sampled ids against `probs` (V,), pooling bins with expected count < 5.

    Tokens with probability 0 are not bins: any draw of one makes the result fail outright
    (statistic inf, p 0), since no finite sample can excuse it.
    """
    samples = np.asarray(samples, dtype=np.int64)
    probs = np.asarray(probs, dtype=np.float64)
    probs = probs / probs.sum()
    n = len(samples)
    counts = np.bincount(samples, minlength=len(probs)).astype(np.float64)
    support = probs > 0
    outside = int(counts[~support].sum())
    if outside:
        return ChiSquare(float("inf"), 0.0, 0, n, outside)
    expected = probs * n
    big = support & (expected >= 5)
    small = support & ~big
    obs, exp = list(counts[big]), list(expected[big])
    if small.any():
        obs.append(counts[small].sum())
        exp.append(expected[small].sum())
        if exp[-1] < 5 and len(exp) > 1:  # the pool itself is too small: merge it into the
            j = int(np.argmin(exp[:-1]))  # smallest regular bin
            obs[j] += obs.pop()
            exp[j] += exp.pop()
    if len(obs) < 2:
        return ChiSquare(0.0, 1.0, 0, n)
    obs_a, exp_a = np.array(obs), np.array(exp)
    exp_a *= obs_a.sum() / exp_a.sum()
    stat, p = stats.chisquare(obs_a, exp_a)
    return ChiSquare(float(stat), float(p), len(obs) - 1, n)


def binomial(k: int, n: int, p: float) -> ChiSquare:
    """Exact binomial test of k successes in n against rate p (as a ChiSquare-like row)."""
    if p <= 0.0:
        return ChiSquare(k / max(n, 1), 1.0 if k == 0 else 0.0, 1, n, outside=k, expected=0.0)
    if p >= 1.0:
        return ChiSquare(k / max(n, 1), 1.0 if k == n else 0.0, 1, n, outside=n - k, expected=1.0)
    return ChiSquare(k / max(n, 1), float(stats.binomtest(k, n, p).pvalue), 1, n, expected=p)


def pooled_chisquare(counts, expected) -> tuple[float, float, int]:
    """scipy chi-square with expected counts < 5 pooled; returns (statistic, p, cells).

    An observation where the expected count is 0 is an impossible event: p = 0.
    """
    counts = np.asarray(counts, dtype=np.float64)
    expected = np.asarray(expected, dtype=np.float64)
    if np.any(counts[expected <= 0] > 0):
        return float("inf"), 0.0, 0
    big = expected >= 5
    obs, exp = list(counts[big]), list(expected[big])
    rest_o, rest_e = counts[~big].sum(), expected[~big].sum()
    if rest_e > 0:
        if rest_e >= 5 or not exp:
            obs.append(rest_o)
            exp.append(rest_e)
        else:  # too small for its own cell: join the smallest cell
            j = int(np.argmin(exp))
            obs[j] += rest_o
            exp[j] += rest_e
    obs, exp = np.array(obs), np.array(exp)
    exp *= obs.sum() / exp.sum()
    stat, p = chisquare(obs, exp)
    return float(stat), float(p), len(obs)

