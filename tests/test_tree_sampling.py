"""Tree speculation samples exactly: at T=1 the tokens a tree round emits follow the target's
distribution (chi-square, tests/support/stats.py), and deliberately wrong walks fail the same
checks. Function level: the round's own sampling step and walk on a real tree pass (10,000
draws); engine level: the first token of 600 seeded generations."""

from __future__ import annotations

import dflash_mlx  # noqa: F401  (first: preloads OpenBLAS before mlx)
import mlx.core as mx
import numpy as np
import pytest

from dflash_mlx import SpeculationConfig, stream_generate, tiny
from dflash_mlx.speculate import rounds as tree_round_module
from dflash_mlx.generate import Session
from dflash_mlx.models.tree import tree_forward
from dflash_mlx.speculate.sampling import SamplingParams
from dflash_mlx.speculate.tree import build_tree, walk
from support.engine import float32_pair
from support.tree import FixedSlots, FixedTreeDraft


def _draft_walk(tree, answer):
    """BROKEN: always takes the draft's best child, whatever the target drew."""
    path = [0]
    while (kids := tree.best_continuation(path[-1])[:1]):
        path.append(kids[0])
    return path, answer[path[-1]]


def _wrong_row_walk(tree, answer):
    """BROKEN: reads the root's draw at every depth."""
    path = [0]
    while (nxt := tree.child(path[-1], answer[0])) is not None:
        path.append(nxt)
    return path, answer[0]


@pytest.fixture(scope="module")
def sampling_setup(tmp_path_factory):
    from support.sampling import PROMPT, make_tiny_target, pick, target_rows

    root = tmp_path_factory.mktemp("tree-sampling")
    pair = float32_pair(make_tiny_target(root), tiny.make_draft(root / "draft"), FixedTreeDraft)
    params = SamplingParams(1.0)
    row0 = target_rows(pair, PROMPT, params, 1)[0]
    a, b = pick(row0, "top"), pick(row0, "mid")
    row_a = target_rows(pair, PROMPT + [a], params, 1)[0]
    c, e = pick(row_a, "top"), pick(row_a, "mid")
    logits = np.zeros((7, tiny.VOCAB_SIZE), np.float32)
    logits[0, [a, b]] = 6.0, 5.0
    logits[1, [c, e]] = 6.0, 5.0
    pair.draft.slots = FixedSlots(logits)
    return pair, PROMPT, row0, row_a, a


def _tree_rows(pair, prompt):
    """The round's tree (from the fixed slots) and its target rows' logits, one tree pass."""
    from dflash_mlx.speculate.proposal import slot_candidates

    cache, dcache = pair.target.make_cache(), pair.draft.make_cache()
    _, taps = pair.target(mx.array([prompt[:-1]]), cache)
    block = mx.array([[prompt[-1]] + [tiny.MASK_ID] * 2])
    ids, logp = slot_candidates(pair.draft, block, taps, dcache, 4)
    tree = build_tree(prompt[-1], ids.tolist(), logp.tolist(), 4)
    logits, _ = tree_forward(pair.target, tree.tokens, tree.depths, tree.visible(), cache)
    return tree, logits[0]


def _draw_walks(pair, prompt, walker, n: int, seed: int) -> np.ndarray:
    """(n, 3) tokens the round's own sampling step (`target_tokens`) and `walker` emit."""
    tree, logits = _tree_rows(pair, prompt)
    keys = mx.random.split(mx.random.key(seed), n)
    out = np.full((n, 3), -1, np.int64)
    for i in range(n):
        answer = tree_round_module.target_tokens(logits, SamplingParams(1.0), keys[i]).tolist()
        path, bonus = walker(tree, answer)
        emitted = [tree.tokens[r] for r in path[1:]] + [bonus]
        out[i, : len(emitted)] = emitted
    return out


def _checks(draws: np.ndarray, row0, row_a, a, min_after: int = 200) -> dict:
    from support.stats import chi_square

    out = {"first token": chi_square(draws[:, 0], row0)}
    after = draws[(draws[:, 0] == a) & (draws[:, 1] >= 0), 1]
    if len(after) >= min_after:
        out["after the first"] = chi_square(after, row_a)
    return out


def _assert_ok(results: dict):
    bad = {k: v for k, v in results.items() if not v.ok}
    assert not bad, f"tree sampling is not exact: {bad}"


def test_tree_walk_samples_exactly(sampling_setup):
    """At T=1, over 10,000 draws on a real tree pass: the first token follows the target, and
    the token after an accepted tree node follows the target's distribution after it."""
    pair, prompt, row0, row_a, a = sampling_setup
    draws = _draw_walks(pair, prompt, walk, 10_000, seed=7)
    results = _checks(draws, row0, row_a, a)
    assert "after the first" in results and (draws[:, 2] >= 0).any()  # depth 2 was reached
    _assert_ok(results)


@pytest.mark.parametrize("broken,check", [(_draft_walk, "first token"),
                                          (_wrong_row_walk, "after the first")])
def test_broken_walks_fail_the_checks(sampling_setup, broken, check):
    from support.stats import ALPHA

    pair, prompt, row0, row_a, a = sampling_setup
    results = _checks(_draw_walks(pair, prompt, broken, 5_000, seed=7), row0, row_a, a)
    assert results[check].pvalue < ALPHA


def test_stream_generate_tree_first_token_is_exact(sampling_setup):
    """The whole round at T=1 (600 seeded generations): the first token follows the target."""
    pair, prompt, row0, row_a, a = sampling_setup
    session = Session.new(pair)
    config = SpeculationConfig(block_size=3, tree=4, lookup=False)
    first = np.empty(600, np.int64)
    for i in range(len(first)):
        gen = stream_generate(pair, prompt, config, max_tokens=3, temperature=1.0,
                              seed=500 + i, session=session)
        ev = next(gen)
        gen.close()
        assert ev.tree_nodes == 4
        first[i] = ev.tokens[0]
    from support.stats import chi_square

    _assert_ok({"first token": chi_square(first, row0)})
