"""Sampling under speculation with logits processors, min-p and a grammar: chi-square tests.

One round of a fixed two-token proposal [d1, d2] from a cached prompt, many seeds. The first
emitted token must follow the processed target distribution after the prompt; the second, on
the runs that accepted d1, the one after prompt + d1, processed with d1 in its prefix. The
expected rows come from a fresh forward pass through mlx-lm's processors and min-p, not from
the round's code. A round that processed row 1 with row 0's prefix must fail (power check).
"""

from __future__ import annotations

import math

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.sample_utils import apply_min_p

from dflash_mlx import Session, stream_generate
from dflash_mlx.speculate import rounds
from dflash_mlx.speculate.grammar import Constraint, Grammar
from dflash_mlx.speculate.processors import Processing
from dflash_mlx.speculate.sampling import SamplingParams
from support.sampling import PROMPT, Proposals, fixed_draft_pair, make_tiny_target
from support.stats import ALPHA, chi_square
from support.tiers import slow_after

N = 1500
D1 = 97  # "a": not in PROMPT; every case biases it so that most runs accept it and reach row 1
CASES = {
    "repetition 3.0": SamplingParams(1.0, processing=Processing(
        repetition_penalty=3.0, logit_bias={D1: 20.0})),
    "presence+frequency / min-p 0.05 / T0.8": SamplingParams(0.8, min_p=0.05, processing=(
        Processing(presence_penalty=2.0, frequency_penalty=1.0, logit_bias={D1: 20.0}))),
    "logit bias / top-k 30": SamplingParams(
        1.2, top_k=30, processing=Processing(logit_bias={D1: 20.0, 101: 3.0, 32: -5.0})),
}


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    from dflash_mlx import tiny

    root = tmp_path_factory.mktemp("procs")
    return fixed_draft_pair(make_tiny_target(root), tiny.make_draft(root / "draft"))


def expected_row(pair, tokens: list[int], params: SamplingParams,
                 allow: np.ndarray | None = None) -> np.ndarray:
    """The distribution after `tokens`: a fresh pass, mlx-lm's processors with the whole
    prefix, an optional grammar mask, min-p, temperature, top-k (float64 on the host)."""
    logits, _ = pair.target(mx.array([tokens]), pair.target.make_cache(), taps=False)
    row = logits[0, -1:].astype(mx.float32)
    for proc in params.processing.processors():
        row = proc(mx.array(tokens), row)
    if allow is not None:
        row = mx.where(mx.array(allow)[None], row, -mx.inf)
    if params.min_p:
        row = apply_min_p(row - mx.logsumexp(row, axis=-1, keepdims=True), params.min_p)
    x = np.array(row[0], dtype=np.float64) / params.temperature
    if params.top_k:
        x = np.where(x >= np.sort(x)[-params.top_k], x, -np.inf)
    p = np.exp(x - x.max())
    return p / p.sum()


def run(pair, params, proposals, n=N, seed=0):
    """(first tokens, second tokens of the runs that accepted d1) over n seeded rounds."""
    pair.draft.fixed = Proposals(list(proposals))
    session = Session.new(pair)
    first, second = [], []
    for i in range(n):
        gen = stream_generate(pair, PROMPT, block_size=3, max_tokens=3, session=session,
                              sampling=SamplingParams(**{**params.__dict__, "seed": seed + i}))
        ev = next(gen)
        gen.close()
        first.append(ev.tokens[0])
        if ev.accepted >= 1:
            second.append(ev.tokens[1])
    return np.array(first), np.array(second)


def pick(pair, params):
    """d1 = D1 (biased: most runs reach row 1); d2: row 1's likeliest token."""
    return D1, int(np.argmax(expected_row(pair, PROMPT + [D1], params)))


@pytest.mark.parametrize("case", slow_after(list(CASES), ids=list(CASES)))
def test_processed_rows_follow_their_own_prefix(pair, case):
    params = CASES[case]
    d1, d2 = pick(pair, params)
    first, second = run(pair, params, [d1, d2])
    r0 = chi_square(first, expected_row(pair, PROMPT, params))
    r1 = chi_square(second, expected_row(pair, PROMPT + [d1], params))
    assert len(second) > 200, "too few runs reached row 1 to test it"
    assert r0.ok, r0
    assert r1.ok, r1


def test_a_row_processed_with_the_wrong_prefix_fails(pair, monkeypatch):
    """Power: processing row 1 without d1 in its prefix must be caught by the same test."""
    params = CASES["repetition 3.0"]
    d1, d2 = pick(pair, params)
    real = rounds.process_rows
    monkeypatch.setattr(rounds, "process_rows", lambda procs, history, context, paths, logits:
                        real(procs, history, context, [paths[0]] * len(paths), logits))
    _, second = run(pair, params, [d1, d2])
    result = chi_square(second, expected_row(pair, PROMPT + [d1], params))
    assert not result.ok and result.pvalue < ALPHA, result


def test_sampling_inside_a_grammar(pair):
    """Rejection sampling against the masked target: the first token follows the grammar's
    allowed set renormalised, the second the row after d1 within its own mask."""
    params = SamplingParams(0.7, constraint=Constraint("regex", "[a-z]{2,5}"))
    grammar = Grammar(params.constraint, pair.tokenizer, sorted(pair.tokenizer.eos_token_ids),
                      pair.target.vocab_size)
    allow0 = np.array(grammar.masks([])[0])
    p0 = expected_row(pair, PROMPT, params, allow0)
    d1 = int(np.argmax(p0))
    allow1 = np.array(grammar.masks([d1])[1])
    p1 = expected_row(pair, PROMPT + [d1], params, allow1)
    first, second = run(pair, params, [d1, int(np.argmax(p1))], n=1000)
    assert chi_square(first, p0).ok and chi_square(second, p1).ok
    assert math.isclose(p0[allow0].sum(), 1.0) and (p1[~allow1] == 0).all()
