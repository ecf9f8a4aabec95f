"""The client backend: against mlx_lm.server (a real third-party OpenAI-compatible server)
and against `dflash-mlx serve`, through the library and the CLI; plus the stats readers for
servers this machine cannot run (vLLM's /metrics counters, SGLang's meta_info)."""

from __future__ import annotations

import io
import json

import pytest
from typer.testing import CliRunner

from dflash_mlx.cli import app
from dflash_mlx.server.openai_client import (Completion, OpenAIClient, ServerError, Stream,
                                      vllm_counters, vllm_speculation)
from support import server as ss

runner = CliRunner()
HELLO = [{"role": "user", "content": "Hello there"}]
KEY = "client-key"


@pytest.fixture(scope="module")
def servers(tiny, tmp_path_factory):
    logs = tmp_path_factory.mktemp("client-logs")
    mlx = ss.start(["--model", str(tiny.target), "--log-level", "WARNING"], logs / "mlx_lm.log",
                   module="mlx_lm.server", serve=False)
    # a random draft and no context lookup: every round yields one token (τ 1.0 below)
    ours = ss.start(["--model", tiny.target, "--draft", tiny.draft, "--api-key", KEY,
                     "--log-level", "warning", "--no-lookup"], logs / "ours.log")
    try:
        yield ss.wait_ready(mlx), ss.wait_ready(ours)
    finally:
        mlx.stop()
        ours.stop()


@pytest.fixture(scope="module")
def mlx_lm_server(servers):
    return servers[0]


@pytest.fixture(scope="module")
def ours(servers):
    s = servers[1]
    s.headers = {"Authorization": f"Bearer {KEY}"}
    return s


@pytest.fixture(scope="module")
def greedy(tiny):
    """Our engine's greedy output (DFlash, block 5) for chat messages or plain text."""
    from dflash_mlx import load, stream_generate
    from dflash_mlx.chat import apply_template

    pair = load(tiny.target, tiny.draft)

    def run(prompt, max_tokens):
        ids = (pair.tokenizer.encode(prompt) if isinstance(prompt, str)
               else apply_template(pair.tokenizer, prompt))
        return "".join(e.text for e in stream_generate(pair, ids, max_tokens=max_tokens))

    return run


def invoke(*args, env=None):
    return runner.invoke(app, [str(a) for a in args], env=env)


def test_mlx_lm_server_greedy_equals_our_engine(mlx_lm_server, greedy):
    client = OpenAIClient(mlx_lm_server.url)  # no /v1: the client adds it
    for prompt in (HELLO, [{"role": "user", "content": "Write a haiku about the sea."}]):
        c = client.complete(prompt, max_tokens=32, temperature=0.0)
        assert c.text == greedy(prompt, 32)
        assert (c.completion_tokens, c.finish_reason, c.speculation) == (32, "length", None)
    c = client.complete("Once upon a time", max_tokens=16)  # /v1/completions, no template
    assert c.text == greedy("Once upon a time", 16)


def test_generate_backend_openai_renders_like_local(mlx_lm_server, ours, greedy):
    ref = greedy(HELLO, 20)
    r = invoke("generate", "Hello there", "--backend", "openai", "--base-url",
               mlx_lm_server.url + "/v1", "--max-tokens", 20)
    assert r.exit_code == 0, r.output
    assert r.stdout.rstrip("\n") == ref.rstrip("\n")
    assert "Generation: 20 tokens" in r.stderr and "Acceptance: n/a" in r.stderr

    r = invoke("generate", "Hello there", "--backend", "openai", "--base-url", ours.url + "/v1",
               "--max-tokens", 20, "--api-key", KEY)
    assert r.exit_code == 0, r.output
    assert r.stdout.rstrip("\n") == ref.rstrip("\n")
    assert "Acceptance: τ 1.00" in r.stderr and "(from dflash-mlx)" in r.stderr
    r = invoke("generate", "Hello there", "--backend", "openai", "--base-url", ours.url,
               "--max-tokens", 4, "--quiet", env={"DFLASH_MLX_API_KEY": KEY})
    assert r.exit_code == 0 and r.stderr == ""


def test_client_errors_are_one_line(ours, mlx_lm_server):
    cases = [
        (["--base-url", ours.url], "HTTP 401"),  # no key
        (["--base-url", ours.url, "--api-key", KEY, "--model", "gpt-9"], "does not exist"),
        (["--base-url", f"http://127.0.0.1:{ss.free_port()}"], "cannot reach"),
        (["--base-url", "localhost:8000"], "--base-url must be an http(s) URL"),
    ]
    for extra, msg in cases:
        r = invoke("generate", "Hi", "--backend", "openai", *extra)
        assert r.exit_code == 2 and msg in r.stderr and r.stderr.count("\n") == 1, r.output
    for args, msg in ((["generate", "Hi", "--backend", "openai"], "needs --base-url"),
                      (["generate", "Hi", "--base-url", ours.url], "goes with --backend openai"),
                      (["benchmark", "--concurrency", 0], "--concurrency must be at least 1"),
                      (["generate", "Hi", "--backend", "grpc"], "--backend must be")):
        r = invoke(*args)
        assert r.exit_code == 2 and msg in r.stderr, r.output


def test_benchmark_backend_openai(ours, mlx_lm_server, tmp_path):
    card = tmp_path / "card.json"
    r = invoke("benchmark", "--backend", "openai", "--base-url", ours.url, "--api-key", KEY,
               "--dataset", "gsm8k,mbpp", "--num-prompts", 3, "--max-tokens", 8,
               "--concurrency", 2, "--out", card)
    assert r.exit_code == 0, r.output
    rows = json.loads(card.read_text())["results"]
    assert [row["dataset"] for row in rows] == ["gsm8k", "mbpp"]
    for row in rows:
        assert (row["requests"], row["completion_tokens"], row["concurrency"]) == (3, 24, 2)
        assert row["speculation_source"] == "dflash-mlx" and row["tau"] == 1.0
        assert row["throughput_tps"] > 0 and row["usage_reported"]
        assert 0 < row["ttft_p50_ms"] <= row["ttft_p95_ms"]
        assert 0 < row["tpot_p50_ms"] <= row["tpot_p95_ms"]
    assert "gsm8k" in r.stdout and "mbpp" in r.stdout

    r = invoke("benchmark", "--backend", "openai", "--base-url", mlx_lm_server.url,
               "--num-prompts", 2, "--max-tokens", 8, "--concurrency", 2)
    assert r.exit_code == 0, r.output
    assert "n/a" in r.stdout  # mlx_lm.server reports no speculation stats


def test_closing_a_stream_stops_the_server_generation(ours, greedy):
    before = ours.health()
    client = OpenAIClient(ours.url, KEY)
    stream = client.stream(HELLO, max_tokens=1900)
    assert next(stream) and next(stream)
    stream.close()
    ss.wait_for(lambda: ours.health()["cancelled"] == before["cancelled"] + 1)
    c = client.complete(HELLO, max_tokens=12)
    assert c.text == greedy(HELLO, 12)
    # one chunk per block, even when a block's bytes are not whole characters yet
    assert c.chunks == c.speculation["rounds"] == 12


# -- stats readers for vLLM and SGLang (no server of theirs here) ----------------------------

VLLM_METRICS = """\
# HELP vllm:spec_decode_num_drafts_total Number of spec decoding drafts.
# TYPE vllm:spec_decode_num_drafts_total counter
vllm:spec_decode_num_drafts_total{engine="0",model_name="m"} %d
vllm:spec_decode_num_draft_tokens_total{engine="0",model_name="m"} %d
vllm:spec_decode_num_accepted_tokens_total{engine="0",model_name="m"} %d
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="m",position="0"} %d
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="m",position="1"} %d
vllm:generation_tokens_total{model_name="m"} 999
"""


def test_vllm_counters_give_tau_and_per_position_acceptance():
    before = vllm_counters(VLLM_METRICS % (10, 20, 12, 7, 5))
    after = vllm_counters(VLLM_METRICS % (110, 220, 162, 87, 75))
    s = vllm_speculation(before, after)
    # 100 drafts of 2 tokens, 150 accepted: τ = 1 + 150/100; position 1: 80/100, then 70/80
    assert s["tau"] == pytest.approx(2.5) and s["acceptance_rates"] == pytest.approx([0.8, 0.875])
    assert (s["drafted_tokens"], s["accepted_tokens"], s["rounds"]) == (200, 150, 100)
    assert vllm_speculation(after, after) is None and vllm_counters("up 1") is None


class _Response(io.BytesIO):
    def __iter__(self):
        return iter(self.getvalue().splitlines(keepends=True))


def test_sglang_meta_info_and_sse_framing():
    events = [
        ": keep-alive",
        'data: {"choices": [{"index": 0, "delta": {"role": "assistant"}}]}',
        "",
        'data: {"choices": [{"index": 0, "delta": {"content": "Hel"}}]}',
        "",
        'data: {"choices": [{"index": 0, "delta": {"content": "lo"}, "finish_reason": "stop",',
        'data:  "meta_info": {"spec_accept_length": 2.5, "spec_verify_ct": 4,',
        'data:   "spec_accept_histogram": [1, 1, 2], "spec_draft_token_num": 12,',
        'data:   "spec_accept_token_num": 6}}]}',
        "",
        'data: {"choices": [], "usage": {"prompt_tokens": 5, "completion_tokens": 10}}',
        "",
        "data: [DONE]",
        "",
    ]
    stream = Stream(_Response("\n".join(events).encode()), Completion())
    assert list(stream) == ["Hel", "lo"]
    r = stream.result
    assert (r.text, r.finish_reason, r.prompt_tokens, r.completion_tokens) == ("Hello", "stop", 5, 10)
    s = r.speculation
    assert s["source"] == "sglang meta_info" and s["tau"] == 2.5 and s["rounds"] == 4
    assert s["acceptance_rates"] == pytest.approx([0.75, 2 / 3])  # from steps per accept count
    assert (s["drafted_tokens"], s["accepted_tokens"]) == (12, 6)


def test_mid_stream_error_event_raises():
    body = b'data: {"choices": [{"delta": {"content": "a"}}]}\n\ndata: {"error": {"message": "boom"}}\n\n'
    stream = Stream(_Response(body), Completion())
    assert next(stream) == "a"
    with pytest.raises(ServerError, match="boom"):
        next(stream)
