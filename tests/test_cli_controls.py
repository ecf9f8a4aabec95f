"""`dflash-mlx generate`'s sampling controls, log-probabilities and structured output
(docs/controls.md) through typer's CliRunner on tiny models: each flag reaches the engine, and
each bad value is one `error:` line with exit code 2."""

from __future__ import annotations

import json
import math
import re

import pytest
from typer.testing import CliRunner

from dflash_mlx.cli import app
from dflash_mlx.cli.options import build_sampling, parse_logit_bias
from dflash_mlx.errors import InvalidArgumentError

runner = CliRunner()


def gen(tiny, *args):
    return runner.invoke(app, ["generate", *map(str, args), "--model", str(tiny.target),
                               "--draft", str(tiny.draft), "--no-chat-template"])


@pytest.fixture(autouse=True)
def _cache(isolated_cache):
    return isolated_cache


def test_flags_build_one_sampling_params(tmp_path):
    schema = tmp_path / "s.json"
    schema.write_text('{"type": "object"}')
    p = build_sampling(temp=0.5, top_p=0.9, top_k=4, seed=1, min_p=0.1, repetition_penalty=1.2,
                       repetition_context_size=7, presence_penalty=0.5, frequency_penalty=-0.5,
                       logit_bias='{"3": 2, "5": -1.5}', json_schema=schema)
    assert (p.temperature, p.top_p, p.top_k, p.seed, p.min_p) == (0.5, 0.9, 4, 1, 0.1)
    q = p.processing
    assert (q.repetition_penalty, q.repetition_context_size) == (1.2, 7)
    assert (q.presence_penalty, q.frequency_penalty) == (0.5, -0.5)
    assert dict(q.logit_bias) == {3: 2.0, 5: -1.5}
    assert p.constraint.kind == "json_schema" and json.loads(p.constraint.value) == {
        "type": "object"}
    r = build_sampling(temp=0, top_p=1, top_k=0, seed=None, regex="a+")
    assert r.constraint.kind == "regex" and r.constraint.value == "a+"
    assert not r.processing.active and r.min_p == 0


@pytest.mark.parametrize("text, want", [
    ("1=2.5,7=-3", {1: 2.5, 7: -3.0}), (" 4 = 100 ", {4: 100.0}),
    ('{"10": -100, "11": 0.5}', {10: -100.0, 11: 0.5})])
def test_logit_bias_forms(text, want):
    assert parse_logit_bias(text) == want


@pytest.mark.parametrize("text", ["", "3", "x=1", "3=y", "{bad", "[1, 2]", '{"3": "z"}',
                                  '{"3": true}', "1=2,,=3"])
def test_logit_bias_malformed(text):
    with pytest.raises(InvalidArgumentError, match="^--logit-bias takes"):
        parse_logit_bias(text)


def test_regex_output_matches_fully(tiny):
    r = gen(tiny, "Year:", "--regex", "[0-9]{4}", "--max-tokens", 12, "--quiet")
    assert r.exit_code == 0, r.output
    assert re.fullmatch("[0-9]{4}", r.stdout.strip()), r.stdout


def test_json_schema_output_parses(tiny, tmp_path):
    # bounded, so a random model's answer ends within max_tokens
    schema = {"type": "object", "properties": {"a": {"type": "integer", "minimum": 0,
                                                     "maximum": 99},
                                               "b": {"type": "boolean"}},
              "required": ["a", "b"], "additionalProperties": False}
    path = tmp_path / "schema.json"
    path.write_text(json.dumps(schema))
    r = gen(tiny, "JSON:", "--json-schema", path, "--max-tokens", 60, "--quiet", "--seed", 1)
    assert r.exit_code == 0, r.output
    data = json.loads(r.stdout)
    assert set(data) == {"a", "b"} and isinstance(data["a"], int) and isinstance(data["b"], bool)


def test_logprobs_in_events(tiny, tmp_path):
    path = tmp_path / "ev.jsonl"
    r = gen(tiny, "Hello", "--max-tokens", 8, "--block-size", 3, "--logprobs", 2,
            "--events", path, "--quiet")
    assert r.exit_code == 0, r.output
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    blocks, summary = rows[:-1], rows[-1]
    assert summary["logprobs"] == 2
    n = 0
    for b in blocks:
        assert [e["id"] for e in b["logprobs"]] == b["tokens"]
        assert len(b["top_logprobs"]) == len(b["tokens"])
        for e, alts in zip(b["logprobs"], b["top_logprobs"]):
            assert isinstance(e["token"], str) and e["logprob"] <= 0 and math.isfinite(
                e["logprob"])
            assert len(alts) == 2 and all(a["logprob"] <= 0 for a in alts)
            assert alts[0]["logprob"] >= alts[1]["logprob"]
            assert e["logprob"] <= alts[0]["logprob"] + 1e-4  # greedy: the top one
            assert {"id", "token", "logprob"} == set(alts[0])
            n += 1
    assert n == 8


def test_logit_bias_forces_a_token(tiny, tmp_path):
    def tokens(*extra):
        path = tmp_path / "ev.jsonl"
        r = gen(tiny, "Hi", "--max-tokens", 6, "--quiet", "--events", path, *extra)
        assert r.exit_code == 0, r.output
        rows = [json.loads(line) for line in path.read_text().splitlines()][:-1]
        return [t for b in rows for t in b["tokens"]]

    token = 40
    assert tokens() != [token] * 6
    assert tokens("--logit-bias", f"{token}=100") == [token] * 6
    assert token not in tokens("--logit-bias", f'{{"{token}": -100}}')


def test_penalties_and_min_p_run_and_are_recorded(tiny, tmp_path):
    path = tmp_path / "ev.jsonl"
    r = gen(tiny, "Hi", "--max-tokens", 6, "--quiet", "--min-p", 0.05, "--repetition-penalty",
            1.3, "--repetition-context-size", 8, "--presence-penalty", 0.2,
            "--frequency-penalty", 0.1, "--events", path)
    assert r.exit_code == 0, r.output
    sampling = json.loads(path.read_text().splitlines()[-1])["sampling"]
    assert sampling["min_p"] == 0.05 and sampling["repetition_penalty"] == 1.3
    assert sampling["repetition_context_size"] == 8
    assert sampling["presence_penalty"] == 0.2 and sampling["frequency_penalty"] == 0.1


BAD = [
    ("min-p-2", ["--min-p", 2], "min_p must be in [0, 1]"),
    ("nan-penalty", ["--repetition-penalty", "nan"], "repetition_penalty must be a finite"),
    ("bias-outside-vocab", ["--logit-bias", "999999=1"], "outside the vocabulary"),
    ("bias-too-big", ["--logit-bias", "3=500"], "must be in [-100, 100]"),
    ("bias-malformed", ["--logit-bias", "3:1"], "--logit-bias takes"),
    ("bad-schema", ["--json-schema", "{bad_schema}"], "--json-schema"),
    ("schema-not-json", ["--json-schema", "{not_json}"], "not valid JSON"),
    ("missing-schema", ["--json-schema", "{missing}"], "no such file"),
    ("bad-regex", ["--regex", "[0-9"], "--regex"),
    ("regex-and-schema", ["--regex", "a", "--json-schema", "{bad_schema}"], "exclude each other"),
    ("logprobs-99", ["--logprobs", 99, "--events", "{events}"],
     "--logprobs must be between 0 and 20"),
    ("logprobs-without-events", ["--logprobs", 2], "--logprobs goes with --events"),
    ("remote-refuses", ["--min-p", 0.1, "--backend", "openai", "--base-url",
                        "http://127.0.0.1:9/v1"], "--min-p need the local engine"),
]


@pytest.mark.parametrize("args, says", [b[1:] for b in BAD], ids=[b[0] for b in BAD])
def test_bad_values_are_one_line(tiny, tmp_path, args, says):
    bad = tmp_path / "bad.json"
    bad.write_text('{"type": "nonsense-type"}')
    not_json = tmp_path / "nj.json"
    not_json.write_text("{nope")
    places = {"bad_schema": bad, "not_json": not_json, "missing": tmp_path / "none.json",
              "events": tmp_path / "ev.jsonl"}
    args = [str(a).format(**places) for a in args]
    r = gen(tiny, "Hi", "--max-tokens", 4, *args)
    assert r.exit_code == 2, r.output
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error:"), r.stderr
    assert says in lines[0], lines[0]
    assert "Traceback" not in r.output and r.stdout == ""


def test_benchmark_takes_the_sampling_controls(tiny, tmp_path):
    out = tmp_path / "card.json"
    r = runner.invoke(app, ["benchmark", "--model", str(tiny.target), "--draft", str(tiny.draft),
                            "--dataset", "gsm8k", "--num-prompts", "1", "--max-tokens", "6",
                            "--block-size", "3", "--repetition-penalty", "1.2", "--min-p", "0.1",
                            "--logit-bias", "40=5", "--out", str(out)])
    assert r.exit_code == 0, r.output
    s = json.loads(out.read_text())["settings"]
    assert (s["repetition_penalty"], s["min_p"], s["logit_bias"]) == (1.2, 0.1, {"40": 5.0})
    # greedy, the same processors on both sides: DFlash still equals AR
    assert all(row["greedy_match"] == 1.0 for row in json.loads(out.read_text())["results"])
    bad = runner.invoke(app, ["benchmark", "--model", str(tiny.target), "--draft",
                              str(tiny.draft), "--logit-bias", "5000=1", "--num-prompts", "1"])
    assert bad.exit_code == 2 and bad.stderr.count("error:") == 1
    assert "outside the vocabulary" in bad.stderr and "Traceback" not in bad.output


def test_chat_takes_min_p_and_repetition_penalty(tiny, monkeypatch):
    from tui import launch

    calls = {}
    monkeypatch.setattr(launch, "run_chat", lambda settings, loader, **kw: calls.update(
        settings=settings) or 0)
    r = runner.invoke(app, ["chat", "--model", str(tiny.target), "--draft", str(tiny.draft),
                            "--min-p", "0.2", "--repetition-penalty", "1.1"])
    assert r.exit_code == 0, r.output
    s = calls["settings"]
    assert (s.min_p, s.repetition_penalty) == (0.2, 1.1)
    assert s.sampling.processing.repetition_penalty == 1.1
    bad = runner.invoke(app, ["chat", "--min-p", "-1"])
    assert bad.exit_code == 2 and bad.stderr.count("error:") == 1 and "min_p" in bad.stderr
