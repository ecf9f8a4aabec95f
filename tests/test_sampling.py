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
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import dflash_mlx  # noqa: F401  (first: preloads OpenBLAS before mlx)
import mlx.core as mx
import numpy as np
import pytest
from scipy import stats

from dflash_mlx import Session, load, stream_generate, tiny
from dflash_mlx.models.dflash import DFlashDraftModel
from dflash_mlx.sample_utils import (
    SamplingParams, accept_prefix, greedy_accept, rejection_sample, sampling_probs,
)
from engine_support import float32_pair

ALPHA = 0.01
N_DRAWS = 20_000
N_BROKEN = 5_000  # a broken sampler must fail even on a quarter of the draws
MIN_CONDITIONAL = 200  # fewer draws after an accepted d1 than this: that check is skipped
PROMPT = [84, 104, 101, 32, 113, 117, 105, 99, 107, 32]  # "The quick "

SETTINGS = {
    "T1.0": SamplingParams(1.0),
    "T0.7/k20": SamplingParams(0.7, 1.0, 20),
    "T1.3/p0.8": SamplingParams(1.3, 0.8, 0),
}
# (proposal at slot 1, proposal at slot 2) per case; "least" is the least likely token:
# probability 0 under top-k / top-p, ~1e-4 with no truncation. Slot-2 kinds rotate over the
# settings so the token after an accepted prefix meets every kind of proposal.
CASES = {
    "T1.0": [("top", "mid"), ("mid", "least"), ("least", None)],
    "T0.7/k20": [("top", "least"), ("mid", "top"), ("least", None)],
    "T1.3/p0.8": [("top", "top"), ("mid", "mid"), ("least", None)],
}

Sampler = Callable[[mx.array, mx.array, "mx.array | None", mx.array], tuple[int, int]]


# ---------------------------------------------------------------- statistics helpers


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


# ---------------------------------------------------------------- tiny target and rows


def make_tiny_target(folder: Path) -> Path:
    return tiny.make_target(Path(folder) / "target")


def target_rows(pair, tokens: list[int], params: SamplingParams, rows: int) -> np.ndarray:
    """sampling_probs for the last `rows` positions of `tokens`, one fresh forward pass."""
    cache = pair.target.make_cache()
    logits, _ = pair.target(mx.array([tokens]), cache, taps=False)
    probs = sampling_probs(logits[0, -rows:], params)
    return np.array(probs, dtype=np.float64)


def pick(row: np.ndarray, kind: str) -> int:
    """A proposal of the given kind: the likeliest, a mid-probability one, or the least likely."""
    if kind == "top":
        return int(np.argmax(row))
    if kind == "least":
        return int(np.argmin(row))
    order = np.argsort(-row)
    ranked = order[1 : max(2, int((row > 0).sum()))]  # any kept token but the top one
    return int(ranked[np.argmin(np.abs(row[ranked] - 0.05))])  # closest to p = 0.05


@dataclass
class Block:
    """Target distributions after each slot of `[last, d1, (d2)]` and the drafted ids."""

    drafted: list[int]
    probs: np.ndarray  # (γ+1, V) float64, from sampling_probs in float32


def make_block(pair, params: SamplingParams, kind1: str, kind2: str | None) -> Block:
    row0 = target_rows(pair, PROMPT, params, 1)[0]
    d1 = pick(row0, kind1)
    if kind2 is None:
        probs = target_rows(pair, PROMPT + [d1], params, 2)
        return Block([d1], probs)
    row1 = target_rows(pair, PROMPT + [d1], params, 1)[0]
    d2 = pick(row1, kind2)
    return Block([d1, d2], target_rows(pair, PROMPT + [d1, d2], params, 3))


# ---------------------------------------------------------------- drawing


@dataclass
class Draws:
    first: np.ndarray  # first emitted token of each draw
    accepted: np.ndarray  # accepted count of each draw
    second: np.ndarray  # token after an accepted slot 1 (-1 when slot 1 was rejected)
    seconds: float


def draw(sampler: Sampler, block: Block, n: int, seed: int,
         draft_q: np.ndarray | None = None) -> Draws:
    """Call `sampler` n times with independent keys.

    With `draft_q` (γ, V) the proposal of every draw is sampled from q (as the Leviathan rule
    requires) and q is passed as `draft_probs`; otherwise `block.drafted` is proposed one-hot.
    """
    gamma = len(block.drafted)
    target = mx.array(block.probs.astype(np.float32))
    q = None if draft_q is None else mx.array(draft_q.astype(np.float32))
    keys = mx.random.split(mx.random.key(seed), n)
    fixed = mx.array(block.drafted, dtype=mx.int32)
    mx.eval(target, keys, fixed, *([q] if q is not None else []))
    if draft_q is not None:
        rng = np.random.default_rng(seed)
        cdf = np.cumsum(draft_q, axis=1)
        u = rng.random((n, gamma))
        proposals = np.stack(
            [np.minimum(np.searchsorted(cdf[i], u[:, i], side="right"), draft_q.shape[1] - 1)
             for i in range(gamma)], axis=1)
    first = np.empty(n, np.int64)
    accepted = np.empty(n, np.int64)
    second = np.full(n, -1, np.int64)
    tic = time.perf_counter()
    for i in range(n):
        if draft_q is None:
            drafted, d = fixed, block.drafted
        else:
            d = proposals[i].tolist()
            drafted = mx.array(d, dtype=mx.int32)
        acc, nxt = sampler(drafted, target, q, keys[i])
        emitted = d[:acc] + [nxt]
        first[i], accepted[i] = emitted[0], acc
        if acc >= 1:
            second[i] = emitted[1]
    return Draws(first, accepted, second, time.perf_counter() - tic)


def check_draws(draws: Draws, block: Block, draft_q: np.ndarray | None = None) -> dict:
    """All checks one batch of draws supports: name -> ChiSquare."""
    out = {"first token": chi_square(draws.first, block.probs[0])}
    p0 = block.probs[0]
    if draft_q is None:
        rate = p0[block.drafted[0]]
    else:
        rate = float(np.minimum(p0, draft_q[0]).sum())  # Σ min(p, q): Leviathan's acceptance
    out["accept slot 1"] = binomial(int((draws.accepted >= 1).sum()), len(draws.accepted), rate)
    cond = draws.second[draws.accepted >= 1]
    if len(cond) >= MIN_CONDITIONAL:
        out["after accepted d1"] = chi_square(cond, block.probs[1])
    return out


def dense_q(vocab: int, gamma: int, seed: int) -> np.ndarray:
    q = np.random.default_rng(seed).dirichlet(np.full(vocab, 0.5), size=gamma)
    # float32 round trip, renormalised, so the sampler sees exactly what we sample from
    q = q.astype(np.float32).astype(np.float64)
    return q / q.sum(axis=1, keepdims=True)


# ---------------------------------------------------------------- the function-level cases


@dataclass(frozen=True)
class Case:
    name: str
    setting: str
    kinds: tuple  # (slot-1 kind, slot-2 kind or None)
    seed: int
    # Proposals sampled per draw from a dense Dirichlet q instead of one fixed id. The target
    # rows stay those of [last, top, mid]: at function level a row is just a distribution,
    # and the rule must reproduce each row whatever was proposed.
    dense: bool = False


def _function_cases() -> list[Case]:
    out = []
    for j, (setting, kinds_list) in enumerate(CASES.items()):
        for kinds in kinds_list:
            seed = 17 + 1000 * j + 100 * ("top", "mid", "least").index(kinds[0])
            out.append(Case(f"{setting} d1={kinds[0]} d2={kinds[1] or '-'}", setting, kinds, seed))
    # the general residual max(p − q, 0), with top-p zeros in p
    out.append(Case("T1.3/p0.8 dense-q", "T1.3/p0.8", ("top", "mid"), 23, dense=True))
    return out


FUNCTION_CASES = _function_cases()


def run_function_case(pair, case: Case, sampler: Sampler, n: int, seed_offset: int = 0) -> dict:
    """Draw n times with `sampler` and run every check the case supports."""
    params = SETTINGS[case.setting]
    block = make_block(pair, params, *case.kinds)
    if case.kinds[0] == "least" and (params.top_k or params.top_p < 1):
        assert block.probs[0][block.drafted[0]] == 0.0  # a truly impossible proposal
    q = dense_q(block.probs.shape[1], len(block.drafted), seed=5) if case.dense else None
    draws = draw(sampler, block, n, case.seed + seed_offset, draft_q=q)
    return check_draws(draws, block, q)


# ---------------------------------------------------------------- deliberately broken samplers


def broken_no_residual(drafted, target_probs, draft_probs, key):
    """rejection_sample whose bonus after a rejection is drawn from p, not max(p − q, 0)."""
    k_accept, k_next = mx.random.split(key)
    accepted = accept_prefix(drafted, target_probs, draft_probs, k_accept)
    dist = target_probs[accepted]  # BUG: never subtracts the draft's mass
    return accepted, mx.random.categorical(mx.log(dist), key=k_next).item()


def broken_wrong_row(drafted, target_probs, draft_probs, key):
    """rejection_sample that forgets the accepted offset: the next token always uses row 0."""
    gamma = drafted.shape[0]
    k_accept, k_next = mx.random.split(key)
    accepted = accept_prefix(drafted, target_probs, draft_probs, k_accept)
    dist = target_probs[0]  # BUG: should be target_probs[accepted]
    if accepted < gamma:
        q_row = (mx.arange(dist.shape[0]) == drafted[accepted]) if draft_probs is None \
            else draft_probs[accepted]
        residual = mx.maximum(dist - q_row, 0.0)
        total = residual.sum()
        dist = mx.where(total > 0, residual / mx.maximum(total, 1e-30), dist)
    return accepted, mx.random.categorical(mx.log(dist), key=k_next).item()


def broken_ignores_q(drafted, target_probs, draft_probs, key):
    """rejection_sample whose accept test is u < p, dropping q (wrong for a dense q only)."""
    gamma = drafted.shape[0]
    k_accept, k_next = mx.random.split(key)
    rows = mx.arange(gamma)
    p = target_probs[rows, drafted]
    u = mx.random.uniform(shape=(gamma,), key=k_accept)
    ok = (u < p).tolist()  # BUG: should be u·q(d) < p(d)
    accepted = ok.index(False) if False in ok else gamma
    dist = target_probs[accepted]
    if accepted < gamma:
        q_row = (mx.arange(dist.shape[0]) == drafted[accepted]) if draft_probs is None \
            else draft_probs[accepted]
        residual = mx.maximum(dist - q_row, 0.0)
        total = residual.sum()
        dist = mx.where(total > 0, residual / mx.maximum(total, 1e-30), dist)
    return accepted, mx.random.categorical(mx.log(dist), key=k_next).item()


# ---------------------------------------------------------------- engine-level helpers


@dataclass
class Proposals:
    ids: list[int]


class FixedDraft(DFlashDraftModel):
    """A real draft (its forward and cache bookkeeping run) whose proposals are fixed ids."""

    fixed: Proposals | None = None  # not a list: nn.Module would file a list as a child

    def propose(self, block_ids, context, cache, **kw):
        tokens, q = super().propose(block_ids, context, cache, **kw)
        if self.fixed is None:
            return tokens, q
        return mx.array(self.fixed.ids[: block_ids.shape[1] - 1], dtype=mx.uint32), q


def fixed_draft_pair(target_dir: Path, draft_dir: Path):
    return float32_pair(target_dir, draft_dir, FixedDraft)


def engine_first_tokens(pair, params: SamplingParams, proposals: list[int], n: int,
                        seed: int, block_size: int = 2) -> tuple[np.ndarray, np.ndarray, float]:
    """First emitted token and accepted count of n seeded runs sharing one Session.

    The session keeps the prompt cached, so each run costs one draft pass and one verify pass.
    """
    pair.draft.fixed = Proposals(list(proposals))
    session = Session.new(pair)
    first = np.empty(n, np.int64)
    accepted = np.empty(n, np.int64)
    tic = time.perf_counter()
    for i in range(n):
        gen = stream_generate(pair, PROMPT, block_size=block_size, max_tokens=block_size,
                              temperature=params.temperature, top_p=params.top_p,
                              top_k=params.top_k, seed=seed + i, session=session)
        ev = next(gen)
        gen.close()
        assert ev.drafted == proposals[: block_size - 1]
        first[i], accepted[i] = ev.tokens[0], ev.accepted
    return first, accepted, time.perf_counter() - tic


ENGINE_CASES = {  # setting -> (proposal kind for slot 1, runs)
    "T1.0": ("mid", 1500),
    "T0.7/k20": ("least", 1000),
    "T1.3/p0.8": ("top", 1000),
}


def engine_check(pair, setting: str, seed: int = 1000) -> tuple[dict, float]:
    params = SETTINGS[setting]
    kind, n = ENGINE_CASES[setting]
    row0 = target_rows(pair, PROMPT, params, 1)[0]
    d1 = pick(row0, kind)
    first, accepted, secs = engine_first_tokens(pair, params, [d1, d1], n, seed)
    out = {
        "first token": chi_square(first, row0),
        "accept slot 1": binomial(int((accepted >= 1).sum()), n, row0[d1]),
    }
    return out, secs


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


@pytest.mark.parametrize("case", FUNCTION_CASES, ids=[c.name for c in FUNCTION_CASES])
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


@pytest.mark.parametrize("setting", list(ENGINE_CASES))
def test_stream_generate_first_token_is_exact(engine_pair, setting):
    params = SETTINGS[setting]
    results, _ = engine_check(engine_pair, setting)
    # top-k / top-p respected: chi_square fails outright on any token outside the kept set
    assert all(r.outside == 0 for r in results.values())
    if params.top_k:
        assert (target_rows(engine_pair, PROMPT, params, 1)[0] > 0).sum() == params.top_k
    _assert_all_ok(results)


def test_padded_verify_pass_samples_exactly(engine_pair):
    """A verify pass padded wider (doctor's `pads`) leaves the sampled distribution alone."""
    engine_pair.verify_pad = {2: 8}
    try:
        results, _ = engine_check(engine_pair, "T1.0", seed=2024)
    finally:
        engine_pair.verify_pad = {}
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
