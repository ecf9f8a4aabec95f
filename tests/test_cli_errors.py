"""The error table: each bad input gives one line on stderr, exit code 2, no traceback."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from dflash_mlx.cli import app

runner = CliRunner()
LONG_PROMPT = "x" * 3000  # the tiny target's context is 2048 tokens, one per byte


# (id, command line with {target}/{draft}/... placeholders, stdin, what the line must say)
ERRORS = [
    ("unknown-model-name", "generate hi --model no-such-model", None, "unknown model 'no-such-model'"),
    ("missing-path", "generate hi --model ./no/such/dir", None, "./no/such/dir: no such file or folder"),
    ("missing-draft-path", "generate hi --model {target} --draft ./nope", None, "./nope: no such file"),
    ("no-known-draft", "generate hi --model {target}", None, "--no-draft"),
    ("hub-offline", "generate hi --model org/not-downloaded --draft {draft}", None,
     "org/not-downloaded: could not download"),
    ("hidden-size-mismatch", "generate hi --model {target} --draft {bad_hidden}", None,
     "draft hidden size 32 ≠ target hidden size 64"),
    ("vocab-mismatch", "generate hi --model {target} --draft {bad_vocab}", None,
     "draft vocabulary 300 ≠ target vocabulary 260"),
    ("truncated-draft", "generate hi --model {target} --draft {truncated_draft}", None,
     "corrupt or truncated safetensors"),
    ("truncated-target", "generate hi --model {broken_target} --draft {draft}", None,
     "cannot load target"),
    ("no-target-layer-ids", "generate hi --model {target} --draft {no_taps}", None,
     "no 'target_layer_ids' and no 'num_target_layers'"),
    ("min-confidence-above-1", "generate hi --model {target} --draft {draft} --min-confidence 1.5",
     None, "--min-confidence must be in [0, 1], got 1.5"),
    ("min-confidence-negative", "benchmark --model {target} --draft {draft} --min-confidence -0.1",
     None, "--min-confidence must be in [0, 1], got -0.1"),
    ("block-size-0", "generate hi --model {target} --draft {draft} --block-size 0", None,
     "--block-size must be at least 2"),
    ("block-size-1", "generate hi --model {target} --draft {draft} --block-size 1", None,
     "use --no-draft"),
    ("block-size-above-trained", "generate hi --model {target} --draft {draft} --block-size 9",
     None, "above the draft's trained block size 8"),
    ("block-size-not-a-number", "generate hi --model {target} --draft {draft} --block-size x",
     None, "--block-size must be an integer"),
    ("block-size-list-in-generate", "generate hi --model {target} --draft {draft} --block-size "
     "3,5", None, "--block-size takes one size here"),
    ("negative-temp", "generate hi --model {target} --draft {draft} --temp -1", None,
     "temperature must be ≥ 0"),
    ("top-p-zero", "generate hi --model {target} --draft {draft} --top-p 0", None,
     "top_p must be in (0, 1]"),
    ("top-p-above-one", "generate hi --model {target} --draft {draft} --top-p 1.5", None,
     "top_p must be in (0, 1]"),
    ("negative-top-k", "generate hi --model {target} --draft {draft} --top-k -1", None,
     "top_k must be ≥ 0"),
    ("empty-prompt", "generate --model {target} --draft {draft} -", "", "the prompt is empty"),
    ("blank-prompt", "generate --model {target} --draft {draft} -", "  \n ", "the prompt is empty"),
    ("prompt-longer-than-context", "generate --model {target} --draft {draft} -", LONG_PROMPT,
     "the target's context is 2048 tokens"),
    ("draft-bits-3", "generate hi --model {target} --draft {draft} --draft-bits 3", None,
     "--draft-bits must be 4, 8 or 16"),
    ("bad-weights", "generate hi --model {target} --draft {draft} --weights fp8", None,
     "--weights must be one of"),
    ("unwritable-events", "generate hi --model {target} --draft {draft} --events /no/dir/e.jsonl",
     None, "--events /no/dir/e.jsonl: cannot write"),
    ("parity-needs-greedy", "generate hi --model {target} --draft {draft} --check-parity --temp 0.7",
     None, "--check-parity compares greedy outputs"),
    ("prompt-twice", "generate hi --prompt hi --model {target} --draft {draft}", None,
     "give the prompt once"),
    ("bad-reasoning-level", "generate hi --model qwen3.8-27b --reasoning high", None,
     "qwen3.8-27b: --reasoning must be one of low, medium, xhigh"),
    ("bench-unknown-dataset", "benchmark --model {target} --draft {draft} --dataset squad", None,
     "unknown dataset 'squad'"),
    ("bench-block-above-trained", "benchmark --model {target} --draft {draft} --block-size 3,16 "
     "--num-prompts 1", None, "above the draft's trained block size 8"),
    ("bench-unwritable-out", "benchmark --model {target} --draft {draft} --out /no/dir/c.json",
     None, "--out /no/dir/c.json: cannot write"),
    ("doctor-unknown-shape", "doctor --shape huge", None, "--shape must be one of"),
    ("doctor-tau-out-of-range", "doctor --tau 7", None, "--tau is τ at block 5"),
]


@pytest.mark.parametrize("case", ERRORS, ids=[c[0] for c in ERRORS])
def test_error_is_one_line_exit_2(case, tiny, isolated_cache):
    _, cmd, stdin, expected = case
    paths = {k: str(v) for k, v in vars(tiny).items()}
    args = [a.format(**paths) for a in cmd.split()]
    r = runner.invoke(app, args, input=stdin)
    assert r.exit_code == 2, (r.output, r.exception)
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1, r.stderr
    assert lines[0].startswith("error: ") and expected in lines[0], lines[0]
    assert "Traceback" not in r.output and r.stdout == ""


def test_every_issue_error_is_in_the_table():
    ids = {c[0] for c in ERRORS}
    required = {"unknown-model-name", "missing-path", "hidden-size-mismatch", "vocab-mismatch",
                "truncated-draft", "truncated-target", "no-target-layer-ids", "block-size-0",
                "block-size-1", "block-size-above-trained", "negative-temp", "top-p-zero",
                "top-p-above-one", "empty-prompt", "prompt-longer-than-context", "draft-bits-3",
                "unwritable-events"}
    assert required <= ids
