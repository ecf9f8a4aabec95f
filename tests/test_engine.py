"""Engine correctness on tiny random qwen3 / llama targets: greedy invariants, parity, caches."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dflash_mlx import SpeculationConfig, load, stream_generate
from dflash_mlx.generate import Session
from dflash_mlx.loader import convert_weights, load_draft, pair_from_models
from dflash_mlx.models.target import Target
from dflash_mlx.speculate.proposal import full_block, greedy_tokens, propose
from dflash_mlx import tiny
from support.engine import (
    Oracle, OracleDraft, RecordingTarget, cache_arrays, float32_pair, mlx_lm_greedy,
)


@pytest.fixture(scope="module", params=["qwen3", "llama"])
def tiny_dirs(request, tmp_path_factory):
    root = tmp_path_factory.mktemp(request.param)
    t = tiny.make_target(root / "target", model_type=request.param)
    d = tiny.make_draft(root / "draft")
    return t, d


@pytest.fixture(scope="module")
def oracle_pair(tiny_dirs):
    """float32 target + oracle draft, with verify passes recorded."""
    return float32_pair(*tiny_dirs, OracleDraft, RecordingTarget)


def _run(pair, prompt, **kw):
    return list(stream_generate(pair, prompt, **kw))


def test_load_binds_and_generates(tiny_dirs):
    pair = load(*tiny_dirs)
    assert pair.draft.is_bound and pair.weights == "float32"  # auto on the CPU device
    events = _run(pair, "Hello", max_tokens=12)
    assert sum(len(e.tokens) for e in events) == 12
    assert events[-1].finish_reason == "length"
    assert all(e.finish_reason is None for e in events[:-1])
    assert all(len(e.drafted) == e.block_size - 1 for e in events)


def test_ar_baseline_matches_mlx_lm(tiny_dirs):
    pair = load(tiny_dirs[0], None, weights="float32")
    prompt = list(range(40, 60))
    events = _run(pair, prompt, block_size=1, max_tokens=20)
    assert all(e.drafted == [] and e.accepted == 0 and len(e.tokens) == 1 for e in events)
    got = [t for e in events for t in e.tokens]
    assert got == mlx_lm_greedy(pair.target.model, prompt, 20)


@settings(max_examples=200, deadline=None, suppress_health_check=list(HealthCheck))
@given(
    seed=st.integers(0, 2**31 - 1),
    prompt_len=st.integers(1, 24),
    block=st.integers(2, 8),
    p_wrong=st.sampled_from([0.0, 0.15, 0.4, 1.0]),
)
def test_greedy_invariants(oracle_pair, seed, prompt_len, block, p_wrong):
    """Every emitted token is the target argmax of the pass that verified it; the output
    equals plain mlx-lm greedy decoding; accept patterns of every length occur."""
    pair = oracle_pair
    rng = __import__("random").Random(seed)
    prompt = [rng.randrange(tiny.VOCAB_SIZE - 4) for _ in range(prompt_len)]
    n = rng.randint(1, 24)
    raw = mlx_lm_greedy(pair.target.model, prompt, n)
    pair.draft.oracle = Oracle(raw, prompt_len, p_wrong, seed)
    # the engine stops at EOS; mlx-lm's raw stepper does not
    reference = raw[: raw.index(tiny.EOS_ID) + 1] if tiny.EOS_ID in raw else raw
    pair.target.passes.clear()
    # lookup off: the oracle's blocks are verified as proposed (p_wrong 0: all accepted)
    events = _run(pair, prompt, block_size=block, max_tokens=n, lookup=False)
    prefill_passes = 1 if prompt_len > 1 else 0
    assert len(pair.target.passes) == prefill_passes + len(events)
    for ev, logits in zip(events, pair.target.passes[prefill_passes:]):
        assert len(ev.drafted) == ev.block_size - 1 and logits.shape[0] == ev.block_size
        argmax = mx.argmax(logits, axis=-1).tolist()
        assert 0 <= ev.accepted <= len(ev.drafted)
        full = ev.drafted[: ev.accepted] + [argmax[ev.accepted]]
        assert ev.tokens == full[: len(ev.tokens)]  # shorter only when cut at EOS / max_tokens
        for i, tok in enumerate(ev.tokens):
            assert tok == argmax[i], "emitted token is not the verify pass's argmax"
        assert ev.accept_flags == [i < ev.accepted for i in range(len(ev.drafted))]
    emitted = [t for e in events for t in e.tokens]
    assert emitted == reference  # float32: identical to AR greedy
    if p_wrong == 0.0:
        whole = [e for e in events if e.block_size == block]
        assert all(e.accepted == block - 1 for e in whole)


@pytest.mark.parametrize("seed", range(10))
def test_padded_verify_passes_decode_the_same(oracle_pair, seed):
    """Verify passes run wider than the block (`SpeculationConfig.verify_pad`): the rows added
    are padding, so every round, token and cached K/V is what the unpadded run gives, and the
    output is plain AR greedy's."""
    pair = oracle_pair
    rng = __import__("random").Random(seed)
    prompt = [rng.randrange(tiny.VOCAB_SIZE - 4) for _ in range(rng.randint(1, 24))]
    block, n = rng.randint(2, 8), rng.randint(6, 24)
    raw = mlx_lm_greedy(pair.target.model, prompt, n)
    reference = raw[: raw.index(tiny.EOS_ID) + 1] if tiny.EOS_ID in raw else raw
    runs = {}
    for pads in ({}, {w: 8 for w in range(2, 8)}):
        pair.draft.oracle = Oracle(raw, len(prompt), 0.3, seed)
        pair.target.passes.clear()
        session = Session.new(pair)
        config = SpeculationConfig.for_pair(pair, verify_pad=pads, adaptive=False)
        events = _run(pair, prompt, config=config, block_size=block, max_tokens=n,
                      session=session)
        widths = [p.shape[0] for p in pair.target.passes[-len(events):]]
        assert widths == [pads.get(e.block_size, e.block_size) for e in events]
        assert pair.target.cache_length(session.target_cache) == len(session.tokens) - 1
        assert [t for e in events for t in e.tokens] == reference
        runs[bool(pads)] = ([(e.tokens, e.drafted, e.accepted) for e in events],
                            cache_arrays(session.target_cache, len(session.tokens) - 1))
    assert runs[True][0] == runs[False][0]
    for (k1, v1), (k0, v0) in zip(runs[True][1], runs[False][1]):
        assert mx.allclose(k1, k0, atol=1e-5).item() and mx.allclose(v1, v0, atol=1e-5).item()


def test_eos_stops_exactly(tiny_dirs):
    pair = load(*tiny_dirs, weights="float32")
    prompt = list(range(70, 90))
    ref = mlx_lm_greedy(pair.target.model, prompt, 16)
    eos = ref[5]
    pair.tokenizer._eos_token_ids = {eos}
    events = _run(pair, prompt, max_tokens=16)
    emitted = [t for e in events for t in e.tokens]
    assert emitted == ref[: ref.index(eos) + 1]
    assert events[-1].finish_reason == "stop"


def test_max_tokens_exact(tiny_dirs):
    pair = load(*tiny_dirs, weights="float32")
    for n in (1, 2, 3, 7):
        events = _run(pair, [5, 6, 7], max_tokens=n)
        assert sum(len(e.tokens) for e in events) == n
        assert all(e.block_size <= n for e in events)


def _fresh_prefill(pair, tokens):
    cache = pair.target.make_cache()
    pair.target(mx.array([tokens]), cache, taps=False)
    mx.eval([c.state for c in cache])
    return cache


def _assert_cache_equals_prefill(pair, session: Session):
    n = len(session.tokens) - 1
    assert Target.cache_length(session.target_cache) == n
    fresh = _fresh_prefill(pair, session.tokens[:-1])
    for (k1, v1), (k2, v2) in zip(cache_arrays(session.target_cache, n), cache_arrays(fresh, n)):
        assert k1.shape == k2.shape
        assert mx.allclose(k1, k2, atol=1e-4).item() and mx.allclose(v1, v2, atol=1e-4).item()
    pending = 0 if session.pending is None else session.pending.shape[1]
    assert session.draft_cache[0].offset + pending == n


@pytest.mark.parametrize("stop_after", [1, 2, 5, 9])
def test_cache_exact_after_close(oracle_pair, stop_after):
    pair = oracle_pair
    prompt = list(range(100, 117))
    ref = mlx_lm_greedy(pair.target.model, prompt, 40)
    pair.draft.oracle = Oracle(ref, len(prompt), 0.3, stop_after)
    session = Session.new(pair)
    gen = stream_generate(pair, prompt, max_tokens=40, session=session)
    for i, _ in enumerate(gen):
        if i + 1 == stop_after:
            break
    gen.close()  # interrupted mid-stream
    _assert_cache_equals_prefill(pair, session)
    # the session continues exactly: same tokens as one uninterrupted run
    done = len(session.tokens) - len(prompt)
    assert session.tokens[len(prompt):] == ref[:done]
    more = [t for e in stream_generate(pair, session.tokens, max_tokens=5, session=session)
            for t in e.tokens]
    assert more == ref[done : done + 5]
    _assert_cache_equals_prefill(pair, session)


def test_exception_in_verify_leaves_cache_exact(oracle_pair):
    pair = oracle_pair
    prompt = list(range(30, 45))
    pair.draft.oracle = Oracle(mlx_lm_greedy(pair.target.model, prompt, 20), len(prompt), 0.2, 3)
    session = Session.new(pair)
    calls = {"n": 0}
    real = pair.target.__class__.__call__

    def flaky(self, ids, cache, taps=True):
        calls["n"] += 1
        if calls["n"] == 4:  # prefill + 2 rounds succeed, the 3rd verify dies mid-pass
            real(self, ids, cache, taps)
            raise KeyboardInterrupt
        return real(self, ids, cache, taps)

    pair.target.__class__.__call__ = flaky
    try:
        with pytest.raises(KeyboardInterrupt):
            for _ in stream_generate(pair, prompt, max_tokens=20, session=session):
                pass
    finally:
        pair.target.__class__.__call__ = real
    _assert_cache_equals_prefill(pair, session)


def test_session_reuse_prefills_only_new_tokens(tiny_dirs):
    pair = load(*tiny_dirs, weights="float32")
    session = Session.new(pair)
    first = list(range(10, 40))
    ev = _run(pair, first, max_tokens=6, session=session)
    assert ev[0].prompt_tokens == len(first) - 1 and ev[0].reused_tokens == 0
    second = session.tokens + [50, 51, 52]
    ev2 = _run(pair, second, max_tokens=6, session=session)
    assert ev2[0].reused_tokens == len(second) - 4  # everything but the new tokens
    assert ev2[0].prompt_tokens == 3
    # diverging history rewinds to the common prefix
    third = first[:10] + [7, 7, 7]
    ev3 = _run(pair, third, max_tokens=4, session=session)
    assert ev3[0].reused_tokens == 10
    _assert_cache_equals_prefill(pair, session)
    fresh = [t for e in _run(pair, third, max_tokens=4) for t in e.tokens]
    assert [t for e in ev3 for t in e.tokens] == fresh


def test_seeded_sampling_is_reproducible(tiny_dirs):
    pair = load(*tiny_dirs, weights="float32")
    a = [e.tokens for e in _run(pair, "abc", max_tokens=20, temperature=1.0, seed=7)]
    b = [e.tokens for e in _run(pair, "abc", max_tokens=20, temperature=1.0, seed=7)]
    c = [e.tokens for e in _run(pair, "abc", max_tokens=20, temperature=1.0, seed=8)]
    assert a == b and a != c


def test_quantized_draft_and_weight_policies(tiny_dirs):
    t, d = tiny_dirs
    for bits in (4, 8):
        draft = load_draft(d, bits)
        assert any("scales" in k for k, _ in __import__("mlx.utils").utils.tree_flatten(
            draft.parameters()))
    q = load(t, d, weights="quantized", draft_bits=4)
    f = load(t, d, weights="float32", draft_bits=4)
    assert q.weights == "quantized" and f.weights == "float32"
    # float32 keeps the 4-bit rounding of the draft: same proposals either way
    block = mx.array([[5, tiny.MASK_ID, tiny.MASK_ID]])
    ctx = mx.zeros((1, 3, 64 * len(q.draft.config.target_layer_ids)))
    tq, _, _ = propose(q.draft, block, ctx, q.draft.make_cache())
    tf, _, _ = propose(f.draft, block, ctx, f.draft.make_cache())
    assert tq.tolist() == tf.tolist()


def test_draft_bits_follow_the_weights_policy(tiny_dirs):
    """Unset, the draft is 4-bit while the target stays quantized, and kept as trained when a
    dense policy dequantizes both (a 4-bit rounding there would only cost accuracy)."""
    t, d = tiny_dirs
    q, f = load(t, d, weights="quantized"), load(t, d, weights="float32")
    assert (q.draft_bits, f.draft_bits) == (4, 16)
    assert isinstance(q.draft.layers[0].mlp.gate_proj, nn.QuantizedLinear)
    trained = load_draft(d, 16).layers[0].mlp.gate_proj.weight.astype(mx.float32)
    rounded = load(t, d, weights="float32", draft_bits=4).draft.layers[0].mlp.gate_proj.weight
    assert mx.array_equal(f.draft.layers[0].mlp.gate_proj.weight, trained)
    assert not mx.allclose(rounded, trained)


def test_narrow_blocks_are_drafted_at_the_trained_width(tiny_dirs, monkeypatch):
    """A block narrower than the draft's trained one is padded with MASK for the forward (every
    slot attends to the whole block, and training only showed full-width blocks); the proposal
    keeps the leading slots."""
    draft = load(*tiny_dirs, weights="float32").draft
    width = draft.config.block_size
    assert width > 3
    narrow = mx.array([[5, tiny.MASK_ID, tiny.MASK_ID]])
    padded = full_block(draft, narrow)
    assert padded.tolist() == [[5] + [tiny.MASK_ID] * (width - 1)]
    assert full_block(draft, padded) is padded
    ctx = mx.random.normal((1, 6, 64 * len(draft.config.target_layer_ids)), key=mx.random.key(2))
    seen, forward = [], type(draft).__call__
    monkeypatch.setattr(type(draft), "__call__",
                        lambda self, ids, *a: seen.append(ids.tolist()) or forward(self, ids, *a))
    tokens, _, _ = propose(draft, narrow, ctx, draft.make_cache())
    assert seen == [padded.tolist()] and tokens.shape == (2,)
    monkeypatch.undo()
    wide = draft(padded, ctx, draft.make_cache())[:, 1:3]
    assert tokens.tolist() == greedy_tokens(draft, wide)[0].tolist()
    # the padding is what changes them: the narrow forward's slots differ
    assert not mx.allclose(draft(narrow, ctx, draft.make_cache())[:, 1:3], wide, atol=1e-4)


def test_block_size_above_trained_is_rejected(tiny_dirs):
    from dflash_mlx.errors import InvalidArgumentError

    pair = load(*tiny_dirs)
    with pytest.raises(InvalidArgumentError, match="trained block size"):
        _run(pair, "hi", block_size=pair.draft.config.block_size + 1)


def test_pair_from_models_in_memory(tiny_dirs):
    pair = load(*tiny_dirs, weights="float32")
    draft = load_draft(tiny_dirs[1])
    convert_weights(draft, mx.float32)
    p2 = pair_from_models(pair.target.model, pair.tokenizer, draft)
    a = [t for e in _run(pair, [1, 2, 3], max_tokens=8) for t in e.tokens]
    b = [t for e in _run(p2, [1, 2, 3], max_tokens=8) for t in e.tokens]
    assert a == b


def test_ar_turn_inside_a_speculative_session_keeps_draft_context(tiny_dirs):
    """An AR (block 1) turn in a session with a draft still feeds the draft's context."""
    pair = load(*tiny_dirs, weights="float32")
    session = Session.new(pair)
    _run(pair, list(range(10, 30)), max_tokens=5, session=session, block_size=1)
    _assert_cache_equals_prefill(pair, session)
    _run(pair, session.tokens + [40, 41], max_tokens=6, session=session, block_size=5)
    _assert_cache_equals_prefill(pair, session)


@pytest.mark.parametrize("weights", ["float32", "quantized"])
def test_restricted_draft_head(tiny_dirs, tmp_path, weights):
    """A draft_vocab.json restricts proposals to its ids; output stays exactly the target's."""
    import json
    import shutil

    from dflash_mlx.models import draft_vocab

    t, d = tiny_dirs
    qt = tmp_path / "qtarget"
    if weights == "quantized":  # a 4-bit target exercises the quantized row gather
        tiny.make_target(qt, model_type="qwen3", quantize=True)
        t = qt
    full = load(t, d, weights=weights)
    folder = tmp_path / "draft"
    shutil.copytree(d, folder)
    # the whole vocabulary: identical proposals to the unrestricted head
    draft_vocab.save(folder, list(range(tiny.VOCAB_SIZE)), 1.0, "test")
    same = load(t, folder, weights=weights)
    block = mx.array([[5] + [tiny.MASK_ID] * 4])
    ctx = mx.random.normal((1, 6, 64 * len(full.draft.config.target_layer_ids)), key=mx.random.key(1))
    a, _, _ = propose(full.draft, block, ctx, full.draft.make_cache())
    b, _, _ = propose(same.draft, block, ctx, same.draft.make_cache())
    assert a.tolist() == b.tolist()
    # a small subset: proposals come from it, and generation still equals AR greedy
    subset = list(range(0, tiny.VOCAB_SIZE, 3))
    draft_vocab.save(folder, subset, 0.5, "test")
    part = load(t, folder, weights=weights)
    c, _, _ = propose(part.draft, block, ctx, part.draft.make_cache())
    assert set(c.tolist()) <= set(subset)
    assert json.loads((folder / "draft_vocab.json").read_text())["size"] == len(subset)
    spec = [x for e in _run(part, [3, 4, 5, 6], max_tokens=16) for x in e.tokens]
    ar = [x for e in _run(part, [3, 4, 5, 6], max_tokens=16, block_size=1) for x in e.tokens]
    assert spec == ar
    assert load(t, folder, weights=weights, draft_vocab=False).draft._borrowed.head_ids is None


def test_restricted_head_generates_from_another_thread(tiny_dirs, tmp_path):
    """Servers and the TUI generate on a worker thread: nothing built lazily at load may be
    left for that thread to evaluate (MLX streams are per thread)."""
    import shutil
    import threading

    from dflash_mlx.models import draft_vocab

    folder = tmp_path / "draft"
    shutil.copytree(tiny_dirs[1], folder)
    draft_vocab.save(folder, list(range(0, tiny.VOCAB_SIZE, 2)), 0.5, "test")
    pair = load(tiny_dirs[0], folder)
    out, errors = [], []

    def worker():
        try:
            out.extend(t for e in stream_generate(pair, [3, 4, 5], max_tokens=8) for t in e.tokens)
        except Exception as e:  # surfaced below
            errors.append(e)

    th = threading.Thread(target=worker)
    th.start()
    th.join()
    assert not errors and len(out) == 8
