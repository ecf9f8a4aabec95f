"""The sampling-exactness checks of tests/test_sampling.py (also run by
scripts/chi_square_report.py): target rows of a tiny target, function-level cases drawn with
`rejection_sample` or a deliberately broken copy, and engine-level runs of `stream_generate`."""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import dflash_mlx  # noqa: F401  (first: preloads OpenBLAS before mlx)
import mlx.core as mx
import numpy as np

from dflash_mlx import Session, stream_generate, tiny
from dflash_mlx.models.dflash import DFlashDraftModel
from dflash_mlx.speculate.sampling import (SamplingParams, accept_count, rejection_sample_device,
                                          sampling_probs)
from support.engine import float32_pair, peaked
from support.stats import binomial, chi_square

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


def rejection_sample(drafted, target_probs, draft_probs, key) -> tuple[int, int]:
    """The engine's rejection sampler with its [accepted, next token] on the host."""
    accepted, nxt = rejection_sample_device(drafted, target_probs, draft_probs, key).tolist()
    return accepted, nxt


def accept_prefix(drafted, target_probs, draft_probs, key) -> int:
    return accept_count(drafted, target_probs, draft_probs, key).item()


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

    def proposal_logits(self, hidden):
        if self.fixed is None:
            return super().proposal_logits(hidden)
        slots = hidden.shape[-2]
        assert len(self.fixed.ids) >= slots, "fewer fixed proposals than drafted slots"
        return peaked(self.fixed.ids[:slots], hidden, self.config.vocab_size)


def fixed_draft_pair(target_dir: Path, draft_dir: Path):
    return float32_pair(target_dir, draft_dir, FixedDraft)


def engine_first_tokens(pair, params: SamplingParams, proposals: list[int], n: int,
                        seed: int, block_size: int = 2,
                        config=None) -> tuple[np.ndarray, np.ndarray, float]:
    """First emitted token and accepted count of n seeded runs sharing one Session.

    The session keeps the prompt cached, so each run costs one draft pass and one verify pass.
    """
    pair.draft.fixed = Proposals(list(proposals))
    session = Session.new(pair)
    first = np.empty(n, np.int64)
    accepted = np.empty(n, np.int64)
    tic = time.perf_counter()
    for i in range(n):
        gen = stream_generate(pair, PROMPT, config, block_size=block_size, max_tokens=block_size,
                              temperature=params.temperature, top_p=params.top_p,
                              top_k=params.top_k, seed=seed + i, session=session,
                              lookup=False)  # the fixed ids, verified as proposed
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


def engine_check(pair, setting: str, seed: int = 1000, config=None) -> tuple[dict, float]:
    params = SETTINGS[setting]
    kind, n = ENGINE_CASES[setting]
    row0 = target_rows(pair, PROMPT, params, 1)[0]
    d1 = pick(row0, kind)
    first, accepted, secs = engine_first_tokens(pair, params, [d1, d1], n, seed, config=config)
    out = {
        "first token": chi_square(first, row0),
        "accept slot 1": binomial(int((accepted >= 1).sum()), n, row0[d1]),
    }
    return out, secs

