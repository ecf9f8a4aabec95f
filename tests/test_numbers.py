"""Numbers at their edges: NaN, ±inf, negative, zero, past int64 and past the model's context."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from dflash_mlx import load, stream_generate
from dflash_mlx.cli import app
from dflash_mlx.errors import InvalidArgumentError

CASES = [  # option, value, what the one line says
    ("--temp", "nan", "temperature must be ≥ 0 and finite"),
    ("--temp", "inf", "temperature must be ≥ 0 and finite"),
    ("--temp", "-inf", "temperature must be ≥ 0 and finite"),
    ("--temp", "-0.5", "temperature must be ≥ 0 and finite"),
    ("--top-p", "nan", "top_p must be in (0, 1]"),
    ("--top-p", "inf", "top_p must be in (0, 1]"),
    ("--top-p", "0", "top_p must be in (0, 1]"),
    ("--top-k", "-1", "top_k must be ≥ 0"),
    ("--seed", "-1", "seed must be between 0 and 2**64-1"),
    ("--seed", str(2**64), "seed must be between 0 and 2**64-1"),
    ("--seed", str(10**30), "seed must be between 0 and 2**64-1"),
    ("--max-tokens", "0", "max_tokens must be at least 1"),
    ("--max-tokens", "-3", "max_tokens must be at least 1"),
    ("--min-confidence", "nan", "--min-confidence must be in [0, 1]"),
    ("--min-confidence", "inf", "--min-confidence must be in [0, 1]"),
    ("--min-confidence", "-0.1", "--min-confidence must be in [0, 1]"),
    ("--block-size", "-4", "--block-size must be at least 2"),
    ("--block-size", str(10**30), "above the draft's trained block size"),
    # values Click cannot parse: its usage errors are one line too
    ("--max-tokens", "nan", "Invalid value for '--max-tokens'"),
    ("--max-tokens", "1e3", "Invalid value for '--max-tokens'"),
    ("--max-tokens", str(2**70) + ".5", "Invalid value for '--max-tokens'"),
    ("--top-k", "inf", "Invalid value for '--top-k'"),
    ("--seed", "-nan", "Invalid value for '--seed'"),
    ("--temp", "hot", "Invalid value for '--temp'"),
    ("--draft-bits", "nan", "Invalid value for '--draft-bits'"),
]


@pytest.mark.parametrize("argv, expected", [
    (["generate", "hi", "--max-tokens"], "Option '--max-tokens' requires an argument"),
    (["generate", "hi", "--no-such-flag"], "No such option: --no-such-flag"),
    (["no-such-command"], "No such command 'no-such-command'"),
    (["train-draft", "--steps", "x", "--out", "d"], "Invalid value for '--steps'"),
    (["serve", "--port", "eighty"], "Invalid value for '--port'"),
    (["doctor", "--seconds", "soon"], "Invalid value for '--seconds'"),
])
def test_usage_errors_are_one_line(argv, expected):
    r = CliRunner().invoke(app, argv)
    assert r.exit_code == 2, r.output
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and expected in lines[0] and "--help" in lines[0], r.stderr
    assert "Usage:" not in r.output and "Traceback" not in r.output


def test_no_arguments_still_show_the_help():
    r = CliRunner().invoke(app, [])
    assert "Usage:" in r.output and "generate" in r.output


@pytest.mark.parametrize("option, value, expected", CASES, ids=[f"{o}={v}" for o, v, _ in CASES])
def test_generate_numbers_are_one_line(tiny, option, value, expected):
    r = CliRunner().invoke(app, ["generate", "hi", "--model", str(tiny.target), "--draft",
                                 str(tiny.draft), "--no-pad-verify", option, value])
    assert r.exit_code == 2, r.output
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and expected in lines[0], r.stderr
    assert "Traceback" not in r.output


def test_a_seed_at_the_top_of_its_range_works(tiny):
    pair = load(tiny.target, tiny.draft)
    ev = next(iter(stream_generate(pair, [5, 6], max_tokens=2, temperature=1.0, seed=2**64 - 1)))
    assert ev.tokens
    with pytest.raises(InvalidArgumentError, match="seed"):
        next(iter(stream_generate(pair, [5, 6], max_tokens=2, seed=-5)))


def test_max_tokens_past_the_context_stops_at_the_context(tiny):
    """The oracle target never says EOS: without the cap it would decode past its 2048."""
    pair = load(tiny.oracle_target, tiny.oracle_draft)
    limit = pair.target.context_length
    prompt = [7] * (limit - 40)
    events = list(stream_generate(pair, prompt, block_size=4, max_tokens=10**9,
                                  min_confidence=0.0))
    assert sum(len(e.tokens) for e in events) == 40  # exactly up to the context, no further
    assert events[-1].finish_reason == "length"
    assert events[-1].note == f"stopped at the model's context ({limit} tokens)"
    assert not any(e.note for e in events[:-1])


def test_the_cli_says_where_it_stopped(tiny):
    r = CliRunner().invoke(app, ["generate", "-", "--model", str(tiny.oracle_target), "--draft",
                                 str(tiny.oracle_draft), "--max-tokens", str(2**63),
                                 "--no-pad-verify", "--min-confidence", "0"],
                           input="x" * 2000)
    assert r.exit_code == 0, r.output
    assert "stopped at the model's context (2048 tokens)" in r.stderr
