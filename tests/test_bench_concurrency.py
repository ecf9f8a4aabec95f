"""`benchmark --concurrency N`: a closed loop of N requests in flight on one batch, in process
(plain decoding against DFlash) and against a server; per-request TTFT and time per output token.

Every request's greedy output in the loop equals its output alone; the card counts what ran;
the percentiles are ordered; a bad --concurrency is one line and exit 2.
"""

from __future__ import annotations

import io
import json

import pytest
from typer.testing import CliRunner

from dflash_mlx.cli import app
from dflash_mlx.latency import percentile, spread_ms, tpot

runner = CliRunner()


def invoke(*args):
    return runner.invoke(app, [str(a) for a in args])


@pytest.fixture(autouse=True)
def _cache(isolated_cache):
    return isolated_cache


def test_percentiles_and_tpot():
    assert percentile([3.0, 1.0, None, 2.0, 4.0], 50) == 2.5  # the median, Nones left out
    assert percentile([1.0, 2.0, 3.0, 4.0, 5.0], 95) == pytest.approx(4.8)
    assert percentile([7.0], 95) == 7.0 and percentile([None], 50) is None
    assert tpot(1.0, 1.6, 4) == pytest.approx(0.2)  # three gaps after the first token
    assert tpot(1.0, 1.0, 1) is None and tpot(None, 2.0, 5) is None
    assert spread_ms("ttft", [0.01, 0.03]) == {"ttft_p50_ms": 20.0, "ttft_p95_ms": 29.0}


def test_each_request_in_the_loop_equals_its_run_alone(tiny):
    """Prompts of different lengths join as slots free; each output, plain and DFlash, is
    exactly what `stream_generate` gives that prompt alone."""
    from dflash_mlx import SpeculationConfig, stream_generate
    from dflash_mlx.bench import concurrent
    from dflash_mlx.loader import load

    pair = load(tiny.target, tiny.draft)
    config = SpeculationConfig.for_pair(pair, min_confidence=0.0, block_size=4)

    def encode(messages):
        return pair.tokenizer.encode(" ".join(m["content"] for m in messages))

    texts = ["The cat sat. The cat sat. The cat", "one two three", "hello", "x y z x y z x",
             "a b"]
    results = concurrent.run(pair, {"mine": [[t] for t in texts]}, encode, config=config,
                             concurrency=2, max_tokens=10)
    for system, cfg in (("plain", config.replace(block_size=1)), ("dflash", config)):
        (run,) = results["mine"][system]
        assert [r.index for r in run.requests] == list(range(len(texts)))
        for r, text in zip(run.requests, texts):
            alone = [t for ev in stream_generate(pair, encode([{"content": text}]), cfg,
                                                 max_tokens=10) for t in ev.tokens]
            assert r.tokens == alone, (system, text)
            assert r.ttft_s > 0 and r.first <= r.last and r.arrival <= r.first
        # the first two arrive at the start, the rest as slots free
        assert run.requests[0].arrival == run.requests[1].arrival < run.requests[2].arrival
    (row,) = concurrent.summarize(results, concurrency=2, block_size=4, greedy=True)
    assert row["greedy_match"] == 1.0 and row["requests"] == 5
    assert row["dflash"]["generation_tokens"] == sum(len(r.tokens) for r in
                                                      results["mine"]["dflash"][0].requests)


def test_benchmark_concurrency_command_writes_a_card(tiny, tmp_path):
    out = tmp_path / "card.json"
    r = invoke("benchmark", "--model", tiny.oracle_target, "--draft", tiny.oracle_draft,
               "--dataset", "gsm8k,mt-bench", "--num-prompts", 3, "--max-tokens", 6,
               "--block-size", 4, "--min-confidence", 0, "--fixed-width", "--concurrency", 2,
               "--repeats", 2, "--out", out)
    assert r.exit_code == 0, r.output
    assert "DFlash B4" in r.stdout and "plain" in r.stdout and "TTFT" in r.stdout
    card = json.loads(out.read_text())
    assert card["schema"] == "dflash-mlx/concurrency-card/1"
    s = card["settings"]
    assert (s["concurrency"], s["repeats"], s["block_sizes"], s["max_tokens"]) == (2, 2, [4], 6)
    rows = {row["dataset"]: row for row in card["results"]}
    assert set(rows) == {"gsm8k", "mt-bench", "all"}
    assert [rows[d]["requests"] for d in ("gsm8k", "mt-bench", "all")] == [3, 3, 6]
    for row in rows.values():
        assert row["concurrency"] == 2 and row["greedy_match"] == 1.0
        for system in ("plain", "dflash"):
            f = row[system]
            # the oracle target never stops early: every request runs to --max-tokens
            assert f["generation_tokens"] == 6 * row["requests"]
            assert f["tps"] > 0 and f["wall_s"] > 0
            assert 0 < f["ttft_p50_ms"] <= f["ttft_p95_ms"]
            assert 0 < f["tpot_p50_ms"] <= f["tpot_p95_ms"]
        assert row["speedup"] == pytest.approx(row["dflash"]["tps"] / row["plain"]["tps"],
                                               rel=1e-3)
    assert rows["gsm8k"]["tau"] == pytest.approx(3.0)  # the oracle: rounds of 4, then 2
    assert len(card["samples"]) == 6
    for sample in card["samples"]:
        for system in ("plain", "dflash"):
            assert sample[system]["generation_tokens"] == 6
            assert sample[system]["ttft_ms"] > 0 and sample[system]["tpot_ms"] > 0
        assert sample["dflash"]["first_divergence"] is None


@pytest.mark.parametrize("args, msg", [
    (["--concurrency", 0], "--concurrency must be at least 1, got 0"),
    (["--concurrency", -3], "--concurrency must be at least 1, got -3"),
    (["--concurrency", 100000], "--concurrency must be at most 256, got 100000"),
    (["--concurrency", 2, "--block-size", "3,5"], "give one --block-size, not a list"),
    (["--concurrency", 0, "--backend", "openai", "--base-url", "http://127.0.0.1:9/v1"],
     "--concurrency must be at least 1, got 0"),
])
def test_bad_concurrency_is_one_line(tiny, args, msg):
    r = invoke("benchmark", "--model", tiny.target, "--draft", tiny.draft, *args)
    assert r.exit_code == 2, r.output
    assert r.stderr.startswith("error:") and r.stderr.count("\n") == 1 and msg in r.stderr
    assert "Traceback" not in r.output


def test_concurrency_help_says_it_runs_locally():
    r = invoke("benchmark", "--help")
    assert r.exit_code == 0 and "Locally" in r.stdout and "--concurrency" in r.stdout


class _Response(io.BytesIO):
    def __iter__(self):
        return iter(self.getvalue().splitlines(keepends=True))


def test_remote_rows_have_ttft_and_tpot_percentiles():
    from dflash_mlx.cli.bench_tables import remote_bench_table
    from dflash_mlx.server.openai_client import Completion, RemoteRun, Stream, summarize

    body = b"".join(b'data: {"choices": [{"delta": {"content": "%s"}}]}\n\n' % t
                    for t in (b"a", b"b", b"c")) + b"data: [DONE]\n\n"
    stream = Stream(_Response(body), Completion())
    assert list(stream) == ["a", "b", "c"]
    c = stream.result
    assert c.first <= c.last <= c.end and c.tpot_s == pytest.approx((c.last - c.first) / 2)

    def done(ttft, last, tokens):
        return Completion(completion_tokens=tokens, start=0.0, first=ttft, last=last, end=last)

    cs = [done(0.1, 0.5, 5), done(0.2, 1.2, 11), done(0.3, 0.3, 1)]  # the last: no TPOT
    (row,) = summarize([RemoteRun("gsm8k", cs, 2.0, 3)])
    assert (row["ttft_p50_ms"], row["ttft_p95_ms"]) == (200.0, 290.0)
    assert (row["tpot_p50_ms"], row["tpot_p95_ms"]) == (100.0, 100.0)
    from rich.console import Console

    console = Console(file=io.StringIO(), width=140)
    console.print(remote_bench_table([row], "server"))
    text = console.file.getvalue()
    assert "TTFT p50" in text and "TPOT p50" in text and "290" in text
