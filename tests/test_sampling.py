"""Sampling is exact: emitted tokens follow the target's distribution, checked statistically.

Function level: `rejection_sample` on real tiny-target logits (≥20,000 draws per case), the
first emitted token and the token after an accepted prefix, one-hot and dense draft proposals.
Broken copies of the rejection step must fail the same checks (the test has power).
Engine level: the first token `stream_generate` emits over thousands of seeded runs.

Seeds are fixed, so every run is deterministic. Each check passes at p > 0.01. Should the
engine's PRNG stream change (a different key split, say), some of the 33 checks may fall under
0.01 by pure chance (1 − 0.99³³ ≈ 28% for at least one): before suspecting the sampler, run
`python scripts/chi_square_report.py --seed-offset 1` (fresh streams, same checks, a table of
statistics and p-values); a real bug fails by orders of magnitude, not near 0.01.

The cases, the draws and the broken samplers are in tests/support/sampling.py (shared with that
script), the chi-square and binomial tests in tests/support/stats.py.
"""

from __future__ import annotations

import dflash_mlx  # noqa: F401  (first: preloads OpenBLAS before mlx)
import mlx.core as mx
import numpy as np
import pytest

from dflash_mlx import SpeculationConfig, load, tiny
from dflash_mlx.speculate.sampling import SamplingParams, greedy_accept, sampling_probs
from support.sampling import (
    ENGINE_CASES, FUNCTION_CASES, N_BROKEN, N_DRAWS, PROMPT, SETTINGS, Case, broken_ignores_q,
    broken_no_residual, broken_wrong_row, engine_check, fixed_draft_pair, make_tiny_target,
    rejection_sample, run_function_case, target_rows,
)
from support.stats import ALPHA, binomial, chi_square
from support.tiers import slow_after


# ---------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("sampling")
    return make_tiny_target(root), tiny.make_draft(root / "draft")


@pytest.fixture(scope="module")
def target_pair(dirs):
    return load(dirs[0], None, weights="float32")


def _assert_all_ok(results: dict):
    bad = {k: v for k, v in results.items() if not v.ok}
    assert not bad, f"sampling is not exact: {bad}"


# ---------------------------------------------------------------- a. function level


@pytest.mark.parametrize("case", slow_after(FUNCTION_CASES, keep=2,
                                             ids=[c.name for c in FUNCTION_CASES]))
def test_rejection_sample_is_exact(target_pair, case):
    """Per case: the first emitted token follows row 0, slot 1 is accepted at rate p(d1)
    (Σ min(p, q) for a dense q), and after an accepted d1 the next token follows row 1."""
    results = run_function_case(target_pair, case, rejection_sample, N_DRAWS)
    if case.kinds[1] is not None:
        assert "after accepted d1" in results  # enough slot-1 accepts to test slot 2
    _assert_all_ok(results)


# ---------------------------------------------------------------- b. the checks have power


def _case(name: str) -> Case:
    return next(c for c in FUNCTION_CASES if c.name == name)


def test_broken_residual_fails_the_check(target_pair):
    """Next token after a rejection drawn from p, not max(p − q, 0): the first token fails."""
    results = run_function_case(target_pair, _case("T1.0 d1=top d2=mid"), broken_no_residual,
                                N_BROKEN)
    assert results["first token"].pvalue < ALPHA


def test_broken_row_fails_the_conditional_check(target_pair):
    """Next token always from row 0: the first token is right, the one after d1 is not."""
    results = run_function_case(target_pair, _case("T0.7/k20 d1=top d2=least"),
                                broken_wrong_row, N_BROKEN)
    assert results["first token"].ok
    assert results["after accepted d1"].pvalue < ALPHA


def test_broken_accept_rule_fails_with_a_dense_q(target_pair):
    """Accepting with u < p (dropping q): invisible for one-hot proposals, caught by dense q."""
    results = run_function_case(target_pair, _case("T1.3/p0.8 dense-q"), broken_ignores_q,
                                N_BROKEN)
    assert min(r.pvalue for r in results.values()) < ALPHA


def test_chi_square_helper():
    rng = np.random.default_rng(0)
    p = np.array([0.5, 0.3, 0.15, 0.05 - 1e-4, 1e-4, 0.0])
    good = rng.choice(6, size=5000, p=p)
    r = chi_square(good, p)
    assert r.ok and r.n == 5000 and r.dof >= 2
    assert chi_square(good, [0.3, 0.5, 0.15, 0.05 - 1e-4, 1e-4, 0.0]).pvalue < 1e-10
    assert not chi_square(np.append(good, 5), p).ok  # one draw of a zero-probability token
    assert binomial(0, 100, 0.0).ok and not binomial(1, 100, 0.0).ok


# ---------------------------------------------------------------- c. engine level


@pytest.fixture(scope="module")
def engine_pair(dirs):
    return fixed_draft_pair(*dirs)


@pytest.mark.parametrize("setting", slow_after(list(ENGINE_CASES), ids=list(ENGINE_CASES)))
def test_stream_generate_first_token_is_exact(engine_pair, setting):
    params = SETTINGS[setting]
    results, _ = engine_check(engine_pair, setting)
    # top-k / top-p respected: chi_square fails outright on any token outside the kept set
    assert all(r.outside == 0 for r in results.values())
    if params.top_k:
        assert (target_rows(engine_pair, PROMPT, params, 1)[0] > 0).sum() == params.top_k
    _assert_all_ok(results)


@pytest.mark.slow
def test_padded_verify_pass_samples_exactly(engine_pair):
    """A verify pass padded wider (doctor's `pads`) leaves the sampled distribution alone."""
    padded = SpeculationConfig.for_pair(engine_pair, verify_pad={2: 8})
    results, _ = engine_check(engine_pair, "T1.0", seed=2024, config=padded)
    _assert_all_ok(results)


# ---------------------------------------------------------------- d. greedy and sampling_probs


def test_greedy_accept_cases():
    assert greedy_accept([], [7]) == (0, 7)
    assert greedy_accept([1, 2, 3], [1, 2, 3, 4]) == (3, 4)  # all accepted: bonus after them
    assert greedy_accept([1, 2, 3], [9, 2, 3, 4]) == (0, 9)  # first slot wrong
    assert greedy_accept([1, 2, 3], [1, 9, 3, 4]) == (1, 9)  # later agreement does not count
    assert greedy_accept([1, 2, 3], [1, 2, 9, 4]) == (2, 9)
    assert greedy_accept([5], [5, 6]) == (1, 6)


def test_sampling_probs_properties():
    logits = mx.random.normal((4, 300), key=mx.random.key(3)) * 3
    for params in [SamplingParams(1.0), SamplingParams(0.5), SamplingParams(1.0, 1.0, 20),
                   SamplingParams(0.7, 0.9, 0), SamplingParams(1.3, 0.5, 50)]:
        probs = np.array(sampling_probs(logits, params), dtype=np.float64)
        assert np.all(probs >= 0)
        np.testing.assert_allclose(probs.sum(axis=-1), 1.0, atol=1e-5)
        for row, lg in zip(probs, np.array(logits)):
            kept = row > 0
            if params.top_k:
                assert kept.sum() <= params.top_k
                if params.top_p == 1.0:
                    assert kept.sum() == params.top_k
                    assert set(np.flatnonzero(kept)) == set(np.argsort(-lg)[: params.top_k])
            if params.top_p < 1.0:
                # the kept set is the smallest prefix (by probability) reaching top_p
                x = lg / params.temperature
                if params.top_k:
                    x = np.where(x >= np.sort(x)[-params.top_k], x, -np.inf)
                full = np.exp(x - x.max())
                full /= full.sum()
                order = np.argsort(-full)
                m = int(kept.sum())
                assert set(np.flatnonzero(kept)) == set(order[:m])
                assert full[order[:m]].sum() >= params.top_p - 1e-6
                assert full[order[: m - 1]].sum() < params.top_p
                np.testing.assert_allclose(row[order[:m]], full[order[:m]] / full[order[:m]].sum(),
                                           rtol=1e-4, atol=1e-7)
            if not params.top_k and params.top_p == 1.0:
                x = lg / params.temperature
                ref = np.exp(x - x.max())
                np.testing.assert_allclose(row, ref / ref.sum(), rtol=1e-4, atol=1e-7)


def test_sampling_probs_low_temperature_is_one_hot():
    logits = mx.random.normal((3, 260), key=mx.random.key(4)) * 2
    argmax = np.array(mx.argmax(logits, axis=-1))
    prev = np.zeros(3)
    for t in (1.0, 0.3, 0.1, 0.01, 1e-3):
        probs = np.array(sampling_probs(logits, SamplingParams(t)))
        top = probs[np.arange(3), argmax]
        assert np.all(top >= prev - 1e-6)  # monotone towards one-hot
        prev = top
    assert np.all(prev > 0.999)
    np.testing.assert_array_equal(np.argmax(probs, axis=-1), argmax)
