"""Logits processors and log-probabilities under speculation, against mlx-lm's own AR decoding.

Every verify row goes through the request's processors with its own prefix (the committed
tokens and the drafted ones before it), so greedy output equals mlx-lm's `generate_step` with
the same `make_logits_processors` list, and the reported log-probabilities are its values.
"""

from __future__ import annotations

import random

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.generate import generate_step

from dflash_mlx import SpeculationConfig, load, stream_generate, tiny
from dflash_mlx.errors import InvalidArgumentError
from dflash_mlx.speculate import rounds
from dflash_mlx.speculate.processors import Processing
from dflash_mlx.speculate.sampling import SamplingParams
from support.engine import Oracle, OracleDraft, float32_pair

SETTINGS = [
    Processing(repetition_penalty=1.5, repetition_context_size=6),
    Processing(presence_penalty=1.0, frequency_penalty=0.7, frequency_context_size=12),
    Processing(logit_bias={5: 4.0, 9: -100.0, 11: 2.5}),
    Processing(repetition_penalty=1.3, presence_penalty=0.5, logit_bias={7: 3.0}),
]


@pytest.fixture(scope="module", params=["qwen3", "llama"])
def tiny_dirs(request, tmp_path_factory):
    root = tmp_path_factory.mktemp(request.param)
    return tiny.make_target(root / "target", model_type=request.param), tiny.make_draft(root / "draft")


@pytest.fixture(scope="module")
def oracle_pair(tiny_dirs):
    return float32_pair(*tiny_dirs, OracleDraft)


def mlx_lm_reference(model, prompt, n, processing: Processing, top: int = 3):
    """mlx-lm greedy with the same processors: tokens, and per token its log-probability and
    the `top` likeliest ids."""
    out, lps, tops = [], [], []
    for tok, logprobs in generate_step(mx.array(prompt), model, max_tokens=n,
                                       sampler=lambda x: mx.argmax(x, axis=-1),
                                       logits_processors=processing.processors()):
        tok = int(tok)
        out.append(tok)
        lps.append(logprobs[tok].item())
        tops.append(np.argsort(-np.array(logprobs))[:top].tolist())
        if tok == tiny.EOS_ID:  # the engine stops there; mlx-lm's raw stepper does not
            break
    return out, lps, tops


def _case(seed):
    rng = random.Random(seed)
    prompt = [rng.randrange(tiny.VOCAB_SIZE - 4) for _ in range(rng.randint(1, 20))]
    return rng, prompt, rng.randint(4, 24), rng.randint(2, 8)


@pytest.mark.parametrize("setting", range(len(SETTINGS)))
@pytest.mark.parametrize("seed", range(6))
def test_greedy_with_processors_equals_mlx_lm(oracle_pair, setting, seed):
    """Rows past the first see drafted tokens in their prefix: an oracle draft that proposes
    the processed reference (sometimes wrong) makes every accept length happen."""
    pair, processing = oracle_pair, SETTINGS[setting]
    rng, prompt, n, block = _case(seed)
    ref, ref_lps, ref_tops = mlx_lm_reference(pair.target.model, prompt, n, processing)
    pair.draft.oracle = Oracle(ref, len(prompt), rng.choice([0.0, 0.2, 0.5]), seed)
    # fixed widths: the load-adaptive width may decode plainly, and this checks speculation
    events = list(stream_generate(pair, prompt, block_size=block, max_tokens=n, logprobs=3,
                                  adaptive=False, sampling=SamplingParams(processing=processing)))
    assert [t for e in events for t in e.tokens] == ref
    lps = [x for e in events for x in e.logprobs]
    np.testing.assert_allclose(lps, ref_lps, atol=1e-4)
    tops = [[i for i, _ in row] for e in events for row in e.top_logprobs]
    assert tops == ref_tops
    assert max(e.accepted for e in events) >= 1 or n < 3  # speculation really ran


@pytest.mark.parametrize("seed", range(4))
def test_tree_rounds_with_processors_equal_mlx_lm(tiny_dirs, seed):
    """A tree row's prefix is its own path: the output still equals mlx-lm's."""
    pair = load(*tiny_dirs, draft_bits=16, weights="float32")
    processing = SETTINGS[3]
    _, prompt, n, _ = _case(seed)
    ref, ref_lps, _ = mlx_lm_reference(pair.target.model, prompt, n, processing)
    config = SpeculationConfig.for_pair(pair, tree=12, block_size=4)
    events = list(stream_generate(pair, prompt, config, max_tokens=n, logprobs=0,
                                  sampling=SamplingParams(processing=processing)))
    assert any(e.tree_nodes for e in events)
    assert [t for e in events for t in e.tokens] == ref
    np.testing.assert_allclose([x for e in events for x in e.logprobs], ref_lps, atol=1e-4)


def test_rows_processed_with_the_first_rows_prefix_fail(oracle_pair, monkeypatch):
    """Power check: processing every row after the committed tokens only (ignoring the drafted
    ones before it) is a real bug, and the comparison with mlx-lm catches it."""
    pair, processing = oracle_pair, SETTINGS[0]
    real = rounds.process_rows
    monkeypatch.setattr(rounds, "process_rows", lambda procs, history, context, paths, logits:
                        real(procs, history, context, [paths[0]] * len(paths), logits))
    wrong = 0
    for seed in range(12):
        _, prompt, n, block = _case(seed)
        ref, _, _ = mlx_lm_reference(pair.target.model, prompt, n, processing)
        pair.draft.oracle = Oracle(ref, len(prompt), 0.0, seed)
        events = stream_generate(pair, prompt, block_size=block, max_tokens=n,
                                 sampling=SamplingParams(processing=processing))
        wrong += [t for e in events for t in e.tokens] != ref
    assert wrong >= 3


@pytest.mark.parametrize("kwargs, message", [
    (dict(repetition_penalty=float("nan")), "repetition_penalty must be a finite number"),
    (dict(repetition_penalty=0.0), "repetition_penalty must be between 1e-06 and 1e"),
    (dict(repetition_penalty=1e-300), "repetition_penalty must be between"),  # float32: 0
    (dict(repetition_penalty=1e39), "repetition_penalty must be between"),  # float32: inf
    (dict(presence_penalty=-1e39), "presence_penalty must be between -1e"),
    (dict(frequency_penalty=1e7), "frequency_penalty must be between"),
    (dict(presence_penalty=float("inf")), "presence_penalty must be a finite number"),
    (dict(frequency_context_size=0), "frequency_context_size must be at least 1"),
    (dict(logit_bias={3: 101.0}), "logit_bias for token 3 must be in"),
    (dict(logit_bias={3: float("nan")}), "logit_bias for token 3 must be in"),
])
def test_bad_processor_settings_are_one_line(kwargs, message):
    with pytest.raises(InvalidArgumentError, match=message):
        Processing(**kwargs)


@pytest.mark.parametrize("kwargs, message", [
    (dict(min_p=1.5), r"min_p must be in \[0, 1\]"),
    (dict(min_p=float("nan")), r"min_p must be in \[0, 1\]"),
    (dict(min_tokens_to_keep=0), "min_tokens_to_keep must be at least 1"),
])
def test_bad_min_p_is_one_line(kwargs, message):
    with pytest.raises(InvalidArgumentError, match=message):
        SamplingParams(0.7, **kwargs)


def test_logit_bias_outside_the_vocabulary_is_refused(tiny_dirs):
    pair = load(*tiny_dirs, draft_bits=16, weights="float32")
    with pytest.raises(InvalidArgumentError, match="outside the vocabulary"):
        next(stream_generate(pair, [1, 2, 3], max_tokens=2, sampling=SamplingParams(
            processing=Processing(logit_bias={tiny.VOCAB_SIZE: 1.0}))))
