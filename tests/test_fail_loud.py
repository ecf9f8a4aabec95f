"""Fail loud, inside the engine: NaN/inf logits stop a run with one line naming the model; a
draft that keeps accepting nothing hands the rest of the answer to plain AR, output unchanged."""

from __future__ import annotations

import mlx.core as mx
import pytest
from typer.testing import CliRunner

from dflash_mlx import SpeculationConfig, load, stream_generate, tiny
from dflash_mlx.cli import app
from dflash_mlx.speculate.guards import NonFiniteLogitsError
from support.engine import Oracle, OracleDraft, float32_pair, mlx_lm_greedy


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("loud")
    return tiny.make_target(root / "t"), tiny.make_draft(root / "d")


@pytest.fixture(scope="module")
def broken_dir(tmp_path_factory, dirs):
    """The tiny target with a NaN in its final norm: every logit is NaN."""
    folder = tmp_path_factory.mktemp("nan") / "t"
    folder.mkdir()
    for f in dirs[0].iterdir():
        (folder / f.name).write_bytes(f.read_bytes())
    weights = dict(mx.load(str(folder / "model.safetensors")))
    norm = weights["model.norm.weight"]
    weights["model.norm.weight"] = mx.where(mx.arange(norm.shape[0]) == 3, mx.nan, norm)
    mx.save_safetensors(str(folder / "model.safetensors"), weights, metadata={"format": "mlx"})
    return folder


@pytest.mark.parametrize("block", [1, 4])
@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_nan_logits_stop_the_run(dirs, broken_dir, block, temperature):
    pair = load(broken_dir, dirs[1], weights="float32")
    with pytest.raises(NonFiniteLogitsError, match=str(broken_dir)):
        list(stream_generate(pair, [5, 6, 7], block_size=block, max_tokens=8,
                             temperature=temperature, seed=0))


def test_nan_logits_are_one_cli_line(dirs, broken_dir):
    r = CliRunner().invoke(app, ["generate", "hi", "--model", str(broken_dir), "--draft",
                                 str(dirs[1]), "--max-tokens", "4", "--no-pad-verify"])
    assert r.exit_code == 2, r.output
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "NaN or infinite" in lines[0] and "Traceback" not in r.output


def test_a_draft_that_accepts_nothing_hands_over_to_ar(dirs):
    pair = float32_pair(*dirs, OracleDraft)
    pair.tokenizer._eos_token_ids = set()
    prompt, n = [9, 8, 7, 6], 60
    reference = mlx_lm_greedy(pair.target.model, prompt, n)
    pair.draft.oracle = Oracle(reference, len(prompt), p_wrong=1.0, seed=3)  # always wrong
    # (a random token can still equal the target's by chance: count only what the engine did)
    events = list(stream_generate(pair, prompt, SpeculationConfig(fallback_after=5),
                                  block_size=4, max_tokens=n))
    assert [t for e in events for t in e.tokens] == reference  # output unchanged
    (switch,) = [i for i, e in enumerate(events) if e.note]
    assert "plain autoregressive" in events[switch].note
    before = events[:switch + 1]
    assert sum(1 for e in before if e.drafted) >= 5 and all(e.accepted == 0 for e in before[-5:])
    assert all(not e.drafted and e.block_size == 1 for e in events[switch + 1:])


def test_a_draft_that_accepts_keeps_speculating(dirs):
    pair = float32_pair(*dirs, OracleDraft)
    pair.tokenizer._eos_token_ids = set()
    prompt, n = [9, 8, 7, 6], 60
    reference = mlx_lm_greedy(pair.target.model, prompt, n)
    pair.draft.oracle = Oracle(reference, len(prompt), p_wrong=0.0, seed=3)
    events = list(stream_generate(pair, prompt, SpeculationConfig(fallback_after=5),
                                  block_size=4, max_tokens=n))
    assert [t for e in events for t in e.tokens] == reference
    assert not any(e.note for e in events) and all(e.drafted for e in events[:-1])
