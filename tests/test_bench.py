"""`benchmark`: bundled prompt sets, AR vs DFlash interleaving, metrics, the JSON card."""

from __future__ import annotations

import hashlib
import json
import re

import pytest
from typer.testing import CliRunner

from dflash_mlx.bench import runner as bench
from dflash_mlx import SpeculationConfig
from dflash_mlx.cli import app

runner = CliRunner()
LICENSES = {"gsm8k": "MIT", "math500": "MIT", "humaneval": "MIT", "mbpp": "CC-BY-4.0",
            "mt-bench": "Apache-2.0"}


@pytest.mark.parametrize("name", bench.DATASETS)
def test_prompt_sets_are_real_sized_and_licensed(name):
    meta, items = bench.load_prompts(name)
    assert meta["license"] == LICENSES[name] and meta["source"]
    assert len(items) >= 30 and meta["items"] == len(items)
    assert all(turns and all(t.strip() for t in turns) for turns in items)
    assert len({turns[0] for turns in items}) == len(items)  # no duplicates


def test_prompt_formats_follow_the_dflash_benchmark():
    suffix = "\nPlease reason step by step, and put your final answer within \\boxed{}."
    for name in ("gsm8k", "math500"):
        assert all(t[0].endswith(suffix) for t in bench.load_prompts(name)[1])
    code = "Write a solution to the following problem and make sure that it passes the tests:\n```python\n"
    he = bench.load_prompts("humaneval")[1]
    assert all(t[0].startswith(code) and t[0].endswith("\n```") for t in he)
    assert "def has_close_elements" in he[0][0]
    assert all(len(t) == 1 for t in bench.load_prompts("mbpp")[1])
    assert all(len(t) == 2 for t in bench.load_prompts("mt-bench")[1])
    assert bench.parse_datasets("all") == list(bench.DATASETS)


def test_first_divergence():
    assert bench.first_divergence([1, 2, 3], [1, 2, 3]) is None
    assert bench.first_divergence([1, 2, 3], [1, 5, 3]) == 1
    assert bench.first_divergence([1, 2], [1, 2, 3]) == 2


def test_runs_interleave_and_alternate(tiny, monkeypatch):
    from dflash_mlx.loader import load
    from dflash_mlx.chat import encoder

    pair = load(tiny.oracle_target, tiny.oracle_draft)
    whole = SpeculationConfig.for_pair(pair, min_confidence=0.0)
    order = []
    real = bench.generate_once

    def spy(pair, ids, block, sampling, config=None):
        order.append(block)
        return real(pair, ids, block, sampling, config)

    monkeypatch.setattr(bench, "generate_once", spy)
    sets = {"gsm8k": bench.load_prompts("gsm8k")[1][:2]}
    samples = bench.run(pair, sets, encoder(pair, {}), block_sizes=[2, 4],
                        sampling={"max_tokens": 8, "temperature": 0.0}, config=whole)
    # warm-up of each system, then per prompt AR-first and AR-last in turn
    assert order == [1, 2, 4, 1, 2, 4, 4, 2, 1]
    rows = bench.summarize(samples, [2, 4], greedy=True)
    assert [(r["dataset"], r["block_size"]) for r in rows] == [("gsm8k", 2), ("gsm8k", 4)]
    b4 = rows[1]
    assert b4["tau"] == pytest.approx(4.0) and b4["acceptance_rates"] == [1.0, 1.0, 1.0]
    assert b4["greedy_match"] == 1.0 and b4["generation_tokens"] == 16
    assert b4["speedup"] == pytest.approx(b4["dflash_tps"] / b4["ar_tps"], rel=1e-3)


def test_rows_count_the_lookup_share(tiny):
    """A row's lookup share is its accepted context-lookup slots over all tokens it generated
    (the tiny target repeats itself, so the lookup has matches); none without the lookup."""
    from dflash_mlx.loader import load

    pair = load(tiny.target, tiny.draft)
    whole = SpeculationConfig.for_pair(pair, min_confidence=0.0, adaptive=False)
    sets = {"gsm8k": [["The cat sat. The cat sat. The cat"]]}

    def encode(messages):
        return pair.tokenizer.encode(" ".join(m["content"] for m in messages))

    samples = bench.run(pair, sets, encode, block_sizes=[4],
                        sampling={"max_tokens": 40, "temperature": 0.0}, config=whole)
    (row,) = bench.summarize(samples, [4], greedy=True)
    events = samples[0].median(4).events
    looked = sum(f and a for e in events for f, a in zip(e.lookup_flags, e.accept_flags))
    assert looked > 0
    assert row["lookup_share"] == pytest.approx(looked / row["generation_tokens"], abs=1e-4)
    samples = bench.run(pair, sets, encode, block_sizes=[4],
                        sampling={"max_tokens": 40, "temperature": 0.0},
                        config=whole.replace(lookup=False))
    assert bench.summarize(samples, [4], greedy=True)[0]["lookup_share"] == 0.0


def test_multi_turn_history_uses_the_ar_answer(tiny):
    from dflash_mlx.loader import load

    pair = load(tiny.target, tiny.draft)
    seen = []

    def encode(messages):
        seen.append([m["role"] for m in messages])
        return pair.tokenizer.encode(" ".join(m["content"] for m in messages))

    samples = bench.run(pair, {"mt-bench": [["first?", "second?"]]}, encode, block_sizes=[3],
                        sampling={"max_tokens": 4, "temperature": 0.0})
    assert [(s.turn, s.dataset) for s in samples] == [(0, "mt-bench"), (1, "mt-bench")]
    assert seen[-1] == ["user", "assistant", "user"]


def test_parity_helpers(tiny):
    from dflash_mlx.loader import load

    pair = load(tiny.oracle_target, tiny.oracle_draft)
    ids = pair.tokenizer.encode("hello")
    assert bench.logit_margin(pair, ids, 0, 5) == pytest.approx(0.0)  # all logits are 0
    p = bench.check_parity(pair, ids, [0] * 6, max_tokens=6)
    assert p.verdict == "match" and p.compared == 6
    p = bench.check_parity(pair, ids, [0, 0, 7, 0, 0, 0], max_tokens=6)
    assert (p.index, p.dflash_token, p.ar_token, p.verdict) == (2, 7, 0, "near-tie")
    assert bench.near_tie_threshold("float32") < bench.near_tie_threshold("quantized")


def test_benchmark_command_writes_a_card(tiny, isolated_cache, tmp_path):
    out = tmp_path / "card.json"
    r = runner.invoke(app, ["benchmark", "--model", str(tiny.oracle_target), "--draft",
                            str(tiny.oracle_draft), "--dataset", "gsm8k,mt-bench",
                            "--num-prompts", "1", "--max-tokens", "8", "--block-size", "2,4",
                            "--repeats", "2", "--min-confidence", "0", "--fixed-width",
                            "--out", str(out)])  # fixed: every round drafts, τ is exact
    assert r.exit_code == 0, r.output
    assert "speedup" in r.stdout and "gsm8k" in r.stdout and "all" in r.stdout
    card = json.loads(out.read_text())
    assert card["schema"] == bench.CARD_SCHEMA
    assert {"machine", "versions", "models", "settings", "datasets", "results", "samples"} <= set(card)
    assert card["machine"]["blas"] and card["versions"]["mlx"]
    assert card["models"]["target"]["id"] == str(tiny.oracle_target)
    # float32 dequantizes the draft too, so it keeps its trained weights (auto_draft_bits)
    assert card["models"]["draft"]["bits"] == 16 and card["models"]["weights"] == "float32"
    s = card["settings"]
    assert (s["block_sizes"], s["repeats"], s["max_tokens"], s["temperature"]) == ([2, 4], 2, 8, 0.0)
    assert s["min_confidence"] == 0.0
    assert card["datasets"]["gsm8k"]["license"] == "MIT" and card["datasets"]["mt-bench"]["items"] == 1
    rows = {(row["dataset"], row["block_size"]): row for row in card["results"]}
    assert set(rows) == {(d, b) for d in ("gsm8k", "mt-bench", "all") for b in (2, 4)}
    assert rows[("all", 4)]["samples"] == 3 and rows[("all", 4)]["greedy_match"] == 1.0
    assert rows[("mt-bench", 2)]["tau"] == pytest.approx(2.0)
    assert len(card["samples"]) == 3 and card["samples"][0]["dflash"]["4"]["first_divergence"] is None
    run4 = card["samples"][0]["dflash"]["4"]["stats"]  # the oracle draft: every draft accepted
    assert (run4["tau"], run4["generation_tokens"]) == (4.0, 8)
    assert card["samples"][0]["ar"]["stats"]["tau"] == 1.0


def test_sampled_benchmark_has_no_greedy_match(tiny, isolated_cache):
    r = runner.invoke(app, ["benchmark", "--model", str(tiny.target), "--draft", str(tiny.draft),
                            "--num-prompts", "1", "--max-tokens", "4", "--temp", "0.8",
                            "--top-p", "0.9", "--top-k", "20"])
    assert r.exit_code == 0, r.output
    assert "n/a" in r.stdout


def test_prompt_file_forms_and_hash(tmp_path):
    path = tmp_path / "mine.jsonl"
    lines = ['"plain text"', '{"prompt": "one turn", "id": 3}', '',
             '{"turns": ["first", "second"]}',
             '{"messages": [{"role": "system", "content": "be brief"}, '
             '{"role": "user", "content": "u1"}, {"role": "assistant", "content": "a"}, '
             '{"role": "user", "content": "u2"}]}']
    path.write_text("\n".join(lines) + "\n")
    meta, items = bench.load_prompt_file(path)
    assert items == [["plain text"], ["one turn"], ["first", "second"], ["u1", "u2"]]
    assert meta["sha256"] == hashlib.sha256(path.read_bytes()).hexdigest()
    assert (meta["name"], meta["items"]) == ("mine", 4)
    metas, sets = bench.select_prompts("gsm8k", path, None)  # a file: all of it by default
    assert list(sets) == ["mine"] and len(sets["mine"]) == 4
    metas, sets = bench.select_prompts("gsm8k", None, None)  # datasets: 8 by default
    assert len(sets["gsm8k"]) == 8 and metas["gsm8k"]["license"] == "MIT"


@pytest.mark.parametrize("content, msg", [
    (b"", "no prompts in the file"),
    (b"\n\n", "no prompts in the file"),
    (b'{"prompt": "ok"}\n{"prompt": \n', "line 2: Expecting value"),
    (b'"ok"\n{"question": "x"}\n', "line 2: expected a non-empty string"),
    (b'{"prompt": ""}\n', "line 1: expected a non-empty string"),
    (b'{"prompt": 7}\n', "line 1: expected a non-empty string"),
    (b'{"turns": []}\n', "line 1: expected a non-empty string"),
    (b'{"turns": ["a", 2]}\n', "line 1: expected a non-empty string"),
    (b'{"messages": "hi"}\n', "line 1: `messages` must be a list"),
    (b'{"messages": [{"role": "system", "content": "s"}]}\n', "line 1: expected a non-empty"),
    (b'"caf\xe9"\n', "not UTF-8 text (byte 4)"),
    (b"[1, 2]\n", "line 1: expected a non-empty string"),
])
def test_bad_prompt_files_are_one_line(tmp_path, content, msg):
    path = tmp_path / "p.jsonl"
    path.write_bytes(content)
    with pytest.raises(bench.InvalidArgumentError, match=re.escape(msg)):
        bench.load_prompt_file(path)


def test_a_prompt_file_error_names_the_option_that_gave_it(tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_bytes(b"")
    with pytest.raises(bench.InvalidArgumentError, match=re.escape(f"--warm-prompts {path}: no")):
        bench.load_prompt_file(path, "--warm-prompts")
    with pytest.raises(bench.InvalidArgumentError, match="--warm-prompts .*cannot read"):
        bench.load_prompt_file(tmp_path / "missing.jsonl", "--warm-prompts")


def test_benchmark_on_a_prompt_file(tiny, isolated_cache, tmp_path):
    path, out = tmp_path / "own.jsonl", tmp_path / "card.json"
    path.write_text('{"prompt": "Name a colour."}\n"Count to three."\n{"prompt": "Hello"}\n')
    r = runner.invoke(app, ["benchmark", "--model", str(tiny.oracle_target), "--draft",
                            str(tiny.oracle_draft), "--prompts", str(path), "--num-prompts", "2",
                            "--max-tokens", "6", "--block-size", "3", "--out", str(out)])
    assert r.exit_code == 0, r.output
    card = json.loads(out.read_text())
    assert card["datasets"]["own"]["sha256"] == hashlib.sha256(path.read_bytes()).hexdigest()
    assert card["datasets"]["own"]["items"] == 2 and len(card["samples"]) == 2
    assert card["settings"]["num_prompts"] == 2
    r = runner.invoke(app, ["benchmark", "--model", str(tiny.oracle_target), "--draft",
                            str(tiny.oracle_draft), "--prompts", str(tmp_path / "none.jsonl")])
    assert r.exit_code == 2 and "none.jsonl: cannot read" in r.stderr
