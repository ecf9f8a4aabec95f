"""Sampling at the edges stays exact: top-p always keeps the most likely token, so as top-p
(or the temperature) goes to 0 sampling becomes greedy, token for token; never an empty
distribution (before the fix, top_p=1e-300 rounded to 0 in float32, every token was dropped
and the NaN distribution drew token 0, an end-of-text-like pick, every time).

Function level: `sampling_probs` on random logits rows is the one-hot of the argmax.
Engine level: `stream_generate` (plain decoding, a speculated path, a tree) and the batched
round at top_p -> 0 emit exactly greedy's tokens. The server refuses non-boolean booleans.
"""

from __future__ import annotations

import dflash_mlx  # noqa: F401  (first: preloads OpenBLAS before mlx)
import mlx.core as mx
import numpy as np
import pytest

from dflash_mlx import SpeculationConfig, load
from dflash_mlx.speculate.processors import Processing
from dflash_mlx.speculate.sampling import SamplingParams, sampling_probs

F32_TINY = float(np.finfo(np.float32).tiny)  # the smallest normal float32
F32_SUBNORMAL = float(np.float32(1.4e-45))  # the smallest float32 of all
TINY_P = [1e-300, F32_SUBNORMAL, F32_TINY]


def _rows(seed: int = 0, n: int = 64, vocab: int = 300, scale: float = 4.0) -> mx.array:
    return mx.random.normal((n, vocab), key=mx.random.key(seed)) * scale


@pytest.mark.parametrize("top_p", TINY_P)
@pytest.mark.parametrize("temperature", [0.3, 1.0, 7.0])
@pytest.mark.parametrize("extra", [{}, {"top_k": 5}, {"min_p": 0.1}])
def test_tiny_top_p_is_the_argmax(top_p, temperature, extra):
    x = _rows()
    probs = np.array(sampling_probs(x, SamplingParams(temperature, top_p, **extra)))
    expected = np.zeros_like(probs)
    expected[np.arange(len(probs)), np.argmax(np.array(x), axis=-1)] = 1.0
    assert np.isfinite(probs).all()
    np.testing.assert_array_equal(probs, expected)


@pytest.mark.parametrize("temperature", [1e-300, 1e-40, 1e-30])
def test_tiny_temperature_is_the_argmax(temperature):
    x = _rows(1)
    probs = np.array(sampling_probs(x, SamplingParams(temperature)))
    assert np.isfinite(probs).all()
    assert (probs.max(axis=-1) == 1.0).all()
    np.testing.assert_array_equal(probs.argmax(-1), np.argmax(np.array(x), axis=-1))


def test_top_p_still_keeps_the_nucleus():
    """The guard for the argmax adds nothing when top-p keeps it anyway."""
    x = _rows(2, scale=1.0)
    probs = np.array(sampling_probs(x, SamplingParams(1.0, 0.5)))
    full = np.array(mx.softmax(x, axis=-1))
    order = np.argsort(-full, axis=-1)
    for row, p, f in zip(order, probs, full):
        before = np.cumsum(f[row]) - f[row]
        kept = row[before < 0.5]
        assert set(np.flatnonzero(p)) == set(kept)


def test_top_p_zero_is_refused():
    from dflash_mlx.errors import InvalidArgumentError

    with pytest.raises(InvalidArgumentError, match=r"top_p must be in \(0, 1\]"):
        SamplingParams(1.0, 0.0)


# -- the engine: every sampler (plain, speculated, tree, batched) -----------------------------

@pytest.fixture(scope="module")
def pair(tiny):
    return load(tiny.target, tiny.draft, weights="float32")


def _tokens(events) -> list[int]:
    return [t for ev in events for t in ev.tokens]


@pytest.mark.parametrize("top_p", TINY_P)
@pytest.mark.parametrize("block, tree", [(1, 0), (4, 0), (4, 6)])
def test_generation_at_tiny_top_p_equals_greedy(pair, top_p, block, tree):
    from dflash_mlx import stream_generate

    config = SpeculationConfig.for_pair(pair).replace(block_size=block, min_confidence=0.0,
                                                      tree=tree)
    prompt = [5, 17, 42, 99, 3]
    greedy = _tokens(stream_generate(pair, prompt, config, max_tokens=24))
    for seed in (0, 1):
        sampled = _tokens(stream_generate(pair, prompt, config, max_tokens=24,
                                          sampling=SamplingParams(1.5, top_p, seed=seed)))
        assert sampled == greedy, (top_p, block, tree, seed)


def test_batched_round_at_tiny_top_p_equals_greedy(pair):
    from dflash_mlx import batch_generate

    prompts = [[5, 17, 42, 99, 3], [7, 7, 8, 200]]
    config = SpeculationConfig.for_pair(pair).replace(block_size=4, min_confidence=0.0)

    def run(sampling):
        out = {0: [], 1: []}
        for ev in batch_generate(pair, prompts, config, sampling, max_tokens=16):
            out[ev.index] += ev.tokens
        return out

    assert run(SamplingParams(1.5, 1e-300, seed=3)) == run(None)


def test_penalties_that_would_overflow_float32_are_refused():
    from dflash_mlx.errors import InvalidArgumentError

    for kwargs in ({"repetition_penalty": 1e-300}, {"presence_penalty": -1e39}):
        with pytest.raises(InvalidArgumentError, match="must be between"):
            Processing(**kwargs)


# -- the server's booleans -----------------------------------------------------------------

@pytest.mark.parametrize("options, param", [
    ({"include_usage": "yes"}, "stream_options.include_usage"),
    ({"include_usage": 1}, "stream_options.include_usage"),
    ({"include_usage": None}, "stream_options.include_usage"),
    ({"include_obfuscation": "false"}, "stream_options.include_obfuscation"),
    ({"include_obfuscation": True}, "stream_options.include_obfuscation"),
    ({"continuous_usage_stats": True}, "stream_options.continuous_usage_stats"),
    ("yes", "stream_options"),
])
def test_stream_options_take_booleans_only(options, param):
    from dflash_mlx.server.request import APIError, ServerConfig, settings

    with pytest.raises(APIError) as e:
        settings({"stream": True, "stream_options": options}, ServerConfig("m"), chat=True)
    assert e.value.status == 400 and e.value.param == param


@pytest.mark.parametrize("body", [{"stream": "true"}, {"logprobs": "yes"},
                                  {"echo": "false"}, {"parallel_tool_calls": 1}])
def test_other_booleans_refuse_strings(body):
    from dflash_mlx.server.request import APIError, ServerConfig, settings
    from dflash_mlx.server.tools import ToolError, check_tools

    chat = "echo" not in body
    with pytest.raises((APIError, ToolError)):
        settings(body, ServerConfig("m"), chat=chat)
        check_tools(body)


def test_include_usage_true_and_false_are_read():
    from dflash_mlx.server.request import ServerConfig, settings

    for value in (True, False):
        opts = settings({"stream": True, "stream_options": {"include_usage": value}},
                        ServerConfig("m"), chat=True)
        assert opts["include_usage"] is value
