"""`dflash-mlx generate` and `models` through typer's CliRunner on tiny models."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from dflash_mlx.cli import app

runner = CliRunner()


def run(*args, input=None):
    return runner.invoke(app, [str(a) for a in args], input=input)


def gen(tiny, *args, target=None, draft=None, input=None):
    return run("generate", *args, "--model", target or tiny.target, "--draft", draft or tiny.draft,
               input=input)


@pytest.fixture(autouse=True)
def _cache(isolated_cache):
    return isolated_cache


def test_help_lists_commands():
    r = run("--help")
    assert r.exit_code == 0
    for cmd in ("generate", "models", "doctor", "benchmark", "fetch-demo"):
        assert cmd in r.stdout
    r = run("generate", "--help")
    for flag in ("--model", "--draft-model", "--no-draft", "--block-size", "--draft-bits",
                 "--weights", "--max-tokens", "--temp", "--top-p", "--top-k", "--seed",
                 "--system-prompt", "--reasoning", "--no-chat-template", "--events",
                 "--check-parity", "--quiet", "--verbose", "--min-p", "--repetition-penalty",
                 "--repetition-context-size", "--presence-penalty", "--frequency-penalty",
                 "--logit-bias", "--logprobs", "--json-schema", "--regex"):
        assert flag in r.stdout, flag


def test_generate_text_on_stdout_stats_on_stderr(tiny):
    r = gen(tiny, "Hello there", "--max-tokens", 12)
    assert r.exit_code == 0, r.output
    assert r.stdout.strip() and "Prompt:" not in r.stdout
    err = r.stderr
    for line in ("Prompt:", "tokens-per-sec", "Generation: 12 tokens", "Acceptance: τ",
                 "per position", "Peak memory:"):
        assert line in err, line


def test_quiet_and_verbose(tiny):
    quiet = gen(tiny, "Hi", "--max-tokens", 6, "--quiet")
    assert quiet.exit_code == 0 and quiet.stderr == "" and quiet.stdout.strip()
    verbose = gen(tiny, "Hi", "--max-tokens", 6, "--verbose", "--block-size", 3, "--no-lookup")
    rounds = [ln for ln in verbose.stderr.splitlines() if ln.startswith("#")]
    # the random draft is always rejected: one token per round
    assert len(rounds) == 6 and "0/2 +1" in rounds[0] and "verify" in rounds[0]


def test_lookup_is_shown_and_can_be_turned_off(tiny):
    """The tiny target's answer repeats itself, so the context lookup fills draft slots."""
    # fixed widths: the load-adaptive width may decode plainly, which looks nothing up
    on = gen(tiny, "Hi", "--max-tokens", 40, "--verbose", "--block-size", 3, "--fixed-width")
    off = gen(tiny, "Hi", "--max-tokens", 40, "--verbose", "--block-size", 3, "--no-lookup",
              "--fixed-width")
    assert on.exit_code == 0 and off.exit_code == 0
    assert on.stdout == off.stdout  # exact either way
    marks = "".join(ln.split()[1] for ln in on.stderr.splitlines() if ln.startswith("#"))
    assert "◆" in marks and "Context lookup:" in on.stderr
    assert "◆" not in off.stderr and "◇" not in off.stderr and "Context lookup" not in off.stderr


def test_oracle_draft_accepts_every_position(tiny):
    r = gen(tiny, "Hi", "--max-tokens", 12, "--block-size", 4, "--min-confidence", 0,
            "--fixed-width", target=tiny.oracle_target, draft=tiny.oracle_draft)
    assert r.exit_code == 0, r.output
    assert r.stdout == "!" * 12 + "\n"  # token 0 is "!"
    assert "τ 4.00 tokens/round over 3 rounds" in r.stderr
    assert "1:100%  2:100%  3:100%" in r.stderr
    assert "Cut before verifying" not in r.stderr
    # everything cut: the same text from plain AR rounds, and the cut is reported
    r = gen(tiny, "Hi", "--max-tokens", 12, "--block-size", 4, "--min-confidence", 1,
            "--fixed-width", target=tiny.oracle_target, draft=tiny.oracle_draft)
    assert r.exit_code == 0, r.output
    assert r.stdout == "!" * 12 + "\n"
    assert "τ 1.00 tokens/round over 12 rounds" in r.stderr
    # 9 rounds of 3 slots, then 2, 1, 0 as max_tokens narrows the last blocks
    assert "Cut before verifying: 30 low-confidence draft slots" in r.stderr


def test_prompt_from_stdin(tiny):
    for args in (["-"], ["--prompt", "-"], []):
        r = gen(tiny, *args, "--max-tokens", 3, "--quiet", input="What is 2+2?")
        assert r.exit_code == 0, (args, r.output)
        assert r.stdout.strip()


def test_same_output_with_and_without_speculation(tiny):
    spec = gen(tiny, "Tell me", "--max-tokens", 20, "--quiet")
    ar = run("generate", "Tell me", "--model", tiny.target, "--no-draft", "--max-tokens", 20,
             "--quiet")
    assert spec.exit_code == ar.exit_code == 0
    assert spec.stdout == ar.stdout
    assert "Acceptance" not in run("generate", "x", "--model", tiny.target, "--no-draft",
                                   "--max-tokens", 2).stderr


def test_system_prompt_and_raw_prompt(tiny, tmp_path):
    counts = {}
    for name, extra in (("chat", []), ("system", ["--system-prompt", "Be brief."]),
                        ("raw", ["--no-chat-template"])):
        path = tmp_path / f"{name}.jsonl"
        r = gen(tiny, "Hi", "--max-tokens", 2, "--quiet", "--events", path, *extra)
        assert r.exit_code == 0, r.output
        counts[name] = json.loads(path.read_text().splitlines()[-1])["prompt_ids"]
    # ChatML wraps "Hi" (2 bytes) in 19 tokens; the system turn adds its own; raw is 2 bytes
    assert counts["raw"] == 2 and counts["chat"] > 2 and counts["system"] > counts["chat"] + 9


def test_events_jsonl_schema(tiny, tmp_path):
    path = tmp_path / "ev.jsonl"
    r = gen(tiny, "Hello", "--max-tokens", 10, "--block-size", 3, "--seed", 7, "--events", path,
            "--fixed-width")  # every round offers its block
    assert r.exit_code == 0, r.output
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    blocks, summary = rows[:-1], rows[-1]
    keys = {"type", "index", "tokens", "text", "drafted", "accepted", "accept_flags", "draft_s",
            "verify_s", "block_size", "prompt_tokens", "reused_tokens", "prompt_s",
            "generation_tokens", "finish_reason", "trimmed", "lookup_flags", "note", "tree_nodes",
            "branch_tokens", "grammar_cut", "logprobs", "top_logprobs", "reasoning", "content"}
    assert all(set(b) == keys and b["type"] == "block" for b in blocks)
    # a model without think markers: all of its text is content (thinking: test_thinking_*)
    assert all(b["content"] == b["text"] and b["reasoning"] == "" for b in blocks)
    # no --logprobs, no grammar: those fields are null and 0
    assert all(b["logprobs"] is None and b["top_logprobs"] is None and b["grammar_cut"] == 0
               for b in blocks)
    assert [b["index"] for b in blocks] == list(range(len(blocks)))
    assert sum(len(b["tokens"]) for b in blocks) == 10
    assert "".join(b["text"] for b in blocks) + "\n" == r.stdout
    assert blocks[-1]["finish_reason"] == "length"
    assert all(len(b["drafted"]) == len(b["accept_flags"]) for b in blocks)
    assert all(b["block_size"] == 1 + len(b["drafted"]) for b in blocks)
    # every slot the block offered was verified or cut; max_tokens narrows the last blocks
    for b in blocks:
        before = b["generation_tokens"] - len(b["tokens"])
        assert len(b["drafted"]) + b["trimmed"] == min(3, 10 - before) - 1
    assert summary["type"] == "summary"
    for key in ("versions", "target", "draft", "block_size", "min_confidence", "sampling", "stats",
                "peak_memory_gb", "interrupted", "weights"):
        assert key in summary, key
    assert summary["versions"]["mlx"] and summary["versions"]["dflash-mlx"]
    assert summary["target"] == {"id": str(tiny.target), "revision": None,
                                 "path": str(tiny.target.resolve())}
    assert summary["draft"]["bits"] == 16 and summary["block_size"] == 3  # dense on the CPU
    assert summary["sampling"] == {"max_tokens": 10, "temperature": 0.0, "top_p": 1.0,
                                   "top_k": 0, "seed": 7}
    assert summary["stats"]["generation_tokens"] == 10


def test_ctrl_c_stops_at_a_block_boundary(tiny, monkeypatch):
    import dflash_mlx.generate as decode

    real = decode.stream_generate

    def interrupted(*a, **k):
        gen = real(*a, **k)
        yield next(gen)
        yield next(gen)
        raise KeyboardInterrupt

    monkeypatch.setattr(decode, "stream_generate", interrupted)
    r = gen(tiny, "Hello", "--max-tokens", 50, "--block-size", 3, "--min-confidence", 0,
            target=tiny.oracle_target, draft=tiny.oracle_draft)
    assert r.exit_code == 130
    assert r.stdout == "!!!!!!\n"  # two whole blocks of three
    assert "interrupted after 6 tokens" in r.stderr and "Generation: 6 tokens" in r.stderr
    assert "Traceback" not in r.output


def test_parity_check_matches(tiny):
    r = gen(tiny, "Hello", "--max-tokens", 24, "--check-parity")
    assert r.exit_code == 0, r.output
    assert "Parity: DFlash output equals AR greedy (24 tokens)" in r.stderr


def _tamper_ar(monkeypatch, scale):
    """The AR run of the parity check sees different target weights (a tampered target)."""
    import mlx.core as mx

    import dflash_mlx.bench.runner as bench

    real = bench.generate_once

    def tampered(pair, ids, block, sampling, config=None):
        if block == 1:
            norm = pair.target.model.model.norm
            mx.random.seed(0)
            norm.weight = scale(norm.weight)
        return real(pair, ids, block, sampling, config)

    monkeypatch.setattr(bench, "generate_once", tampered)


def test_parity_check_reports_a_real_mismatch(tiny, monkeypatch):
    _tamper_ar(monkeypatch, lambda w: -w)  # argmax becomes argmin
    r = gen(tiny, "Hello", "--max-tokens", 16, "--check-parity")
    assert r.exit_code == 1, r.output
    assert "first divergence at token 0" in r.stderr and "REAL MISMATCH" in r.stderr
    assert "near-tie below 0.01 for float32 weights" in r.stderr


def test_parity_check_calls_a_tiny_margin_a_near_tie(tiny, monkeypatch):
    import mlx.core as mx

    # All-zero logits plus 1e-6 noise: AR picks another token by a margin far below 0.01.
    _tamper_ar(monkeypatch, lambda w: 1e-6 * mx.random.normal(w.shape))
    r = gen(tiny, "Hello", "--max-tokens", 8, "--check-parity", "--min-confidence", 0,
            target=tiny.oracle_target, draft=tiny.oracle_draft)
    assert r.exit_code == 0, r.output
    assert "first divergence at token 0" in r.stderr and "→ near-tie" in r.stderr


def test_block_size_auto_measures_once_then_uses_the_cache(tiny, isolated_cache):
    # --no-pad-verify: padding reads the same cached curve, and would measure it first
    first = gen(tiny, "Hi", "--max-tokens", 4, "--block-size", "auto", "--no-pad-verify")
    assert first.exit_code == 0, first.output
    assert "--block-size auto →" in first.stderr and "measured now, cached" in first.stderr
    assert (isolated_cache / "verify-cost.json").is_file()
    second = gen(tiny, "Hi", "--max-tokens", 4, "--block-size", "auto")
    assert "cached measurement" in second.stderr


def test_verify_padding_follows_the_measured_curve(tiny, isolated_cache, tmp_path):
    from dflash_mlx.cpu import cost

    path = tmp_path / "ev.jsonl"

    def padded(*args):
        r = gen(tiny, "Hi", "--max-tokens", 6, "--events", path, *args)
        assert r.exit_code == 0, r.output
        return json.loads(path.read_text().splitlines()[-1])["verify_pad"]

    padded()  # measures this machine's curve once and caches it
    data = json.loads(cost.cache_file().read_text())
    (entry,) = data[cost.machine_key()].values()
    assert len(entry["verify"]) == 8
    # a curve with OpenBLAS's bump: 5-7 rows cost more than 8
    entry["verify"] = [1.0, 1.2, 1.25, 1.3, 1.6, 1.7, 1.65, 1.35]
    cost.cache_file().write_text(json.dumps(data))
    assert padded() == {"5": 8, "6": 8, "7": 8}
    assert padded("--no-pad-verify") == {}


@pytest.fixture
def registry_file(tiny, tmp_path, monkeypatch):
    path = tmp_path / "models.toml"
    path.write_text(f"""
[[model]]
name = "tiny-pair"
target = "{tiny.target}"
draft = "{tiny.draft}"
block_size = 4
reasoning_kwarg = "reasoning_effort"
reasoning_levels = ["low", "high"]
reasoning_default = "low"
memory_gb = 0.01
""")
    monkeypatch.setenv("DFLASH_MLX_MODELS", str(path))
    return path


def test_registry_name_and_draft_lookup(tiny, registry_file):
    by_name = run("generate", "Hi", "--model", "tiny-pair", "--max-tokens", 5, "--quiet")
    by_target = run("generate", "Hi", "--model", tiny.target, "--max-tokens", 5, "--quiet")
    assert by_name.exit_code == by_target.exit_code == 0, by_name.output + by_target.output
    assert by_name.stdout == by_target.stdout
    ok = run("generate", "Hi", "--model", "tiny-pair", "--reasoning", "high", "--max-tokens", 2)
    assert ok.exit_code == 0, ok.output


def test_default_pair_until_and_after_the_demo_draft_lands(tiny, monkeypatch):
    import dflash_mlx.demo.target as demo
    import dflash_mlx.registry as registry

    monkeypatch.setattr(registry, "DEMO_DRAFT", tiny.root / "not-there")
    r = run("generate", "Hi")
    assert r.exit_code == 2 and "demo draft is not available" in r.stderr
    monkeypatch.setattr(registry, "DEMO_DRAFT", tiny.draft)
    monkeypatch.setattr(demo, "demo_target_path", lambda fetch=True, progress=None: tiny.target)
    r = run("generate", "Hi", "--max-tokens", 3)
    assert r.exit_code == 0, r.output and r.stdout.strip()


def test_models_table_and_json(tiny, registry_file, isolated_cache, monkeypatch, tmp_path):
    hub = tmp_path / "hf-hub" / "models--z-lab--Qwen3-4B-DFlash-b16" / "snapshots" / ("a" * 40)
    hub.mkdir(parents=True)
    (hub / "config.json").write_text("{}")
    r = run("models")
    assert r.exit_code == 0, r.output
    for name in ("smollm2-demo", "qwen3-4b", "qwen3.8-27b", "tiny-pair"):
        assert name in r.stdout
    rows = {row["name"]: row for row in json.loads(run("models", "--json").stdout)}
    assert rows["qwen3-4b"]["cached"] == [False, True]
    assert rows["qwen3.5-122b-a10b"]["fits_64gb_mac"] is False
    assert rows["qwen3.8-27b"]["reasoning_kwarg"] == "reasoning_effort"


def test_fetch_demo_prints_the_path(monkeypatch, tmp_path):
    import dflash_mlx.demo.target as demo

    target = tmp_path / "demo.gguf"

    def fake(fetch=True, progress=None):
        progress("Downloading")
        return target

    monkeypatch.setattr(demo, "demo_target_path", fake)
    r = run("fetch-demo")
    assert r.exit_code == 0 and r.stdout.strip() == str(target) and "Downloading" in r.stderr
