"""Hybrid qwen3_5 targets (GatedDeltaNet + attention): exact rollback, invariants, sampling."""

from __future__ import annotations

import random

import mlx.core as mx
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from mlx_lm.generate import generate_step
from mlx_lm.models import qwen3_5
from mlx_lm.models.cache import ArraysCache, KVCache

from dflash_mlx import SpeculationConfig, load, stream_generate, tiny
from dflash_mlx.generate import Session
from dflash_mlx.models.hybrid import HybridCache, HybridTarget, RollbackError, _CapturingGDN
from dflash_mlx.models.target import Target
from dflash_mlx.speculate.sampling import SamplingParams, sampling_probs
from support.engine import PositionedDraft, Recording, float32_pair, peaked
from support.stats import pooled_chisquare

V = tiny.VOCAB_SIZE


class Script:
    def __init__(self, reference: list[int], prompt_len: int, pattern: list[int]):
        self.reference, self.prompt_len, self.pattern, self.rounds = (
            reference, prompt_len, pattern, 0)


class ScriptedDraft(PositionedDraft):
    """A real draft (its forward and cache run) whose tokens follow a script.

    The script is the target's own greedy continuation with slot `k+1` corrupted, where `k`
    is the accept count wanted this round: every accept pattern happens on demand.
    """

    script: Script | None = None

    def proposal_logits(self, hidden):
        real = super().proposal_logits(hidden)
        mx.eval(real)  # run the real forward, as the engine would (it materialises the cache)
        s = self.script
        want = s.pattern[s.rounds % len(s.pattern)]
        s.rounds += 1
        out = []
        for i in range(1, hidden.shape[-2] + 1):
            j = self.pos + i - s.prompt_len
            tok = s.reference[j] if 0 <= j < len(s.reference) else 0
            out.append((tok + 1) % 256 if i == want + 1 else tok)
        return peaked(out, hidden, self.config.vocab_size)


class RecordingHybrid(Recording, HybridTarget):
    pass


def mlx_lm_greedy(model, prompt, n):
    out = []
    for tok, _ in generate_step(mx.array(prompt), model, max_tokens=n,
                                sampler=lambda x: mx.argmax(x, axis=-1)):
        out.append(int(tok))
    return out


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("hybrid")
    return tiny.make_hybrid_target(root / "t"), tiny.make_draft(root / "d")


@pytest.fixture(scope="module")
def pair(dirs):
    return float32_pair(*dirs, ScriptedDraft, RecordingHybrid)


def state_of(cache, length):
    out = []
    for c in cache:
        if isinstance(c, ArraysCache):
            out += [c[0], c[1]]
        else:
            assert c.offset == length
            out += [c.keys[..., :length, :], c.values[..., :length, :]]
    return out


def fresh_state(target, tokens):
    """A fresh prefill of `tokens` by the plain mlx-lm model (no wrapper, no capture)."""
    cache = target.model.make_cache()
    target.model(mx.array([tokens]), cache=cache)
    return state_of(cache, len(tokens))


def rel_diff(a, b):
    """max |a − b| / max(1, max |b|) over the arrays: float32 prefill-vs-incremental noise
    (BLAS blocking differs with the row count) is ~1e-5; a wrong rollback step is ~1e-1."""
    assert len(a) == len(b) and all(x.shape == y.shape for x, y in zip(a, b))
    return mx.stack([mx.abs(x - y).max() / mx.maximum(mx.abs(y).max(), 1.0)
                     for x, y in zip(a, b)]).max().item()


def max_diff(a, b):
    assert len(a) == len(b) and all(x.shape == y.shape for x, y in zip(a, b))
    return mx.stack([mx.abs(x - y).max() for x, y in zip(a, b)]).max().item()


# -- structure ----------------------------------------------------------------------------

def test_dispatch_and_layer_structure(dirs, tmp_path):
    p = load(dirs[0], None, weights="float32")
    assert type(p.target) is HybridTarget
    linear = [i for i, layer in enumerate(p.target.layers) if layer.is_linear]
    assert [i for i, _ in p.target.gdn_layers] == linear == [0, 1, 3, 4]
    assert isinstance(p.target.make_cache(), HybridCache)
    plain = load(tiny.make_target(tmp_path / "q3"), None, weights="float32")
    assert type(plain.target) is Target
    # taps are the outputs of the listed layers, GatedDeltaNet or attention alike
    p.target.set_taps([1, 2, 5])
    _, taps = p.target(mx.array([[3, 4, 5]]), p.target.make_cache())
    assert taps.shape == (1, 3, 3 * 64)


@pytest.mark.parametrize("width", [1, 5, 80])
def test_capturing_stand_in_is_bit_identical_to_mlx_lm(dirs, width):
    """The stand-in computes exactly what qwen3_5.GatedDeltaNet computes (output and cache)."""
    p = load(dirs[0], None, weights="float32")
    gdn = p.target.layers[0].linear_attn
    assert isinstance(gdn, qwen3_5.GatedDeltaNet)
    mx.random.seed(width)
    warm = mx.random.normal((1, 7, 64))
    x = mx.random.normal((1, width, 64))
    for warmed in (False, True):
        a, b = ArraysCache(2), ArraysCache(2)
        if warmed:
            gdn(warm, None, a), gdn(warm, None, b)
        store = []
        out_ref = gdn(x, None, a)
        out = _CapturingGDN(gdn, store, full=True)(x, None, b)
        assert mx.array_equal(out, out_ref)
        assert mx.array_equal(a[0], b[0]) and mx.array_equal(a[1], b[1])
        assert len(store) == 1 and store[0].width == width


def test_replay_is_the_stepwise_recurrence(dirs):
    """Rollback to n steps = the recurrence run one step at a time on the same inputs."""
    p = load(dirs[0], None, weights="float32")
    tgt = p.target
    cache = tgt.make_cache()
    tgt(mx.array([list(range(10, 22))]), cache, taps=False)
    W = 6
    block = [40, 41, 42, 43, 44, 45]
    for n in range(W + 1):
        c = tgt.make_cache()
        tgt(mx.array([list(range(10, 22))]), c, taps=False)
        tgt(mx.array([block]), c, taps=False)
        caps = c.captures
        steps = [(cap.steps, cap.state0, cap.conv_input) for cap in caps]
        tgt.truncate(c, 12 + n)
        for (i, layer), (inputs, state0, conv_input) in zip(tgt.gdn_layers, steps):
            q, k, v, a, b, _ = inputs
            m = layer.linear_attn
            state = state0
            for t in range(n):
                _, state = qwen3_5.gated_delta_update(
                    q[:, t:t + 1], k[:, t:t + 1], v[:, t:t + 1], a[:, t:t + 1], b[:, t:t + 1],
                    m.A_log, m.dt_bias, state)
            assert mx.array_equal(c[i][1], state), f"layer {i}, n={n}"
            assert mx.array_equal(c[i][0], conv_input[:, n:n + 3])
        assert c.length == 12 + n and c[2].offset == 12 + n


def test_invariants_are_asserted(dirs):
    p = load(dirs[0], None, weights="float32")
    tgt = p.target
    cache = tgt.make_cache()
    tgt(mx.array([[1, 2, 3]]), cache, taps=False)
    tgt(mx.array([[4, 5]]), cache, taps=False)
    cache.captures.pop()
    with pytest.raises(RollbackError, match="3 GatedDeltaNet captures for 4"):
        tgt._check(cache)
    tgt(mx.array([[6, 7]]), cache, taps=False)
    cache.captures[1].state0 = cache.captures[1].state0[:, :1]
    with pytest.raises(RollbackError, match="changed shape"):
        tgt._check(cache)
    with pytest.raises(RollbackError, match="own cache"):
        tgt(mx.array([[1]]), tgt.model.make_cache())


# -- exact rollback in the decode loop ----------------------------------------------------

def _script(pair, prompt, n, pattern, block):
    """Point the scripted draft at the target's greedy continuation; return its first n."""
    ref = mlx_lm_greedy(pair.target.model, prompt, n + block)
    pair.draft.script = Script(ref, len(prompt), pattern)
    pair.target.passes.clear()
    ref = ref[:n]
    return ref[: ref.index(tiny.EOS_ID) + 1] if tiny.EOS_ID in ref else ref  # the engine stops


@settings(max_examples=15, deadline=None, suppress_health_check=list(HealthCheck))
@given(
    seed=st.integers(0, 2**31 - 1),
    block=st.integers(2, 7),
    pattern=st.lists(st.integers(0, 6), min_size=1, max_size=6),
)
def test_rollback_after_any_accept_pattern_equals_fresh_prefill(pair, seed, block, pattern):
    rng = random.Random(seed)
    prompt = [rng.randrange(250) for _ in range(rng.randint(1, 20))]
    n = rng.randint(1, 20)
    reference = _script(pair, prompt, n, pattern, block)
    session = Session.new(pair)
    # lookup off: the script's blocks are verified as proposed, so its accept counts happen
    gen = stream_generate(pair, prompt, SpeculationConfig.for_pair(pair, adaptive=False),
                          block_size=block, max_tokens=n, session=session, lookup=False)
    passes = pair.target.passes
    events = []
    for ev in gen:
        events.append(ev)
        want = pattern[(len(events) - 1) % len(pattern)]
        if ev.finish_reason is None:
            assert ev.accepted == min(want, len(ev.drafted))
        # the target cache now holds exactly the emitted tokens minus the last
        tokens = session.tokens[:-1]
        assert session.target_cache.length == len(tokens)
        got = state_of(session.target_cache, len(tokens))
        assert rel_diff(got, fresh_state(pair.target, tokens)) < 2e-4
        # greedy invariant: every emitted token is the argmax of the pass that verified it
        argmax = mx.argmax(passes[-1], axis=-1).tolist()
        assert ev.tokens == (ev.drafted[: ev.accepted] + [argmax[ev.accepted]])[: len(ev.tokens)]
        assert ev.tokens == argmax[: len(ev.tokens)]
        # draft cache + pending taps cover the same positions as the target cache
        pending = 0 if session.pending is None else session.pending.shape[1]
        assert session.draft_cache[0].offset + pending == len(tokens)
    assert [t for e in events for t in e.tokens] == reference


def test_rollback_state_equals_the_prefix_pass(dirs):
    """After keeping n of W verify steps, the state equals a pass over just those n tokens."""
    p = load(dirs[0], None, weights="float32")
    tgt, prompt, block = p.target, list(range(30, 50)), [7, 8, 9, 10, 11, 12]
    diffs = []
    for n in range(len(block) + 1):
        c = tgt.make_cache()
        tgt(mx.array([prompt]), c, taps=False)
        tgt(mx.array([block]), c, taps=False)
        tgt.truncate(c, len(prompt) + n)
        ref = tgt.make_cache()
        tgt(mx.array([prompt]), ref, taps=False)
        if n:
            tgt(mx.array([block[:n]]), ref, taps=False)
        diffs.append(max_diff(state_of(c, len(prompt) + n), state_of(ref, len(prompt) + n)))
    print(f"\nrollback vs prefix pass, max |diff| per kept steps 0..6: {diffs}")
    assert max(diffs) < 1e-5  # bitwise (0.0) with both the bundled BLAS and OpenBLAS here


def test_interrupted_verify_leaves_the_cache_exact(dirs):
    p = load(dirs[0], None, weights="float32")
    tgt, prompt = p.target, list(range(60, 75))
    cache = tgt.make_cache()
    tgt(mx.array([prompt]), cache, taps=False)
    mx.eval([c.state for c in cache])
    before = state_of(cache, len(prompt))

    class Boom:
        is_linear = True

        def __call__(self, *a, **k):
            raise KeyboardInterrupt

    saved = tgt.layers[4]
    tgt.layers[4] = Boom()  # GatedDeltaNet 0, 1, 3 and attention 2 ran; 4 and 5 never did
    try:
        with pytest.raises(KeyboardInterrupt):
            tgt(mx.array([[1, 2, 3, 4]]), cache, taps=False)
    finally:
        tgt.layers[4] = saved
    assert len(cache.captures) == 3 and not cache.complete
    assert "linear_attn" in tgt.layers[0] and not isinstance(tgt.layers[0].linear_attn, _CapturingGDN)
    tgt.truncate(cache, len(prompt))
    assert all(mx.array_equal(a, b) for a, b in zip(state_of(cache, len(prompt)), before))


def test_closing_the_generator_mid_round_keeps_the_cache_exact(pair):
    prompt = list(range(100, 112))
    _script(pair, prompt, 30, [2, 0, 5], 6)
    session = Session.new(pair)
    gen = stream_generate(pair, prompt, block_size=6, max_tokens=30, session=session)
    next(gen), next(gen)
    gen.close()
    tokens = session.tokens[:-1]
    assert rel_diff(state_of(session.target_cache, len(tokens)),
                    fresh_state(pair.target, tokens)) < 2e-4


def test_multi_turn_rewinds_to_a_checkpoint_or_the_start(pair):
    """Session reuse on a hybrid target: rewinds land on a checkpoint (or 0), then re-prefill."""
    p1 = list(range(120, 140))
    _script(pair, p1, 12, [1, 3], 4)
    session = Session.new(pair)
    first = [t for e in stream_generate(pair, p1, block_size=4, max_tokens=12, session=session)
             for t in e.tokens]
    cache = session.target_cache
    assert cache.saved[0] == len(p1) - 1  # checkpoint at the end of the prompt's prefill
    # the second prompt shares the first prompt and diverges inside the answer
    p2 = p1 + first[:5] + [9, 9, 9]
    assert pair.target.rewind_point(cache, len(p1) + 4) == len(p1) - 1
    _script(pair, p2, 8, [2], 4)
    events = list(stream_generate(pair, p2, block_size=4, max_tokens=8, session=session))
    assert events[0].reused_tokens == len(p1) - 1
    assert events[0].prompt_tokens == len(p2) - len(p1)
    tokens = session.tokens[:-1]
    assert rel_diff(state_of(cache, len(tokens)), fresh_state(pair.target, tokens)) < 2e-4
    assert [t for e in events for t in e.tokens] == mlx_lm_greedy(pair.target.model, p2, 8)
    # a prompt diverging before every checkpoint starts over
    p3 = [1, 2, 3] + p2
    _script(pair, p3, 4, [0], 4)
    events = list(stream_generate(pair, p3, block_size=4, max_tokens=4, session=session))
    assert events[0].reused_tokens == 0
    assert [t for e in events for t in e.tokens] == mlx_lm_greedy(pair.target.model, p3, 4)
    # direct truncation to a length nothing can reproduce is refused
    with pytest.raises(RollbackError, match="cannot rewind"):
        pair.target.truncate(cache, 5)


def test_memory_is_flat_over_100_rounds(pair):
    prompt = list(range(10, 30))
    config = SpeculationConfig.for_pair(pair, draft_window=16)  # bound the draft's cache too
    eos = pair.tokenizer._eos_token_ids
    pair.tokenizer._eos_token_ids = set()  # 100 rounds, whatever the random target says
    try:
        _script(pair, prompt, 120, [0, 1, 0, 2], 4)
        session = Session.new(pair, config)
        gen = stream_generate(pair, prompt, config, block_size=4, max_tokens=200,
                              session=session)
        mem = []
        for r, ev in enumerate(gen):
            mx.eval([c.state for c in session.target_cache])
            pair.target.passes.clear()  # the test's own record, not the engine's
            if r in (9, 19, 99):
                mx.clear_cache()
                mem.append(mx.get_active_memory())
            if r == 99:
                gen.close()
                break
        assert session.target_cache.captures is None  # consumed by the rollback
        assert all(c.size() <= 16 for c in session.draft_cache)
        assert len(mem) == 3
        print(f"\nactive memory after rounds 10/20/100: {mem}")
        # the KV cache grows in 256-token steps; 20 + ≤ 200 tokens stay inside one step
        assert mem[2] - mem[0] < 64 * 1024
    finally:
        pair.tokenizer._eos_token_ids = eos


# -- sampling: chi-square through stream_generate ----------------------------------------

@pytest.mark.slow
def test_sampling_on_a_hybrid_target_matches_the_target(tmp_path):
    """DFlash 2 draft + hybrid target at T>0: first two emitted tokens follow the target."""
    from support.dflash2 import MASK, PROMPT, T, V as SV

    t = tiny.make_hybrid_target(tmp_path / "t", vocab_size=SV, eos_token_id=None)
    cfg = tiny.dflash2_config(vocab_size=SV, block_size=3, top_k=8,
                              dflash_config={"mask_token_id": MASK})
    pr = load(t, tiny.make_dflash2_draft(tmp_path / "d", cfg), draft_bits=16, weights="float32")
    params = SamplingParams(T)
    p0 = np.array(sampling_probs(pr.target.model(mx.array([PROMPT]))[0, -1], params))
    p1 = np.array(sampling_probs(pr.target.model(mx.array([PROMPT + [a] for a in range(SV)]))[:, -1],
                                 params))
    n = 800
    first, second, accepted = np.zeros(SV), np.zeros(SV), 0
    session = Session.new(pr)
    for seed in range(n):
        events = list(stream_generate(pr, PROMPT, block_size=3, max_tokens=2, temperature=T,
                                      seed=seed, session=session))
        toks = [t for e in events for t in e.tokens]
        first[toks[0]] += 1
        second[toks[1]] += 1
        accepted += sum(e.accepted for e in events)
    r1 = pooled_chisquare(first, p0 * n)
    r2 = pooled_chisquare(second, (p0 @ p1) * n)
    print(f"\nhybrid + DFlash2 e2e: {n} runs, {accepted} accepted drafts; "
          f"token1 chi2={r1[0]:.2f} p={r1[1]:.4f}; token2 chi2={r2[0]:.2f} p={r2[1]:.4f}")
    assert accepted > 50
    assert r1[1] > 1e-3 and r2[1] > 1e-3
