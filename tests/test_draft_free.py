"""Draft-free speculation (`--draft lookup`): the context lookup alone proposes, on any target,
and the output is exactly the target's: greedy equal to mlx-lm, sampled by chi-square, on plain
and sliding-window targets; the CLI runs it one flag away."""

from __future__ import annotations

import numpy as np
import pytest
from typer.testing import CliRunner

from dflash_mlx import SpeculationConfig, load, stream_generate, tiny
from dflash_mlx.cli import app
from dflash_mlx.errors import InvalidArgumentError
from dflash_mlx.speculate.sampling import SamplingParams
from support.engine import mlx_lm_greedy
from support.sampling import target_rows
from support.stats import chi_square

LOOKUP = SpeculationConfig(draft_free=True)
FAMILIES = {
    "qwen3": {},
    # a window of 8 rows on half the layers: rejected lookup rows must never come back
    "gemma3": dict(model_type="gemma3_text", num_hidden_layers=4, sliding_window=8,
                   sliding_window_pattern=2, query_pre_attn_scalar=16,
                   rope_local_base_freq=10000.0),
}


@pytest.fixture(scope="module", params=list(FAMILIES))
def pair(request, tmp_path_factory):
    folder = tiny.make_target(tmp_path_factory.mktemp(request.param) / "t",
                              **FAMILIES[request.param])
    p = load(folder, None, weights="float32")
    p.tokenizer._eos_token_ids = set()  # long answers: many rounds, the window wraps
    return p


def repetitive(seed: int) -> list[int]:
    """A prompt that repeats itself, so the lookup finds matches from the first round."""
    rng = np.random.default_rng(seed)
    unit = [int(t) for t in rng.integers(3, 250, size=int(rng.integers(3, 7)))]
    return unit * int(rng.integers(3, 6))


@pytest.mark.parametrize("block", [2, 4, 8])
def test_greedy_equals_mlx_lm(pair, block):
    proposed = accepted = 0
    for seed in range(6):
        prompt = repetitive(seed)
        events = list(stream_generate(pair, prompt, LOOKUP, block_size=block, max_tokens=48))
        assert [t for e in events for t in e.tokens] == mlx_lm_greedy(pair.target.model,
                                                                      prompt, 48), seed
        proposed += sum(len(e.drafted) for e in events)
        accepted += sum(e.accepted for e in events)
        assert all(all(e.lookup_flags) and len(e.lookup_flags) == len(e.drafted)
                   for e in events)
        assert all(e.trimmed == 0 for e in events)
    assert proposed > 0 and 0 < accepted < proposed  # it proposed, some held, some did not


def test_sampling_follows_the_target(pair):
    """The token after a prompt whose lookup proposes: ~ p(·|prompt), over seeded runs."""
    params = SamplingParams(1.0)
    prompt = repetitive(11)
    first = np.array([next(iter(stream_generate(pair, prompt, LOOKUP, block_size=4,
                                                 max_tokens=2, temperature=1.0,
                                                 seed=100 + i))).tokens[0]
                      for i in range(800)])
    assert chi_square(first, target_rows(pair, prompt, params, 1)[0]).ok
    wrong = target_rows(pair, prompt[:-1], params, 1)[0]  # another position's distribution
    assert not chi_square(first, wrong).ok


def test_a_pair_with_a_draft_is_not_draft_free(tiny):
    with_draft = load(tiny.target, tiny.draft)
    with pytest.raises(InvalidArgumentError, match="without a draft"):
        next(iter(stream_generate(with_draft, [5, 6], LOOKUP, max_tokens=2)))
    no_draft = load(tiny.target, None)
    with pytest.raises(InvalidArgumentError, match="needs a draft"):  # not unless asked
        next(iter(stream_generate(no_draft, [5, 6], max_tokens=2)))


def test_cli_draft_lookup(tiny):
    r = CliRunner().invoke(app, ["generate", "ab ab ab ab ab", "--model", str(tiny.target),
                                 "--draft", "lookup", "--max-tokens", "24", "--no-pad-verify",
                                 "--fixed-width"])
    assert r.exit_code == 0, r.output
    assert "Context lookup:" in r.stderr and "block 5" in r.stderr
