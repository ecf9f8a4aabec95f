"""Tree speculation (DDTree, issue #33) is exact.

- construction: best-first over path probability products equals brute force;
- the tree pass: every row's logits equal a plain forward over its path, float32, max abs
  difference asserted ≤ 1e-4 on the tiny qwen3 / llama / qwen2 targets (measured: 0) and with
  quantized KV caches, ≤ 1e-3 on the demo target's 30 layers (measured: 6e-5);
- greedy output equals plain mlx-lm AR over 200 generated cases (budgets 1..16, blocks 2..8,
  with and without the lookup's branch, qwen3 and llama);
- caches equal a fresh prefill after rounds, interrupts and exceptions injected in the draft
  pass, the tree pass and the compaction;
- sampling: tests/test_tree_sampling.py.
"""

from __future__ import annotations

import itertools
import math
import random

import dflash_mlx  # noqa: F401  (first: preloads OpenBLAS before mlx)
import mlx.core as mx
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from mlx_lm.models.cache import QuantizedKVCache

from dflash_mlx import SpeculationConfig, load, stream_generate, tiny
from dflash_mlx.speculate import rounds as tree_round_module
from dflash_mlx.errors import InvalidArgumentError, SpeculationUnsupportedError
from dflash_mlx.generate import Session
from dflash_mlx.models.tree import keep_rows, tree_forward
from dflash_mlx.speculate.tree import Tree, build_tree, graft, walk
from support.engine import RecordingTarget, cache_arrays, float32_pair, mlx_lm_greedy
from support.tree import RANKS, TreeOracle, TreeOracleDraft, paths

# ---------------------------------------------------------------- construction (pure)


@pytest.mark.parametrize("seed", range(30))
def test_best_first_keeps_the_likeliest_prefixes(seed):
    """The tree holds exactly the `budget` prefixes of highest probability product (brute force
    over every prefix), parents before children, distinct sibling tokens."""
    rng = random.Random(seed)
    S, K = rng.randint(1, 4), rng.randint(1, 4)
    ids = [rng.sample(range(100), K) for _ in range(S)]
    logp = [sorted((math.log(rng.random()) for _ in range(K)), reverse=True) for _ in range(S)]
    budget = rng.randint(0, 40)
    tree = build_tree(7, ids, logp, budget)
    scored = {}
    for d in range(1, S + 1):
        for ranks in itertools.product(range(K), repeat=d):
            path = tuple(ids[i][r] for i, r in enumerate(ranks))
            scored[path] = sum(logp[i][r] for i, r in enumerate(ranks))
    best = sorted(scored, key=lambda p: -scored[p])[:budget]
    assert len(tree) == 1 + min(budget, len(scored))
    assert set(paths(tree)) == set(best)
    assert tree.tokens[0] == 7 and tree.parents[0] == -1 and tree.depths[0] == 0
    for row in range(1, len(tree)):
        p = tree.parents[row]
        assert p < row and tree.depths[row] == tree.depths[p] + 1
        assert tree.tokens[row] == ids[tree.depths[row] - 1][tree.ranks[row]]
    siblings = [(tree.parents[r], tree.tokens[r]) for r in range(1, len(tree))]
    assert len(set(siblings)) == len(siblings)


def test_visible_walk_and_continuation():
    # slot 1: a (0.6), b (0.4); slot 2: c (0.9), d (0.1)
    lp = [[math.log(0.6), math.log(0.4)], [math.log(0.9), math.log(0.1)]]
    tree = build_tree(1, [[10, 11], [20, 21]], lp, 4)
    assert tree.tokens == [1, 10, 20, 11, 20] and tree.parents == [-1, 0, 1, 0, 3]
    vis = tree.visible()
    assert vis[2].tolist() == [True, True, True, False, False]
    assert vis[4].tolist() == [True, False, False, True, True]
    assert walk(tree, [11, 0, 0, 20, 5]) == ([0, 3, 4], 5)  # b, then c, then bonus 5
    assert walk(tree, [99, 0, 0, 0, 0]) == ([0], 99)
    assert tree.best_continuation(0) == [1, 2] and tree.best_continuation(3) == [4]
    assert tree.off_main([0, 1, 2]) == 0 and tree.off_main([0, 3, 4]) == 2
    assert len(build_tree(1, [[10]], [[0.0]], 0)) == 1
    grafted = graft(tree, [11, 20, 30, 31])  # shares b→c, then adds two rows
    assert grafted.tokens == tree.tokens + [30, 31] and grafted.parents[5:] == [4, 5]
    assert grafted.ranks[5:] == [-1, -1] and grafted.depths[5:] == [3, 4]
    assert graft(tree, [10, 20]) is tree and grafted.off_main([0, 3, 4, 5]) == 3


def test_config_rejects_a_negative_tree():
    with pytest.raises(InvalidArgumentError):
        SpeculationConfig(tree=-1)


# ---------------------------------------------------------------- the tree pass


def _random_tree(seed: int, root: int, S: int = 4, K: int = 3, budget: int = 16) -> Tree:
    rng = random.Random(seed)
    ids = [rng.sample(range(tiny.VOCAB_SIZE - 4), K) for _ in range(S)]
    logp = [sorted((math.log(rng.random()) for _ in range(K)), reverse=True) for _ in range(S)]
    return build_tree(root, ids, logp, budget)


def _path_logits_gap(target, ctx: list[int], tree: Tree, make_cache) -> float:
    """Max abs difference between the tree pass and plain forwards over each leaf's path (whose
    rows hold every ancestor's logits too)."""
    cache = make_cache()
    target(mx.array([ctx[:-1]]), cache, taps=False)
    logits, _ = tree_forward(target, tree.tokens, tree.depths, tree.visible(), cache, taps=False)
    gap = 0.0
    for leaf in set(range(len(tree))) - set(tree.parents):
        rows = [leaf]
        while rows[-1]:
            rows.append(tree.parents[rows[-1]])
        rows.reverse()
        path = [tree.tokens[r] for r in rows[1:]]
        ref, _ = target(mx.array([ctx + path]), make_cache(), taps=False)
        ref = ref[0, len(ctx) - 1:]
        gap = max(gap, mx.abs(ref - logits[0, mx.array(rows)]).max().item())
    return gap


@pytest.mark.parametrize("arch", ["qwen3", "llama", "qwen2"])
def test_tree_logits_equal_path_forwards(tmp_path, arch):
    pair = load(tiny.make_target(tmp_path / arch, model_type=arch), None, weights="float32")
    ctx = list(range(30, 47))
    for seed in range(3):
        tree = _random_tree(seed, ctx[-1])
        assert _path_logits_gap(pair.target, ctx, tree, pair.target.make_cache) <= 1e-4


def test_quantized_kv_tree_pass_and_compaction(tmp_path):
    """QuantizedKVCache: same logits as path forwards, and after compaction the cache equals a
    quantized prefill of the context and the kept path."""
    t = tiny.make_target(tmp_path / "t", head_dim=32)
    pair = load(t, None, weights="float32")
    n_layers = pair.target.num_layers

    def qcache():
        return [QuantizedKVCache(group_size=32, bits=8) for _ in range(n_layers)]

    ctx = list(range(60, 71))
    tree = _random_tree(4, ctx[-1], S=3, K=3, budget=9)
    assert _path_logits_gap(pair.target, ctx, tree, qcache) <= 1e-4
    cache = qcache()
    base = len(ctx) - 1
    pair.target(mx.array([ctx[:-1]]), cache, taps=False)
    tree_forward(pair.target, tree.tokens, tree.depths, tree.visible(), cache, taps=False)
    rows = [0] + [r for r in range(1, len(tree)) if tree.ranks[r] > 0][:1]
    while (kids := [r for r in range(len(tree)) if tree.parents[r] == rows[-1]]):
        rows.append(kids[-1])  # a path that needs moving: not the first rows
    src = mx.array([base + r for r in rows])
    written = [[a[..., src, :] for a in c.keys + c.values] for c in cache]
    mx.eval(written)
    keep_rows(cache, base, rows)
    pair.target.truncate(cache, base + len(rows))
    fresh = qcache()
    pair.target(mx.array([ctx + [tree.tokens[r] for r in rows[1:]]]), fresh, taps=False)
    n = base + len(rows)
    for c, f, moved in zip(cache, fresh, written):
        assert c.offset == f.offset == n
        # compaction only moves data: bit for bit the rows the tree pass wrote, in path order
        for a, m in zip(c.keys + c.values, moved):
            assert mx.array_equal(a[..., base:n, :], m).item()
        # a fresh prefill agrees up to one quantization step: a BLAS may round a pass of
        # another width differently in the last bit, which can tip an 8-bit rounding
        for got, want in ((c.keys, f.keys), (c.values, f.values)):
            a, b = (mx.dequantize(*(x[..., :n, :] for x in t), group_size=32, bits=8)
                    for t in (got, want))
            step = mx.max(want[1][..., :n, :]).item()
            assert mx.max(mx.abs(a - b)).item() <= 1.01 * step + 1e-6


@pytest.fixture(scope="module")
def demo():
    from dflash_mlx.chat import apply_template
    from dflash_mlx.registry import default_pair

    pair = load(*default_pair())  # float32 on the CPU device
    return pair, apply_template(pair.tokenizer, [{"role": "user", "content": "Write a haiku."}])


@pytest.mark.demo
def test_demo_target_tree_logits(demo):
    """The real SmolLM2 target (llama, rope_traditional) with the demo draft's own tree."""
    from dflash_mlx.speculate.proposal import slot_candidates

    pair, ctx = demo
    cache = pair.target.make_cache()
    _, taps = pair.target(mx.array([ctx[:-1]]), cache)
    block = mx.array([[ctx[-1]] + [pair.draft.config.mask_token_id] * 4])
    ids, logp = slot_candidates(pair.draft, block, taps, pair.draft.make_cache(), 8)
    tree = build_tree(ctx[-1], ids.tolist(), logp.tolist(), 16)
    assert len(tree) == 17
    assert _path_logits_gap(pair.target, ctx, tree, pair.target.make_cache) <= 1e-3


@pytest.mark.demo
def test_demo_pair_tree_output_equals_ar(demo):
    pair, ctx = demo
    ar = [t for e in stream_generate(pair, ctx, SpeculationConfig(block_size=1), max_tokens=24)
          for t in e.tokens]
    events = list(stream_generate(pair, ctx, SpeculationConfig(tree=16), max_tokens=24))
    assert [t for e in events for t in e.tokens] == ar
    assert len(events) < len(ar) and all(e.tree_nodes >= 16 for e in events[:-1])


def test_unsupported_pairs_keep_one_path(tmp_path):
    """Hybrid (GatedDeltaNet) targets and DFlash 2 drafts: a one-line note, one path per
    round, the same output; the tree pass itself refuses them and sliding-window targets."""
    d = tiny.make_draft(tmp_path / "d")
    for pair in (load(tiny.make_hybrid_target(tmp_path / "h"), d, weights="float32"),
                 load(tiny.make_target(tmp_path / "t"), tiny.make_dflash2_draft(tmp_path / "d2"),
                      draft_bits=16, weights="float32")):
        prompt = list(range(20, 32))
        plain = list(stream_generate(pair, prompt, SpeculationConfig(), max_tokens=12))
        events = list(stream_generate(pair, prompt, SpeculationConfig(tree=8), max_tokens=12))
        assert events[0].note.startswith("--tree is not available") and "\n" not in events[0].note
        assert all(e.tree_nodes == 0 for e in events)
        assert [t for e in events for t in e.tokens] == [t for e in plain for t in e.tokens]
    sliding = tiny.make_target(tmp_path / "s", model_type="llama", sliding_window=8,
                               layer_types=["sliding_attention", "full_attention"] * 3)
    for target in (load(tiny.make_hybrid_target(tmp_path / "h2"), None, weights="float32").target,
                   load(sliding, None, weights="float32").target):
        with pytest.raises(SpeculationUnsupportedError, match="tree speculation does not"):
            tree_forward(target, [1, 2], [0, 1], np.ones((2, 2), bool), target.make_cache())


def test_cli_tree_option(tiny, isolated_cache, tmp_path):
    """`generate --tree N`: per-round tree lines with --verbose, a summary line, the events
    file's fields; a negative N is one line and exit 2."""
    import json

    from typer.testing import CliRunner

    from dflash_mlx.cli import app

    def gen(*args):
        return CliRunner().invoke(app, ["generate", "Hi", "--model", str(tiny.target), "--draft",
                                        str(tiny.draft), "--no-lookup", *map(str, args)])

    events = tmp_path / "e.jsonl"
    r = gen("--max-tokens", 6, "--block-size", 3, "--tree", 4, "--verbose", "--events", events)
    assert r.exit_code == 0, r.output
    rounds = [ln for ln in r.stderr.splitlines() if ln.startswith("#")]
    assert "tree 4, 0 branch" in rounds[0] and "Tree: 4 nodes per round" in r.stderr
    rows = [json.loads(ln) for ln in events.read_text().splitlines()]
    assert rows[0]["tree_nodes"] == 4 and rows[-1]["tree"] == 4
    assert rows[-1]["stats"]["tree_rounds"] >= 1
    bad = gen("--tree", -1)
    assert bad.exit_code == 2 and "--tree" in bad.stderr and len(bad.stderr.splitlines()) == 1


# ---------------------------------------------------------------- greedy exactness


@pytest.fixture(scope="module", params=["qwen3", "llama"])
def oracle_pair(request, tmp_path_factory):
    root = tmp_path_factory.mktemp(f"tree-{request.param}")
    t = tiny.make_target(root / "target", model_type=request.param)
    return float32_pair(t, tiny.make_draft(root / "draft"), TreeOracleDraft, RecordingTarget)


def _reference(pair, prompt, n):
    raw = mlx_lm_greedy(pair.target.model, prompt, n)
    return raw, raw[: raw.index(tiny.EOS_ID) + 1] if tiny.EOS_ID in raw else raw


@settings(max_examples=100, deadline=None, suppress_health_check=list(HealthCheck))
@given(seed=st.integers(0, 2**31 - 1), budget=st.sampled_from([1, 2, 4, 8, 16]),
       block=st.integers(2, 8), ranks=st.sampled_from(sorted(RANKS)), lookup=st.booleans())
def test_greedy_tree_equals_ar(oracle_pair, seed, budget, block, ranks, lookup):
    """Output equals mlx-lm greedy; each round verifies ≤ budget nodes (plus the lookup's
    branch) in one pass of that width; accepted tokens are a prefix of the reported path."""
    pair = oracle_pair
    rng = random.Random(seed)
    prompt = [rng.randrange(tiny.VOCAB_SIZE - 4) for _ in range(rng.randint(1, 24))]
    n = rng.randint(1, 24)
    raw, reference = _reference(pair, prompt, n)
    pair.draft.oracle = TreeOracle(raw, len(prompt), RANKS[ranks], seed)
    pair.target.passes.clear()
    config = SpeculationConfig(block_size=block, tree=budget, lookup=lookup)
    events = list(stream_generate(pair, prompt, config, max_tokens=n))
    assert [t for e in events for t in e.tokens] == reference
    passes = pair.target.passes[-len(events):]
    for ev, logits in zip(events, passes):
        assert 0 <= ev.tree_nodes <= budget + lookup * (block - 1)
        assert logits.shape[0] == 1 + ev.tree_nodes
        assert ev.tokens[: ev.accepted] == ev.drafted[: min(ev.accepted, len(ev.tokens))]
        assert ev.branch_tokens <= ev.accepted
        if not lookup:
            assert not ev.lookup_flags
    if ranks == "sure" and not lookup:  # the first node is always the draft's top slot-1 guess
        assert all(e.accepted >= 1 and e.branch_tokens == 0 for e in events if e.tree_nodes)


def test_branches_pay_where_the_draft_is_second_best(oracle_pair):
    """The reference always the draft's 2nd guess: a one-node tree (the argmax) accepts
    nothing, a wider one does, and every token it accepts comes off the argmax path."""
    pair = oracle_pair
    prompt = list(range(50, 62))
    raw, reference = _reference(pair, prompt, 24)
    taus = {}
    for budget in (1, 16):
        pair.draft.oracle = TreeOracle(raw, len(prompt), RANKS["second"], 3)
        config = SpeculationConfig(block_size=4, tree=budget, lookup=False)
        events = list(stream_generate(pair, prompt, config, max_tokens=24))
        assert [t for e in events for t in e.tokens] == reference
        taus[budget] = len(reference) / len(events)
        assert sum(e.branch_tokens for e in events) == sum(e.accepted for e in events)
    assert taus[1] == 1.0 and taus[16] > 1.5


def test_lookup_branch_is_verified_in_the_tree(oracle_pair):
    """A draft that never guesses right: what the tree accepts comes from the context lookup's
    branch, flagged as such, and the output is still AR's."""
    pair = oracle_pair
    prompt = [7, 8, 9] * 6  # tiny random targets fall into loops the lookup then follows
    raw, reference = _reference(pair, prompt, 32)
    pair.draft.oracle = TreeOracle(raw, len(prompt), RANKS["never"], 5)
    events = list(stream_generate(pair, prompt, SpeculationConfig(block_size=5, tree=4),
                                  max_tokens=32))
    assert [t for e in events for t in e.tokens] == reference
    looked = sum(f and ok for e in events for f, ok in zip(e.lookup_flags, e.accept_flags))
    assert looked == sum(e.accepted for e in events) > 0


# ---------------------------------------------------------------- caches


def _assert_cache_equals_prefill(pair, session: Session):
    n = len(session.tokens) - 1
    assert pair.target.cache_length(session.target_cache) == n
    fresh = pair.target.make_cache()
    pair.target(mx.array([session.tokens[:-1]]), fresh, taps=False)
    for (k1, v1), (k2, v2) in zip(cache_arrays(session.target_cache, n), cache_arrays(fresh, n)):
        assert k1.shape == k2.shape
        assert mx.allclose(k1, k2, atol=1e-4).item() and mx.allclose(v1, v2, atol=1e-4).item()
    pending = 0 if session.pending is None else session.pending.shape[1]
    assert session.draft_cache[0].offset + pending == n


@pytest.mark.parametrize("stop_after", [1, 3, 6])
def test_cache_exact_after_tree_rounds_and_close(oracle_pair, stop_after):
    pair = oracle_pair
    prompt = list(range(100, 117))
    raw, reference = _reference(pair, prompt, 40)
    pair.draft.oracle = TreeOracle(raw, len(prompt), RANKS["mixed"], stop_after)
    session = Session.new(pair)
    config = SpeculationConfig(block_size=5, tree=8)
    gen = stream_generate(pair, prompt, config, max_tokens=40, session=session)
    for i, _ in enumerate(gen):
        if i + 1 == stop_after:
            break
    gen.close()
    _assert_cache_equals_prefill(pair, session)
    done = len(session.tokens) - len(prompt)
    more = [t for e in stream_generate(pair, session.tokens, config, max_tokens=6,
                                       session=session) for t in e.tokens]
    assert more == reference[done: done + 6]
    _assert_cache_equals_prefill(pair, session)


@pytest.mark.parametrize("where", ["target pass", "compaction", "draft pass"])
def test_exception_mid_round_leaves_caches_exact(oracle_pair, monkeypatch, where):
    pair = oracle_pair
    prompt = list(range(30, 45))
    raw, reference = _reference(pair, prompt, 30)
    pair.draft.oracle = TreeOracle(raw, len(prompt), RANKS["mixed"], 11)
    calls = {"n": 0}

    def third(real):
        def flaky(*a, **k):
            calls["n"] += 1
            out = real(*a, **k)
            if calls["n"] == 3:  # two rounds succeed, the third dies after the work began
                raise KeyboardInterrupt
            return out
        return flaky

    if where == "target pass":
        monkeypatch.setattr(tree_round_module, "tree_forward", third(tree_forward))
    elif where == "draft pass":
        monkeypatch.setattr(tree_round_module, "slot_candidates",
                            third(tree_round_module.slot_candidates))
    else:
        def half(cache, base, rows):  # the third call moves rows in half the layers, then dies
            calls["n"] += 1
            if calls["n"] == 3:
                keep_rows(cache[: len(cache) // 2], base, list(reversed(rows)))
                raise KeyboardInterrupt
            keep_rows(cache, base, rows)
        monkeypatch.setattr(tree_round_module, "keep_rows", half)
    session = Session.new(pair)
    config = SpeculationConfig(block_size=5, tree=8)
    with pytest.raises(KeyboardInterrupt):
        for _ in stream_generate(pair, prompt, config, max_tokens=30, session=session):
            pass
    _assert_cache_equals_prefill(pair, session)
    monkeypatch.undo()
    done = len(session.tokens) - len(prompt)
    assert session.tokens[len(prompt):] == reference[:done]
    more = [t for e in stream_generate(pair, session.tokens, config, max_tokens=8,
                                       session=session) for t in e.tokens]
    assert more == reference[done: done + 8]
    _assert_cache_equals_prefill(pair, session)
