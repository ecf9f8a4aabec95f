"""Exact rollback on sliding-window targets, fail-closed for caches the engine cannot roll back,
and the version floors and registry features that depend on them."""

from __future__ import annotations

import random
import re
import tomllib
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models import qwen3
from mlx_lm.models.cache import KVCache, RotatingKVCache, make_prompt_cache
from typer.testing import CliRunner

from dflash_mlx import Session, load, registry, stream_generate, tiny
from dflash_mlx.errors import SpeculationUnsupportedError
from dflash_mlx.models.hybrid import target_for
from dflash_mlx.models.rotating import WindowCache, WindowTarget
from dflash_mlx.models.target import RollbackError, Target
from dflash_mlx.loader import pair_from_models
from support.engine import Oracle, OracleDraft, float32_pair, mlx_lm_greedy
from support.stats import chi_square
from support.tiers import slow_after

ROOT = Path(__file__).resolve().parent.parent
WINDOW = 8
FAMILIES = {
    # layers 1 and 3 global, 0 and 2 sliding (a RotatingKVCache of 8 rows)
    "gemma3": dict(model_type="gemma3_text", num_hidden_layers=4, sliding_window=WINDOW,
                   sliding_window_pattern=2, query_pre_attn_scalar=16,
                   rope_local_base_freq=10000.0),
    # sliding layers with attention sinks, 4 experts
    "gpt_oss": dict(model_type="gpt_oss", num_hidden_layers=4, sliding_window=WINDOW,
                    num_local_experts=4, num_experts_per_tok=2, intermediate_size=64,
                    layer_types=["sliding_attention", "full_attention"] * 2),
}


class NaiveTarget(Target):
    """The engine before the rollback: a RotatingKVCache trimmed by offset like a KV cache."""

    exact_caches = Target.exact_caches + (RotatingKVCache,)


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("rollback")
    draft = tiny.make_draft(root / "draft", tiny.draft_config(
        target_layers=4, dflash_config={"mask_token_id": tiny.MASK_ID, "target_layer_ids": [1, 2]}))
    targets = {name: tiny.make_target(root / name, **cfg) for name, cfg in FAMILIES.items()}
    return targets, draft


@pytest.fixture(scope="module")
def pairs(dirs):
    targets, draft = dirs
    return {name: float32_pair(t, draft, OracleDraft) for name, t in targets.items()}


def reference(model, prompt: list[int], n: int) -> list[int]:
    """mlx-lm greedy, cut after an EOS (where the engine stops)."""
    ref = mlx_lm_greedy(model, prompt, n)
    return ref[: ref.index(tiny.EOS_ID) + 1] if tiny.EOS_ID in ref else ref


def run(pair, prompt, n, block, p_wrong, seed, session=None) -> list[int]:
    """Greedy output; p_wrong None: the random draft at this device's defaults (its confidence
    cut gives verify passes of every width, one token included)."""
    pair.draft.oracle = None if p_wrong is None else Oracle(
        reference(pair.target.model, prompt, n), len(prompt), p_wrong, seed)
    gen = stream_generate(pair, prompt, block_size=block, max_tokens=n, session=session)
    return [t for e in gen for t in e.tokens]


def greedy_cases(n_prompts: int = 12):
    for s in range(n_prompts):
        rng = random.Random(s)
        prompt = [rng.randrange(256) for _ in range(rng.randint(3, 24))]
        yield s, prompt, (2, 4, 6, 8)[s % 4], (0.0, 0.3, 0.7)[s % 3]
    for s in range(n_prompts, n_prompts + 4):
        rng = random.Random(s)
        yield s, [rng.randrange(256) for _ in range(rng.randint(3, 24))], None, None


def window_rows(cache, length: int) -> list[mx.array]:
    """What the next token can attend to, in temporal order: every KV row, and the last
    `WINDOW − 1` rows of each rotating layer."""
    out = []
    for c in cache:
        if isinstance(c, RotatingKVCache):
            keys, values = c._temporal_order(c.keys), c._temporal_order(c.values)
            m = min(length, WINDOW - 1)
            out += [keys[..., keys.shape[2] - m :, :], values[..., values.shape[2] - m :, :]]
        else:
            out += [c.keys[..., :length, :], c.values[..., :length, :]]
    return out


def fresh_rows(target, tokens: list[int]) -> list[mx.array]:
    cache = target.make_cache()
    target(mx.array([tokens]), cache, taps=False)
    return window_rows(cache, len(tokens))


def rel_diff(a: list[mx.array], b: list[mx.array]) -> float:
    return max(float(mx.max(mx.abs(x - y)) / (mx.max(mx.abs(y)) + 1e-6)) for x, y in zip(a, b))


# -- greedy: token-for-token mlx-lm ----------------------------------------------------------

@pytest.mark.parametrize("family", list(FAMILIES))
def test_greedy_equals_mlx_lm_past_the_window(pairs, family):
    pair = pairs[family]
    assert isinstance(pair.target, WindowTarget)
    identical = tokens = 0
    cases = list(greedy_cases())
    for s, prompt, block, p in cases:
        out = run(pair, prompt, 48, block, p, s)
        identical += out == reference(pair.target.model, prompt, 48)
        tokens += len(out)
    print(f"\n{family}: {identical}/{len(cases)} prompts identical, {tokens} tokens, "
          f"window {WINDOW}; blocks 2/4/6/8 x oracle p_wrong 0/0.3/0.7, and 4 at the defaults")
    assert identical == len(cases)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_the_old_trim_breaks_it(dirs, family):
    """The check above can fail: trimming a wrapped RotatingKVCache by offset (the engine
    before rotating.py) gives output that differs from mlx-lm."""
    targets, draft = dirs
    pair = float32_pair(targets[family], draft, OracleDraft, NaiveTarget)
    cases = [c for c in greedy_cases() if c[3] is None]  # the defaults: passes of every width
    differ = sum(run(pair, prompt, 48, block, p, s) != reference(pair.target.model, prompt, 48)
                 for s, prompt, block, p in cases)
    print(f"\nnaive trim on {family}: {differ}/{len(cases)} prompts differ from mlx-lm")
    assert differ > 0


@pytest.mark.parametrize("family", list(FAMILIES))
def test_cache_equals_a_fresh_prefill_after_every_round(pairs, family):
    pair = pairs[family]
    prompt = list(range(40, 59))
    pair.draft.oracle = Oracle(reference(pair.target.model, prompt, 40), len(prompt), 0.4, 7)
    session = Session.new(pair)
    for ev in stream_generate(pair, prompt, block_size=5, max_tokens=40, session=session):
        tokens = session.tokens[:-1]
        assert pair.target.cache_length(session.target_cache) == len(tokens)
        assert all(c.offset == len(tokens) for c in session.target_cache)
        got = window_rows(session.target_cache, len(tokens))
        assert rel_diff(got, fresh_rows(pair.target, tokens)) < 1e-4


@pytest.mark.parametrize("kept", range(6))
def test_truncate_equals_a_call_over_the_kept_tokens(dirs, kept):
    """The same state as a call that fed only the kept tokens (wrapped window): same layout
    and counters, rows equal up to float rounding of a wider pass (a one-token pass runs
    another matmul kernel)."""
    tgt = load(dirs[0]["gemma3"], None, weights="float32").target
    prompt, block = list(range(30, 50)), [7, 8, 9, 10, 11, 12]
    c = tgt.make_cache()
    tgt(mx.array([prompt]), c, taps=False)
    tgt(mx.array([block]), c, taps=False)
    tgt.truncate(c, len(prompt) + kept)
    ref = tgt.make_cache()
    tgt(mx.array([prompt]), ref, taps=False)
    if kept:
        tgt(mx.array([block[:kept]]), ref, taps=False)
    for a, b in zip(c, ref):
        sa, sb = a.state, b.state
        assert sa[2:] == sb[2:]  # offset (and keep, max_size, _idx for rotating layers)
        rows = sa[0].shape[2] if isinstance(a, RotatingKVCache) else a.offset
        assert sa[0].shape == sb[0].shape
        assert rel_diff([x[..., :rows, :] for x in sa[:2]], [x[..., :rows, :] for x in sb[:2]]) < 1e-5


def test_an_exception_inside_a_verify_pass_is_undone_exactly(dirs):
    tgt = load(dirs[0]["gemma3"], None, weights="float32").target
    prompt = list(range(60, 80))
    cache = tgt.make_cache()
    tgt(mx.array([prompt]), cache, taps=False)
    tgt(mx.array([[5]]), cache, taps=False)  # a one-token (in-place) update too
    # copies: a one-token update writes into the cache's own arrays
    before = [(np.array(c.state[0]), np.array(c.state[1]), *c.state[2:]) for c in cache]

    class Boom:
        def __call__(self, *a, **k):
            raise KeyboardInterrupt

    for width in (1, 4):
        saved = tgt.layers[2]
        tgt.layers[2] = Boom()  # layers 0 (sliding) and 1 (global) updated, 2 and 3 not
        try:
            with pytest.raises(KeyboardInterrupt):
                tgt(mx.array([[1, 2, 3, 4][:width]]), cache, taps=False)
        finally:
            tgt.layers[2] = saved
        assert cache[0].offset == len(prompt) + 1 + width
        tgt.truncate(cache, len(prompt) + 1)
        for c, b in zip(cache, before):  # bitwise: the recorded arrays themselves
            s, rows = c.state, len(prompt) + 1
            if isinstance(c, RotatingKVCache):
                rows = s[0].shape[2]
            assert s[2:] == b[2:]
            for x, y in zip(s[:2], b[:2]):
                assert np.array_equal(np.array(x[..., :rows, :]), y[..., :rows, :])


@pytest.mark.parametrize("family", list(FAMILIES))
def test_interrupt_mid_generation_then_continue(pairs, family):
    pair = pairs[family]
    prompt = list(range(90, 102))
    pair.draft.oracle = Oracle(reference(pair.target.model, prompt, 60), len(prompt), 0.5, 3)
    session = Session.new(pair)
    gen = stream_generate(pair, prompt, block_size=6, max_tokens=60, session=session)
    for _ in range(5):
        next(gen)
    gen.close()
    tokens = session.tokens[:-1]
    assert rel_diff(window_rows(session.target_cache, len(tokens)),
                    fresh_rows(pair.target, tokens)) < 1e-4
    so_far = list(session.tokens)
    assert run(pair, so_far, 24, 4, 0.3, 5, session) == reference(pair.target.model, so_far, 24)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_multi_turn_extends_or_rewinds_exactly(pairs, family):
    pair = pairs[family]
    session = Session.new(pair)
    p1 = list(range(120, 140))
    first = run(pair, p1, 30, 5, 0.3, 1, session)
    assert first == reference(pair.target.model, p1, 30)
    # a second turn extending the whole first one reuses every cached token
    p2 = p1 + first + [65, 66, 67]
    out = run(pair, p2, 30, 4, 0.3, 2, session)
    assert out == reference(pair.target.model, p2, 30)
    # a prompt diverging inside an answer rewinds to the checkpoint after its prefill
    p3 = p2 + out[:7] + [70, 71]
    cache = session.target_cache
    assert pair.target.rewind_point(cache, len(p2) + 5) == len(p2) - 1
    events = []
    pair.draft.oracle = Oracle(reference(pair.target.model, p3, 20), len(p3), 0.3, 4)
    for ev in stream_generate(pair, p3, block_size=6, max_tokens=20, session=session):
        events.append(ev)
    assert events[0].reused_tokens == len(p2) - 1
    assert [t for e in events for t in e.tokens] == reference(pair.target.model, p3, 20)
    with pytest.raises(RollbackError, match="cannot rewind"):
        pair.target.truncate(cache, 3)  # past the window and before every checkpoint


# -- sampling: every emitted token is distributed as the target says ---------------------------

def pit_values(model, tokens: list[int], start: int, rng: np.random.Generator) -> np.ndarray:
    """Randomised PIT of tokens[start:] under mlx-lm's own distribution (T = 1): i.i.d.
    uniform on [0, 1) exactly when each token is drawn from p(· | the tokens before it)."""
    logits = model(mx.array([tokens]), cache=make_prompt_cache(model))[0].astype(mx.float32)
    rows = np.array(mx.softmax(logits, axis=-1), dtype=np.float64)[start - 1 : len(tokens) - 1]
    rows /= rows.sum(axis=1, keepdims=True)
    t = tokens[start:]
    below = np.array([r[:k].sum() for r, k in zip(rows, t)])
    return below + rng.random(len(t)) * rows[np.arange(len(t)), t]


def sample_pits(pair, runs: int, seed: int = 0) -> np.ndarray:
    """PITs of every token sampled (T = 1) in `runs` conversations of six calls sharing one
    session: 8 tokens at block 5, then 2 at block 1 (one-token updates right after rejected
    rows were dropped: where a trimmed wrapped window went wrong), three times over."""
    rng = np.random.default_rng(seed)
    pits = []
    for s in range(runs):
        prompt = [int(x) for x in rng.integers(0, 256, 10)]
        pair.draft.oracle = Oracle(reference(pair.target.model, prompt, 30), len(prompt), 0.3, s)
        session, tokens = Session.new(pair), list(prompt)
        for call, (block, n) in enumerate([(5, 8), (1, 2)] * 3):
            gen = stream_generate(pair, tokens, block_size=block, max_tokens=n, temperature=1.0,
                                  seed=1000 * s + call, session=session)
            new = [t for e in gen for t in e.tokens]
            tokens += new
            if tiny.EOS_ID in new:
                break
        pits.append(pit_values(pair.target.model, tokens, len(prompt), rng))
    return np.concatenate(pits)


@pytest.mark.parametrize("family", slow_after(list(FAMILIES), ids=list(FAMILIES)))
def test_sampled_tokens_follow_the_target_distribution(pairs, family):
    cells = np.minimum((sample_pits(pairs[family], 40) * 10).astype(int), 9)  # 10 equal bins
    res = chi_square(cells, np.full(10, 0.1))
    print(f"\n{family} sampled T=1: {res.n} tokens, PIT chi-square {res.statistic:.1f} "
          f"(dof {res.dof}), p = {res.pvalue:.3f}")
    assert res.ok, res


# -- fail closed -------------------------------------------------------------------------------

class SinkCache(KVCache):
    """A cache type the engine does not know (a subclass may keep state `trim` ignores)."""


class SinkModel(qwen3.Model):
    """A qwen3 model whose layer 3 keeps an unknown cache type."""

    def make_cache(self):
        return [SinkCache() if i == 3 else KVCache() for i in range(len(self.layers))]


def sink_model(target_dir):
    plain = load(target_dir, None, weights="float32")
    model = SinkModel(plain.target.model.args)
    model.update(plain.target.model.parameters())
    return model, plain.tokenizer


MESSAGE = ("target layer 3 uses a cache of type SinkCache, which the engine cannot roll "
           "back after a rejected draft; run it without a draft (--no-draft)")


@pytest.fixture(scope="module")
def qwen_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("sink")
    return tiny.make_target(root / "t"), tiny.make_draft(root / "d")


def test_unknown_cache_type_refuses_speculation_but_runs_ar(qwen_dirs):
    model, tok = sink_model(qwen_dirs[0])
    draft = load(*qwen_dirs, draft_bits=16, weights="float32").draft
    with pytest.raises(SpeculationUnsupportedError) as err:
        pair_from_models(model, tok, draft)
    assert str(err.value) == MESSAGE
    with pytest.raises(SpeculationUnsupportedError):
        target_for(model, [1, 2])
    pair = pair_from_models(model, tok)  # plain AR works for any cache type
    prompt = list(range(30, 45))
    session = Session.new(pair)
    out = [t for e in stream_generate(pair, prompt, block_size=1, max_tokens=12,
                                                session=session)
           for t in e.tokens]
    assert out == reference(model, prompt, 12)
    # it rewinds only to the start: a second turn re-prefills everything, exactly
    p2 = prompt[:5] + [1, 2, 3]
    events = list(stream_generate(pair, p2, block_size=1, max_tokens=8, session=session))
    assert events[0].reused_tokens == 0
    assert [t for e in events for t in e.tokens] == reference(model, p2, 8)
    with pytest.raises(RollbackError, match="layer 3"):
        pair.target.truncate(session.target_cache, 4)


def test_cli_refuses_an_unknown_cache_with_one_line(qwen_dirs, isolated_cache, monkeypatch):
    from dflash_mlx import loader
    from dflash_mlx.cli import app

    model, tok = sink_model(qwen_dirs[0])
    monkeypatch.setattr(loader, "load_target", lambda path, **kw: (model, tok))
    runner = CliRunner()
    t, d = (str(p) for p in qwen_dirs)
    r = runner.invoke(app, ["generate", "hi", "--model", t, "--draft", d, "--max-tokens", "4"])
    assert r.exit_code == 2, (r.output, r.exception)
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and MESSAGE in lines[0], r.stderr
    assert "Traceback" not in r.output
    r = runner.invoke(app, ["generate", "hi", "--model", t, "--no-draft", "--max-tokens", "4"])
    assert r.exit_code == 0, (r.output, r.exception)


def test_every_window_family_is_accepted_for_speculation(dirs):
    for name, path in dirs[0].items():
        tgt = load(path, None, weights="float32").target
        assert isinstance(tgt, WindowTarget) and tgt.unsupported == []
        assert isinstance(tgt.make_cache(), WindowCache)
        tgt.require_rollback()


# -- registry and packaging --------------------------------------------------------------------

def test_models_toml_needs_only_known_features():
    assert "sliding-window" in registry.ENGINE_FEATURES  # the rollback above
    entries = registry.read(ROOT / "models.toml")
    for e in entries.values():
        assert set(e.needs) <= registry.ENGINE_FEATURES, (e.name, e.needs)
        assert e.missing == ()


def _floor(spec: str) -> tuple[int, ...]:
    m = re.search(r">=\s*([0-9.]+)", spec)
    assert m, spec
    return tuple(int(x) for x in m.group(1).split("."))


def test_version_floors_match_the_code():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    # the registry reads models.toml with tomllib (3.11+)
    assert _floor(project["requires-python"]) >= (3, 11)
    (mlx_lm,) = [d for d in project["dependencies"] if re.match(r"mlx-lm\b", d)]
    # qwen3_5.py first ships in mlx-lm 0.30.7, and models/hybrid.py calls
    # qwen3_5.normalize_qk, first in 0.32.0 (gemma3_text and gpt_oss are older)
    assert _floor(mlx_lm) >= (0, 32, 0)
