"""DFlash 2 drafts: checkpoint layout, dynamic convolutions, candidate selector, exact sampling."""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx.utils import tree_flatten

from dflash_mlx import load, stream_generate, tiny
from dflash_mlx.models.config import DraftConfig
from dflash_mlx.generate import Session
from dflash_mlx.models.dflash2 import DFlash2DraftModel, GroupedDynamicConv
from dflash_mlx.models.dflash import DFlashDraftModel
from dflash_mlx.errors import CheckpointError, ConfigError
from dflash_mlx.loader import load_draft
from dflash_mlx.speculate.proposal import propose
from dflash_mlx.speculate.sampling import SamplingParams, sampling_probs
from support.dflash2 import MASK, PROMPT, T, V
from support.sampling import rejection_sample
from support.stats import pooled_chisquare

FIXTURES = Path(__file__).parent / "fixtures" / "checkpoints"


# -- checkpoint layout and dispatch -------------------------------------------------------

SCALE = {6656: 64, 33280: 5 * 64, 256: 32, 202048: tiny.VOCAB_SIZE, 1664: 2 * 2 * (64 // 16),
         19968: 128, 4096: 4 * 16, 1024: 2 * 16, 128: 16, 2: 2}


def _scaled_fixture(folder: Path) -> Path:
    """The real Muse-Glimmer-30B-DFlash2 config and tensor names, with every size scaled down."""
    cfg = json.loads((FIXTURES / "muse-glimmer-30b-dflash2.config.json").read_text())
    cfg.update(hidden_size=64, intermediate_size=128, num_attention_heads=4,
               num_key_value_heads=2, head_dim=16, vocab_size=tiny.VOCAB_SIZE, sliding_window=16)
    cfg["dflash_config"].update(mask_token_id=tiny.MASK_ID, selector_rank=32)
    header = json.loads((FIXTURES / "muse-glimmer-30b-dflash2.safetensors-header.json").read_text())
    header.pop("__metadata__", None)
    weights = {k: mx.zeros([SCALE[d] for d in v["shape"]]) for k, v in header.items()}
    folder.mkdir(parents=True, exist_ok=True)
    mx.save_safetensors(str(folder / "model.safetensors"), weights)
    (folder / "config.json").write_text(json.dumps(cfg))
    return folder


def test_remap_covers_every_parameter_of_the_real_header(tmp_path):
    folder = _scaled_fixture(tmp_path / "d2")
    header = json.loads((FIXTURES / "muse-glimmer-30b-dflash2.safetensors-header.json").read_text())
    names = {k for k in header if k != "__metadata__"}
    assert len(names) == 81
    assert "candidate_selector.predecessor_codebook" in names  # stored without `.weight`
    model = DFlash2DraftModel(DraftConfig.from_file(folder / "config.json"))
    params = dict(tree_flatten(model.parameters()))
    assert not any(k.startswith(("embed_tokens", "lm_head")) for k in params)  # borrowed
    remapped = DFlash2DraftModel.sanitize({k: None for k in names})
    assert set(remapped) == set(params)
    # strict load: names *and* shapes
    loaded = load_draft(folder)
    assert type(loaded) is DFlash2DraftModel
    assert isinstance(loaded.candidate_selector.successor_codebook, nn.Embedding)
    # and the writer produces the on-disk names again
    assert set(DFlash2DraftModel.checkpoint_weights(params)) == names


def test_missing_or_extra_tensor_is_a_checkpoint_error(tmp_path):
    folder = _scaled_fixture(tmp_path / "d2")
    w = mx.load(str(folder / "model.safetensors"))
    w.pop("layers.2.mlp_conv.base_kernel")
    mx.save_safetensors(str(folder / "model.safetensors"), w)
    with pytest.raises(CheckpointError, match="do not match"):
        load_draft(folder)


def _write(folder: Path, cfg: dict, weights: dict) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    mx.save_safetensors(str(folder / "model.safetensors"), weights)
    (folder / "config.json").write_text(json.dumps(cfg))
    return folder


@pytest.mark.parametrize("arch, cls", [
    ("DFlashDraftModel", DFlashDraftModel),
    ("DFlash2DraftModel", DFlash2DraftModel),
    ("MuseGlimmerAssistantModel", DFlashDraftModel),
])
def test_architecture_dispatch(tmp_path, arch, cls):
    cfg = tiny.dflash2_config() if arch == "DFlash2DraftModel" else tiny.draft_config()
    model = cls(cfg)
    raw = cfg.to_dict()
    raw["architectures"] = [arch]
    weights = dict(tree_flatten(model.parameters()))
    if arch == "DFlash2DraftModel":
        weights = DFlash2DraftModel.checkpoint_weights(weights)
    if arch == "MuseGlimmerAssistantModel":  # Meta's names for the context projection
        weights["encoder.fc.weight"] = weights.pop("fc.weight")
        weights["encoder.output_norm_enc.weight"] = weights.pop("hidden_norm.weight")
    loaded = load_draft(_write(tmp_path / arch, raw, weights))
    assert type(loaded) is cls


def test_unknown_architecture_is_a_clear_error(tmp_path):
    raw = tiny.draft_config().to_dict()
    raw["architectures"] = ["EagleDraftModel"]
    with pytest.raises(ConfigError, match="unsupported architectures.*EagleDraftModel"):
        load_draft(_write(tmp_path / "x", raw, {}))


# -- the dynamic convolution --------------------------------------------------------------

def test_conv_matches_its_formula_and_pads_slot_zero():
    mx.random.seed(3)
    H, K, G, L = 32, 2, 8, 5
    conv = GroupedDynamicConv(H, K, G)
    conv.base_kernel = mx.random.normal((2, K, H))
    conv.kernel_projection.weight = mx.random.normal(conv.kernel_projection.weight.shape) * 0.3
    u = mx.random.normal((1, L, H))
    y = mx.random.normal((1, L, H))
    a, dyn1 = conv.prepare(u)
    out = conv.finish(y, dyn1)
    D = np.array(conv.kernel_projection(u)).reshape(L, 2, K, H // G)
    base = np.array(conv.base_kernel)

    def ref(x, side):
        x = np.array(x)[0]
        r = np.zeros_like(x)
        for t in range(L):
            for o in range(K):
                if t - o < 0:
                    continue  # slot 0 reads zero padding
                tap = base[side, o] + np.repeat(D[t, side, o], G)
                r[t] += tap * x[t - o]
        return r

    np.testing.assert_allclose(np.array(a)[0], ref(u, 0), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.array(out)[0], ref(y, 1), rtol=1e-5, atol=1e-5)
    # block-local and causal: slot t never reads slots after it
    u2 = u.at[:, 3:].add(1.0)
    np.testing.assert_array_equal(np.array(conv.prepare(u2)[0][:, :3]), np.array(a[:, :3]))


def test_identity_initialised_dflash2_is_the_v1_draft(tmp_path):
    """prepare/finish wrap the right tensors: at identity init the layer is exactly v1's."""
    t = tiny.make_target(tmp_path / "t")
    pair = load(t, None, weights="float32")
    cfg2 = tiny.dflash2_config()
    d2 = DFlash2DraftModel(cfg2)
    v1 = DFlashDraftModel(DraftConfig.from_dict({**cfg2.to_dict(), "architectures": ["DFlashDraftModel"]}))
    shared = [(k, v) for k, v in tree_flatten(v1.parameters())]
    d2.load_weights(shared, strict=False)
    pair.target.set_taps(cfg2.target_layer_ids)
    d2.bind(pair.target), v1.bind(pair.target)
    ctx = mx.random.normal((1, 7, len(cfg2.target_layer_ids) * 64))
    block = mx.array([[5] + [tiny.MASK_ID] * 7])
    h1 = v1(block, ctx, v1.make_cache())
    h2 = d2(block, ctx, d2.make_cache())
    np.testing.assert_allclose(np.array(h1), np.array(h2), rtol=1e-5, atol=1e-5)


# -- the candidate selector ---------------------------------------------------------------

@pytest.fixture(scope="module")
def small_pair(tmp_path_factory):
    """A float32 qwen3 target with a 32-token vocabulary and a random DFlash 2 draft."""
    root = tmp_path_factory.mktemp("d2pair")
    t = tiny.make_target(root / "t", vocab_size=V, eos_token_id=None)
    cfg = tiny.dflash2_config(vocab_size=V, block_size=3, top_k=8,
                              dflash_config={"mask_token_id": MASK})
    d = tiny.make_dflash2_draft(root / "d", cfg)
    return load(t, d, draft_bits=16, weights="float32")


def _selector_inputs(pair, prompt=PROMPT):
    tg, dr = pair.target, pair.draft
    cache = tg.make_cache()
    _, taps = tg(mx.array([prompt[:-1]]), cache)
    block = mx.array([[prompt[-1]] + [MASK] * (dr.config.block_size - 1)])
    hidden = dr(block, taps, dr.make_cache())[0, 1:]
    logits = dr.logits(hidden)
    return hidden, logits, block, taps


def _brute_scores(sel, hidden, logits, prev, t):
    """score(b) = logit(b) + Σ_r A[prev, r] · Proj(h_t)[r] · B[b, r] over the top-K of slot t."""
    lg = np.array(logits[t])
    cand = np.argsort(-lg)[: sel.top_k]
    A = np.array(sel.predecessor_codebook.weight)
    B = np.array(sel.successor_codebook.weight)
    P = np.array(sel.hidden_projection(hidden[t]))
    return cand, lg[cand] + (A[prev] * P * B[cand]).sum(-1)


def test_selector_greedy_walk_is_the_argmax_path(small_pair):
    dr = small_pair.draft
    hidden, logits, block, taps = _selector_inputs(small_pair)
    tokens, q, _ = propose(dr, block, taps, dr.make_cache())
    assert q is None  # greedy: no proposal distribution needed
    prev, path = PROMPT[-1], []
    for t in range(block.shape[1] - 1):
        cand, scores = _brute_scores(dr.candidate_selector, hidden, logits, prev, t)
        prev = int(cand[np.argmax(scores)])
        path.append(prev)
    assert tokens.tolist() == path


def test_selector_q_is_softmax_over_candidates_given_the_chosen_predecessor(small_pair):
    dr = small_pair.draft
    hidden, logits, block, taps = _selector_inputs(small_pair)
    for seed in range(4):
        tokens, q, _ = propose(dr, block, taps, dr.make_cache(), params=SamplingParams(T),
                               key=mx.random.key(seed))
        q = np.array(q)
        prev = PROMPT[-1]
        for t, tok in enumerate(tokens.tolist()):
            cand, scores = _brute_scores(dr.candidate_selector, hidden, logits, prev, t)
            ref = np.exp((scores - scores.max()) / T)
            ref /= ref.sum()
            row = np.zeros(V)
            row[cand] = ref
            np.testing.assert_allclose(q[t], row, rtol=1e-4, atol=1e-6)
            assert tok in cand and q[t, tok] > 0
            prev = tok
        # reproducible from its key
        again, _, _ = propose(dr, block, taps, dr.make_cache(), params=SamplingParams(T),
                              key=mx.random.key(seed))
        assert again.tolist() == tokens.tolist()


# -- exact sampling with the selector: chi-square -----------------------------------------

def _target_rows(pair, cand, params):
    """p0, p1[d1] and p2[d1, d2] for every candidate path (one batched target pass)."""
    c1, c2 = cand[0].tolist(), cand[1].tolist()
    seqs = [PROMPT + [a, b] for a in c1 for b in c2]
    probs = sampling_probs(pair.target.model(mx.array(seqs))[:, -3:], params)  # (K*K, 3, V)
    index = {(a, b): i for i, (a, b) in enumerate((a, b) for a in c1 for b in c2)}
    return probs, index


def _reference_rejection(tokens, p, q, rng, broken):
    """A numpy rejection sampler with a deliberate bug, to show the test can see it."""
    gamma = len(tokens)
    if broken == "q_at_T1":  # q recorded at T=1 while the path was sampled at T
        q = q**T / (q**T).sum(-1, keepdims=True)
    for i, d in enumerate(tokens):
        if not rng.random() * q[i, d] < p[i, d]:
            res = p[i] if broken == "residual_p" else np.maximum(p[i] - q[i], 0)
            res = res / res.sum()
            return i, int(rng.choice(len(res), p=res))
    return gamma, int(rng.choice(p.shape[1], p=p[gamma] / p[gamma].sum()))


@pytest.fixture(scope="module")
def selector_draws(small_pair):
    """20k selector paths with their q, and the target rows each path needs."""
    params = SamplingParams(T)
    dr = small_pair.draft
    hidden, logits, block, taps = _selector_inputs(small_pair)
    sel = dr.candidate_selector
    cand, unary, succ = sel.candidates(hidden, logits)
    n = 20_000
    toks, q = sel.walk(mx.full((n,), PROMPT[-1]), cand, unary, succ, T, mx.random.key(7))
    dense = mx.put_along_axis(mx.zeros((n, 2, V)), mx.broadcast_to(cand, (n, 2, cand.shape[1])),
                              q, axis=-1)
    probs, index = _target_rows(small_pair, cand, params)
    rows = mx.array([index[(a, b)] for a, b in toks.tolist()])
    tp = probs[rows]  # (n, 3, V): p0, p1 | d1, p2 | d1 d2
    mx.eval(toks, dense, tp)
    return toks, dense, tp


def _tallies(emitted, tp):
    """Observed and expected counts of the 1st token, and of the 2nd/3rd where they exist."""
    tp = np.array(tp)
    obs = [np.zeros(V) for _ in range(3)]
    exp = [np.zeros(V) for _ in range(3)]
    for i, toks in enumerate(emitted):
        for j, tok in enumerate(toks):
            obs[j][tok] += 1
            exp[j] += tp[i, j]
    return obs, exp


def test_rejection_sampler_with_selector_q_is_exact(selector_draws):
    toks, dense, tp = selector_draws
    n = toks.shape[0]
    keys = mx.random.split(mx.random.key(11), n)
    emitted, accepted = [], []
    for i in range(n):
        a, nxt = rejection_sample(toks[i], tp[i], dense[i], keys[i])
        emitted.append(toks[i, :a].tolist() + [nxt])
        accepted.append(a)
    accepted = np.array(accepted)
    assert (accepted >= 1).mean() > 0.1, "too few accepts for the test to have power"
    assert (accepted == 2).sum() > 100
    obs, exp = _tallies(emitted, tp)
    results = [pooled_chisquare(o, e) for o, e in zip(obs, exp)]
    print(f"\nDFlash2 rejection sampler, {n} draws, accept rate slot1 {(accepted >= 1).mean():.3f}"
          f" slot2 {(accepted == 2).mean():.3f}")
    for j, (stat, p, cells) in enumerate(results):
        print(f"  token {j + 1}: n={int(obs[j].sum())} chi2={stat:.2f} cells={cells} p={p:.4f}")
    assert all(p > 1e-3 for _, p, _ in results)


# (Ignoring q altogether, i.e. the v1 one-hot rule u < p(d) with p minus d as residual, is
# *not* a bug: it is exact for any proposal, only with fewer accepts.)
@pytest.mark.parametrize("broken", ["residual_p", "q_at_T1"])
def test_chi_square_detects_a_broken_sampler(selector_draws, broken):
    toks, dense, tp = selector_draws
    rng = np.random.default_rng(5)
    t_np, q_np, p_np = np.array(toks), np.array(dense), np.array(tp)
    emitted = []
    for i in range(t_np.shape[0]):
        a, nxt = _reference_rejection(t_np[i], p_np[i], q_np[i], rng, broken)
        emitted.append(list(t_np[i, :a]) + [nxt])
    obs, exp = _tallies(emitted, tp)
    stat, p, cells = pooled_chisquare(obs[0], exp[0])
    print(f"\nbroken sampler ({broken}): chi2={stat:.1f} cells={cells} p={p:.2e}")
    assert p < 0.01


@pytest.mark.slow
def test_end_to_end_sampling_matches_the_target(small_pair):
    """Through stream_generate: the first two emitted tokens follow the target."""
    pair = small_pair
    params = SamplingParams(T)
    p0 = np.array(sampling_probs(pair.target.model(mx.array([PROMPT]))[0, -1], params))
    seqs = [PROMPT + [a] for a in range(V)]
    p1 = np.array(sampling_probs(pair.target.model(mx.array(seqs))[:, -1], params))
    second = p0 @ p1  # marginal of the 2nd token
    session = Session.new(pair)
    n = 800
    first, nxt, accepted = np.zeros(V), np.zeros(V), 0
    for seed in range(n):
        events = list(stream_generate(pair, PROMPT, block_size=3, max_tokens=2, temperature=T,
                                      seed=seed, session=session))
        toks = [t for e in events for t in e.tokens]
        first[toks[0]] += 1
        nxt[toks[1]] += 1
        accepted += events[0].accepted > 0
    r1 = pooled_chisquare(first, p0 * n)
    r2 = pooled_chisquare(nxt, second * n)
    print(f"\nstream_generate DFlash2 e2e: {n} runs, accepted≥1 in {accepted / n:.3f}; "
          f"token1 chi2={r1[0]:.2f} p={r1[1]:.4f}; token2 chi2={r2[0]:.2f} p={r2[1]:.4f}")
    assert accepted / n > 0.05
    assert r1[1] > 1e-3 and r2[1] > 1e-3


# -- greedy and selector quantization ----------------------------------------------------

def test_greedy_dflash2_equals_target_greedy(small_pair):
    pair = small_pair
    ar = [t for e in stream_generate(pair, PROMPT, block_size=1, max_tokens=24) for t in e.tokens]
    events = list(stream_generate(pair, PROMPT, block_size=3, max_tokens=24))
    assert [t for e in events for t in e.tokens] == ar


def test_selector_quantization_is_optional(tmp_path):
    t = tiny.make_target(tmp_path / "t")
    d = tiny.make_dflash2_draft(tmp_path / "d")
    plain = load_draft(d, draft_bits=4)
    sel = plain.candidate_selector
    assert isinstance(plain.layers[0].self_attn.q_proj, nn.QuantizedLinear)
    assert type(sel.hidden_projection) is nn.Linear and type(sel.predecessor_codebook) is nn.Embedding
    quant = load_draft(d, draft_bits=4, selector_bits=4)
    qsel = quant.candidate_selector
    assert isinstance(qsel.hidden_projection, nn.QuantizedLinear)
    assert isinstance(qsel.predecessor_codebook, nn.QuantizedEmbedding)
    assert isinstance(qsel.successor_codebook, nn.QuantizedEmbedding)
    with pytest.raises(CheckpointError):
        load_draft(d, selector_bits=3)
    # still a valid proposal distribution, and the pair still generates
    pair = load(t, d, draft_bits=16, selector_bits=4, weights="quantized")
    assert isinstance(pair.draft.candidate_selector.successor_codebook, nn.QuantizedEmbedding)
    block = mx.array([[5] + [tiny.MASK_ID] * 7])
    ctx = mx.random.normal((1, 6, 2 * 64))
    _, q, _ = propose(pair.draft, block, ctx, pair.draft.make_cache(),
                      params=SamplingParams(1.0), key=mx.random.key(0))
    np.testing.assert_allclose(np.array(q.sum(-1)), 1.0, rtol=1e-5)
    assert len(list(stream_generate(pair, "hi", max_tokens=6, temperature=1.0, seed=0))) > 0
