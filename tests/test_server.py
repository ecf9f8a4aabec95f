"""`dflash-mlx serve` on tiny pairs, on 127.0.0.1 with free ports, driven over plain HTTP.

Two servers run for the whole module: a random pair (text is gibberish but deterministic, and
must equal the engine's own greedy output) and an oracle pair with an API key and a queue of
one (every draft accepted, so the speculation stats are known exactly).
"""

from __future__ import annotations

import threading

import pytest

from dflash_mlx.stats import Stats
from support import server as ss
from support.load import run_load

CHAT, TEXT = "/v1/chat/completions", "/v1/completions"
HELLO = [{"role": "user", "content": "Hello there"}]
KEY = "sekret-key"


@pytest.fixture(scope="module")
def servers(tiny, tmp_path_factory):
    logs = tmp_path_factory.mktemp("server-logs")
    # fixed widths: the speculation stats are compared round for round with the engine's
    plain = ss.start(["--model", tiny.target, "--draft", tiny.draft, "--log-level", "warning",
                      "--fixed-width"], logs / "plain.log")
    keyed = ss.start(["--model", tiny.oracle_target, "--draft", tiny.oracle_draft,
                      "--block-size", "4", "--min-confidence", "0", "--api-key", KEY,
                      "--queue-size", "1", "--fixed-width", "--max-batch", "1",
                      "--served-model-name", "oracle", "--log-level", "warning"],
                     logs / "keyed.log")
    try:
        yield ss.wait_ready(plain), ss.wait_ready(keyed)
    finally:
        codes = plain.stop(), keyed.stop()
    # Ctrl-C ends both cleanly (no traceback, no abort, no kill after the 15 s grace) even after
    # cancelled generations. Usually exit 130; one loaded CI run of five saw 0 for both, with
    # nothing in their logs (cause not pinned down; likely uvicorn's re-raise of the captured
    # SIGINT meeting asyncio's runner handler at shutdown), so either code is a clean stop.
    assert all(c in (0, 130) for c in codes), codes
    for s in (plain, keyed):
        assert "Traceback" not in s.log.read_text() and "terminate" not in s.log.read_text()


@pytest.fixture(scope="module")
def server(servers):
    return servers[0]


@pytest.fixture(scope="module")
def keyed(servers):
    s = servers[1]
    s.headers = {"Authorization": f"Bearer {KEY}"}
    return s


@pytest.fixture(scope="module")
def engine(tiny):
    """The same pair in this process: the reference outputs."""
    from dflash_mlx import load, stream_generate
    from dflash_mlx.chat import apply_template

    pair = load(tiny.target, tiny.draft)

    def greedy(prompt, max_tokens):
        chat = isinstance(prompt, list) and isinstance(prompt[0], dict)
        ids = apply_template(pair.tokenizer, prompt) if chat else prompt
        events = list(stream_generate(pair, ids, max_tokens=max_tokens, adaptive=False))
        return "".join(e.text for e in events), events

    greedy.pair = pair
    return greedy


def _text(events: list) -> str:
    out = []
    for e in events:
        if e == "[DONE]" or not e.get("choices"):
            continue
        c = e["choices"][0]
        out.append(c["delta"].get("content") or "" if "delta" in c else c["text"])
    return "".join(out)


def test_chat_streaming_and_not_equal_engine_greedy(server, engine):
    from dflash_mlx.chat import apply_template

    ref, events = engine(HELLO, 24)
    status, body = server.post(CHAT, {"messages": HELLO, "max_tokens": 24})
    assert status == 200, body
    assert body["object"] == "chat.completion" and body["id"].startswith("chatcmpl-")
    assert body["choices"][0]["message"] == {"role": "assistant", "content": ref}
    assert body["choices"][0]["finish_reason"] == "length"
    n_prompt = len(apply_template(engine.pair.tokenizer, HELLO))
    usage = body["usage"]
    assert (usage["prompt_tokens"], usage["completion_tokens"]) == (n_prompt, 24)
    assert usage["total_tokens"] == n_prompt + 24
    spec = body["speculation"]
    assert spec["rounds"] == len(events) and spec["generation_tokens"] == 24
    assert spec["tau"] == pytest.approx(24 / len(events), abs=1e-3)
    assert spec["drafted_tokens"] == sum(len(e.drafted) for e in events)
    assert spec["accepted_tokens"] == sum(e.accepted for e in events)
    assert spec["lookup_slots"] == sum(sum(e.lookup_flags) for e in events)
    assert spec["lookup_accepted"] == sum(
        f and a for e in events for f, a in zip(e.lookup_flags, e.accept_flags))

    status, chunks = server.events(CHAT, {"messages": HELLO, "max_tokens": 24,
                                          "stream_options": {"include_usage": True}})
    assert status == 200 and chunks[-1] == "[DONE]"
    assert _text(chunks) == ref
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    assert all(c["object"] == "chat.completion.chunk" for c in chunks[:-1])
    assert len({c["id"] for c in chunks[:-1]}) == 1
    final, usage_chunk = chunks[-3], chunks[-2]
    assert final["choices"][0]["finish_reason"] == "length" and "speculation" in final
    assert usage_chunk["choices"] == [] and usage_chunk["usage"]["completion_tokens"] == 24
    # the same prompt again is served from the session's caches
    assert usage_chunk["usage"]["prompt_tokens_details"]["cached_tokens"] == n_prompt - 1


def test_text_completions(server, engine):
    ref, _ = engine(engine.pair.tokenizer.encode("Once upon"), 16)
    status, body = server.post(TEXT, {"prompt": "Once upon", "max_tokens": 16})
    assert status == 200 and body["object"] == "text_completion"
    assert body["choices"][0]["text"] == ref
    ids = engine.pair.tokenizer.encode("Once upon")
    status, chunks = server.events(TEXT, {"prompt": ids, "max_tokens": 16})
    assert status == 200 and _text(chunks) == ref and "usage" not in chunks[-2]


def test_stop_strings_cut_the_text_and_stop_generating(server, engine):
    ref, _ = engine(HELLO, 40)
    stop = ref[6:8]  # two characters: with a random draft they arrive in different blocks
    cut = ref.index(stop)
    for stream in (False, True):
        body = {"messages": HELLO, "max_tokens": 40, "stop": [stop, "never-seen"]}
        if stream:
            status, chunks = server.events(CHAT, body)
            text, finish = _text(chunks), chunks[-2]["choices"][0]["finish_reason"]
        else:
            status, obj = server.post(CHAT, body)
            text, finish = obj["choices"][0]["message"]["content"], obj["choices"][0]["finish_reason"]
            assert obj["usage"]["completion_tokens"] < 40
        assert status == 200 and (text, finish) == (ref[:cut], "stop")


def test_disconnect_mid_stream_stops_generation_and_next_request_is_exact(server, engine):
    before = server.health()
    conn, resp = ss.open_stream(server, CHAT, {"messages": HELLO, "max_tokens": 1900})
    for _ in range(6):  # role chunk, a blank line, then text: generation is under way
        assert resp.readline()
    ss.hang_up(conn, resp)
    # the worker notices at its next block boundary and counts the job as cancelled
    health = ss.wait_for(lambda: (h := server.health())["cancelled"] > before["cancelled"] and h)
    assert health["status"] == "ok" and not health["running"]
    ref, _ = engine(HELLO, 20)
    status, body = server.post(CHAT, {"messages": HELLO, "max_tokens": 20})
    assert status == 200 and body["choices"][0]["message"]["content"] == ref
    assert body["usage"]["prompt_tokens_details"]["cached_tokens"] > 0  # caches were kept


LONG = "x" * 3000  # byte-level tokenizer: 3000 tokens, over the 2048-token context


@pytest.mark.parametrize("path,body,status,param", [
    (CHAT, None, 400, None),  # malformed JSON (raw body below)
    (CHAT, [1, 2], 400, None),
    (CHAT, {"model": "gpt-4", "messages": HELLO}, 404, "model"),
    (CHAT, {"messages": []}, 400, "messages"),
    (CHAT, {"messages": [{"role": "wizard", "content": "hi"}]}, 400, "messages"),
    (CHAT, {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, 400, "messages"),
    (CHAT, {"messages": [{"role": "user", "content": "  "}]}, 400, "messages"),
    (CHAT, {"messages": HELLO, "temperature": -1}, 400, "temperature"),
    (CHAT, {"messages": HELLO, "top_p": 0}, 400, "top_p"),
    (CHAT, {"messages": HELLO, "top_k": "ten"}, 400, "top_k"),
    (CHAT, {"messages": HELLO, "max_tokens": 0}, 400, "max_tokens"),
    (CHAT, {"messages": HELLO, "max_tokens": 2.5}, 400, "max_tokens"),
    (CHAT, {"messages": HELLO, "seed": True}, 400, "seed"),
    (CHAT, {"messages": HELLO, "stop": 7}, 400, "stop"),
    (CHAT, {"messages": HELLO, "stream": "yes"}, 400, "stream"),
    (CHAT, {"messages": HELLO, "n": 2}, 400, "n"),
    (CHAT, {"messages": HELLO, "logprobs": "yes"}, 400, "logprobs"),
    (CHAT, {"messages": HELLO, "echo": True}, 400, "echo"),  # a completions field
    (TEXT, {"prompt": "Hi", "echo": True}, 400, "echo"),
    (CHAT, {"messages": HELLO, "chat_template_kwargs": "x"}, 400, "chat_template_kwargs"),
    (CHAT, {"messages": HELLO, "reasoning_effort": 3}, 400, "reasoning_effort"),
    (CHAT, {"messages": [{"role": "user", "content": LONG}]}, 400, "messages"),
    (CHAT, {"messages": HELLO, "max_tokens": 2040}, 400, "max_tokens"),
    (TEXT, {"prompt": LONG}, 400, "prompt"),
    (TEXT, {"prompt": [1, 99999]}, 400, "prompt"),
    (TEXT, {"prompt": {"a": 1}}, 400, "prompt"),
    (TEXT, {"prompt": ["a", "b"]}, 400, "prompt"),
])
def test_bad_requests_get_openai_errors(server, path, body, status, param):
    raw = b'{"messages": [' if body is None else None
    got, obj = server.post(path, body, raw=raw)
    assert got == status, obj
    err = obj["error"]
    assert err["message"] and err["type"] == "invalid_request_error" and err["param"] == param
    over = LONG in repr(body) or (isinstance(body, dict) and body.get("max_tokens") == 2040)
    assert (err["code"] == "context_length_exceeded") == over


def test_routes_models_health(server):
    assert server.get("/v1/models")[1]["data"][0]["dflash"]["block_size"] == 5
    assert server.request("GET", CHAT)[0] == 405
    status, obj = server.get("/v1/nothing")
    assert status == 404 and obj["error"]["message"]
    health = server.health()
    assert health["status"] == "ok" and health["failed"] == 0
    # the speculation object over every request so far: the one stats schema (docs/stats.md)
    assert set(health["speculation"]) == set(Stats().as_dict())
    assert health["speculation"]["generation_tokens"] > 0


def test_api_key_required_when_set(keyed, server):
    for headers in ({"Authorization": ""}, {"Authorization": "Bearer wrong"},
                    {"Authorization": KEY}):
        status, obj = keyed.post(CHAT, {"messages": HELLO, "max_tokens": 4}, headers=headers)
        assert status == 401 and obj["error"]["code"] == "invalid_api_key"
    assert keyed.get("/v1/models", headers={"Authorization": ""})[0] == 401
    assert keyed.get("/health", headers={"Authorization": ""})[0] == 200
    assert keyed.post(CHAT, {"messages": HELLO, "max_tokens": 4})[0] == 200
    assert keyed.post(CHAT, {"model": "oracle", "messages": HELLO, "max_tokens": 4})[0] == 200
    assert server.post(CHAT, {"messages": HELLO, "max_tokens": 4},
                       headers={"Authorization": "Bearer anything"})[0] == 200  # no key: open


def test_speculation_stats_of_an_oracle_draft(keyed):
    status, obj = keyed.post(CHAT, {"messages": HELLO, "max_tokens": 12})
    assert status == 200 and obj["choices"][0]["message"]["content"] == "!" * 12
    spec = obj["speculation"]
    assert (spec["tau"], spec["rounds"], spec["acceptance_rates"]) == (4.0, 3, [1.0, 1.0, 1.0])
    assert spec["drafted_tokens"] == spec["accepted_tokens"] == 9


def test_full_queue_answers_503_and_recovers(keyed):
    before = keyed.health()
    conn, resp = ss.open_stream(keyed, CHAT, {"messages": HELLO, "max_tokens": 1900})
    assert resp.readline()  # running
    queued = {}
    t = threading.Thread(target=lambda: queued.update(
        r=keyed.post(CHAT, {"messages": HELLO, "max_tokens": 8})))
    t.start()
    ss.wait_for(lambda: keyed.health()["queued"] == 1)
    status, obj = keyed.post(CHAT, {"messages": HELLO, "max_tokens": 8})
    assert status == 503 and obj["error"]["type"] == "server_error"
    ss.hang_up(conn, resp)
    t.join(60)
    assert queued["r"][0] == 200 and queued["r"][1]["choices"][0]["message"]["content"] == "!" * 8
    health = keyed.health()
    assert health["cancelled"] == before["cancelled"] + 1 and health["status"] == "ok"


def test_bounded_load_50_sequential_20_concurrent(server):
    fig = run_load(server.url, sequential=50, concurrent=20, max_tokens=8)
    for name in ("sequential", "concurrent"):
        assert fig[name]["lost"] == 0, fig[name]["errors"]
        assert fig[name]["completion_tokens"] == 8 * fig[name]["sent"]
    assert fig["health"]["status"] == "ok" and fig["passed"]


def test_seed_makes_sampling_reproducible(server):
    body = {"messages": HELLO, "max_tokens": 16, "temperature": 1.0, "top_p": 0.9, "top_k": 50}
    a = server.post(CHAT, {**body, "seed": 7})[1]["choices"][0]["message"]["content"]
    b = server.post(CHAT, {**body, "seed": 7})[1]["choices"][0]["message"]["content"]
    c = server.post(CHAT, {**body, "seed": 8})[1]["choices"][0]["message"]["content"]
    assert a == b and a != c


class _Tokenizer:
    """The tiny tokenizer with a template that shows the kwargs it was given."""

    chat_template = ("{{ messages[-1]['content'] }}"
                     "{% if enable_thinking is defined %}|think={{ enable_thinking }}{% endif %}"
                     "{% if reasoning_effort is defined %}|effort={{ reasoning_effort }}{% endif %}")

    def __init__(self, tok):
        self.tok = tok

    def apply_chat_template(self, messages, **kw):
        return self.tok.apply_chat_template(messages, chat_template=self.chat_template, **kw)

    def rendered(self, ids):
        return self.tok.decode(ids)


def test_reasoning_effort_and_chat_template_kwargs_reach_the_template(engine):
    from types import SimpleNamespace

    from dflash_mlx.registry import Entry
    from dflash_mlx.server.messages import chat_prompt
    from dflash_mlx.server.request import APIError, ServerConfig

    tok = _Tokenizer(engine.pair.tokenizer)
    pair = SimpleNamespace(tokenizer=tok, target=engine.pair.target)
    qwen = Entry("qwen-like", "org/target", reasoning_kwarg="enable_thinking",
                 reasoning_levels=("on", "off"), reasoning_default="on")

    def render(body, entry=None):
        ids = chat_prompt(pair, {"messages": HELLO, **body}, ServerConfig("m", entry=entry)).ids
        return tok.rendered(ids)

    # mlx-lm's tokenizer wrapper sets enable_thinking=False when the vocabulary has no think tags
    assert render({}) == "Hello there|think=False"
    assert render({"reasoning_effort": "high"}) == "Hello there|think=False|effort=high"
    assert render({"reasoning_effort": "on"}) == "Hello there|think=True"
    assert render({"reasoning_effort": "none"}) == "Hello there|think=False"
    assert render({}, qwen) == "Hello there|think=True"  # the registry's default level
    assert render({"reasoning_effort": "off"}, qwen) == "Hello there|think=False"
    assert render({"chat_template_kwargs": {"enable_thinking": False}}, qwen) == \
        "Hello there|think=False"
    with pytest.raises(APIError, match="must be one of on, off"):
        render({"reasoning_effort": "high"}, qwen)


def test_serve_option_errors_are_one_line(server, tiny):
    from typer.testing import CliRunner

    from dflash_mlx.cli import app

    base = ["serve", "--model", str(tiny.target), "--draft", str(tiny.draft)]
    for extra, msg in ((["--port", str(server.port)], f"cannot listen on 127.0.0.1:{server.port} "
                        "(Address already in use)"),
                       (["--queue-size", "0"], "--queue-size must be at least 1"),
                       (["--log-level", "loud"], "--log-level must be one of"),
                       (["--temp", "-1"], "temperature must be")):
        r = CliRunner().invoke(app, base + extra)
        assert r.exit_code == 2 and msg in r.stderr and r.stderr.count("\n") == 1, r.output
