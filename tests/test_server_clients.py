"""What clients expect around the API: a short model id with its aliases, /v1/models/{id},
CORS for browser pages, /metrics in Prometheus' text format (tiny pair, real HTTP)."""

from __future__ import annotations

import re

import pytest

from support import server as ss

HELLO = [{"role": "user", "content": "Hello there"}]
ORIGIN = "http://localhost:3000"


@pytest.fixture(scope="module")
def server(tiny, tmp_path_factory):
    log = tmp_path_factory.mktemp("clients") / "server.log"
    s = ss.wait_ready(ss.start(["--model", str(tiny.target), "--draft", str(tiny.draft),
                                "--log-level", "warning", "--allowed-origins", ORIGIN], log))
    yield s
    assert s.stop() in (0, 130)
    assert "Traceback" not in log.read_text()


def test_the_model_id_is_the_folder_name_and_its_aliases_are_accepted(server, tiny):
    status, body = server.get("/v1/models")
    assert status == 200 and body["data"][0]["id"] == "target"  # tiny.target is .../target
    for name in ("target", str(tiny.target), "dflash"):
        status, card = server.get(f"/v1/models/{name}")
        assert status == 200 and card["id"] == name and card["object"] == "model"
        status, out = server.post("/v1/chat/completions",
                                  {"model": name, "messages": HELLO, "max_tokens": 2})
        assert status == 200, out
    status, out = server.get("/v1/models/gpt-9")
    assert status == 404 and out["error"]["code"] == "model_not_found"
    status, out = server.post("/v1/chat/completions",
                              {"model": "gpt-9", "messages": HELLO, "max_tokens": 2})
    assert status == 404 and "'target'" in out["error"]["message"]


def test_served_model_name_sets_the_id(tiny, tmp_path):
    s = ss.wait_ready(ss.start(["--model", str(tiny.target), "--draft", str(tiny.draft),
                                "--log-level", "warning", "--served-model-name", "my-llm"],
                               tmp_path / "log"))
    try:
        assert s.get("/v1/models")[1]["data"][0]["id"] == "my-llm"
        assert s.get("/v1/models/target")[0] == 200  # the folder name stays an alias
    finally:
        s.stop()


def test_cors_preflight_and_headers_for_an_allowed_origin_only(server):
    status, _ = server.request("OPTIONS", "/v1/chat/completions", headers={
        "Origin": ORIGIN, "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "authorization, content-type"})
    assert status == 200
    conn_headers = _headers(server, "GET", "/v1/models", {"Origin": ORIGIN})
    assert conn_headers.get("access-control-allow-origin") == ORIGIN
    other = _headers(server, "GET", "/v1/models", {"Origin": "http://evil.example"})
    assert "access-control-allow-origin" not in other
    status, _ = server.request("OPTIONS", "/v1/chat/completions", headers={
        "Origin": "http://evil.example", "Access-Control-Request-Method": "POST"})
    assert status == 400


def _headers(server, method, path, headers) -> dict:
    import http.client

    conn = http.client.HTTPConnection(ss.HOST, server.port, timeout=30)
    try:
        conn.request(method, path, headers=headers)
        r = conn.getresponse()
        r.read()
        return {k.lower(): v for k, v in r.getheaders()}
    finally:
        conn.close()


SAMPLE = re.compile(r'^dflash_[a-z_]+(\{[a-z_]+="[^"]*"(,[a-z_]+="[^"]*")*\})? -?[0-9.e+-]+$')


def _metrics(server) -> dict:
    status, text = server.get("/metrics")
    assert status == 200 and isinstance(text, str)
    values = {}
    for line in text.splitlines():
        if line.startswith("#"):
            assert re.match(r"^# (HELP|TYPE) dflash_[a-z_]+ ", line), line
            continue
        assert SAMPLE.match(line), line
        name, value = line.rsplit(" ", 1)
        values[name] = float(value)
    return values


def test_metrics_count_what_happened(server):
    before = _metrics(server)
    status, body = server.post("/v1/chat/completions", {"messages": HELLO, "max_tokens": 6})
    assert status == 200
    assert server.post("/v1/chat/completions", {"messages": "x"})[0] == 400
    after = _metrics(server)
    grew = {k: after[k] - before.get(k, 0) for k in after}
    assert grew['dflash_requests_total{outcome="completed"}'] == 1
    assert grew["dflash_generation_tokens_total"] == body["usage"]["completion_tokens"]
    cached = body["usage"]["prompt_tokens_details"]["cached_tokens"]
    # the prompt's last token is fed with the first round, so it is neither prefilled nor reused
    assert grew["dflash_prompt_tokens_total"] + cached in (body["usage"]["prompt_tokens"] - 1,
                                                           body["usage"]["prompt_tokens"])
    assert grew["dflash_prompt_tokens_total"] == body["speculation"]["prompt_tokens"]
    assert grew["dflash_prompt_cached_tokens_total"] == cached
    assert grew['dflash_http_responses_total{path="/v1/chat/completions",status="400"}'] == 1
    assert grew["dflash_rounds_total"] == body["speculation"]["rounds"]
    assert after["dflash_queued"] == 0 and after["dflash_running"] == 0
    assert 'dflash_acceptance_rate{position="1"}' in after


@pytest.mark.parametrize("value", ["localhost:3000", "", "http://a/b"])
def test_bad_allowed_origins_are_one_line(tiny, value):
    from typer.testing import CliRunner

    from dflash_mlx.cli.main import app

    r = CliRunner().invoke(app, ["serve", "--model", str(tiny.target), "--draft",
                                 str(tiny.draft), "--allowed-origins", value, "--port", "0"])
    assert r.exit_code == 2, r.output
    assert "--allowed-origins" in r.output and "Traceback" not in r.output
