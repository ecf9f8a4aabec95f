"""Continuous batching in `dflash-mlx serve --max-batch` (tiny pairs, real HTTP on 127.0.0.1):
concurrent greedy requests each return exactly what they return alone and what a server
running one at a time returns, a client that leaves mid-stream leaves the others exact, a
grammar request runs between rounds, latencies reach /metrics and the log, and only a request
past the queue gets a 503 with Retry-After. Plus, in process: a round that raises fails its
requests alone and the worker goes on with a fresh batch."""

from __future__ import annotations

import asyncio
import http.client
import json
import re
import threading

import pytest

from support import server as ss

CHAT = "/v1/chat/completions"
HELLO = [{"role": "user", "content": "Hello there"}]
ASKS = ["Hello there", "Tell me a story about a cat", "What is two plus two?",
        "Name three colors and a fruit"]


def _chat(content: str) -> list[dict]:
    return [{"role": "user", "content": content}]


def _start(args: list[str], log):
    s = ss.start(args, log)
    try:
        return ss.wait_ready(s)
    except BaseException:
        s.stop()
        raise


@pytest.fixture(scope="module")
def servers(tiny, tmp_path_factory):
    """(batched: --max-batch 4, serial: --max-batch 1, oracle: --max-batch 2 --queue-size 1)."""
    logs = tmp_path_factory.mktemp("batch-logs")
    pair = ["--model", tiny.target, "--draft", tiny.draft]
    started = []
    try:
        started.append(_start(pair + ["--max-batch", "4", "--queue-size", "4",
                                      "--log-level", "info"], logs / "batched.log"))
        started.append(_start(pair + ["--max-batch", "1", "--log-level", "warning"],
                              logs / "serial.log"))
        started.append(_start(["--model", tiny.oracle_target, "--draft", tiny.oracle_draft,
                               "--block-size", "4", "--min-confidence", "0", "--max-batch", "2",
                               "--queue-size", "1", "--log-level", "warning"],
                              logs / "oracle.log"))
        yield started
    finally:
        codes = [s.stop() for s in started]
    assert all(c in (0, 130) for c in codes), codes
    for s in started:
        text = s.log.read_text()
        assert "Traceback" not in text and "terminate" not in text, text[-2000:]


@pytest.fixture(scope="module")
def batched(servers):
    return servers[0]


@pytest.fixture(scope="module")
def serial(servers):
    return servers[1]


@pytest.fixture(scope="module")
def oracle(servers):
    return servers[2]


def _streamed(server, messages, max_tokens: int, **extra) -> str:
    status, chunks = server.events(CHAT, {"messages": messages, "max_tokens": max_tokens,
                                          **extra})
    assert status == 200 and chunks[-1] == "[DONE]", chunks
    assert not any("error" in c for c in chunks[:-1] if isinstance(c, dict)), chunks
    return "".join(c["choices"][0]["delta"].get("content") or ""
                   for c in chunks[:-1] if c.get("choices"))


def _alone(server, messages, max_tokens: int, **extra) -> str:
    status, body = server.post(CHAT, {"messages": messages, "max_tokens": max_tokens, **extra})
    assert status == 200, body
    return body["choices"][0]["message"]["content"]


def _metrics(server) -> dict:
    status, text = server.get("/metrics")
    assert status == 200
    return {name: float(value) for name, value in
            (line.rsplit(" ", 1) for line in text.splitlines() if not line.startswith("#"))}


def _together(fn, args: list) -> list:
    """fn(*a) for every a in args, each on its own thread started at once; their results."""
    out = [None] * len(args)

    def run(i, a):
        try:
            out[i] = fn(*a)
        except BaseException as e:  # re-raised below, in the test's thread
            out[i] = e

    threads = [threading.Thread(target=run, args=(i, a)) for i, a in enumerate(args)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    for r in out:
        if isinstance(r, BaseException):
            raise r
    return out


def test_concurrent_greedy_streams_equal_each_alone_and_one_at_a_time(batched, serial):
    n = 48
    alone = [_alone(batched, _chat(a), n) for a in ASKS]
    assert alone == [_alone(serial, _chat(a), n) for a in ASKS]
    assert len(set(alone)) == len(ASKS)  # a mix-up between sequences would show
    before = _metrics(batched)
    got = _together(lambda a: _streamed(batched, _chat(a), n), [(a,) for a in ASKS])
    after = _metrics(batched)
    assert got == alone
    # they really ran together: more than one sequence per round on average
    rounds = after["dflash_batch_rounds_total"] - before["dflash_batch_rounds_total"]
    rows = after["dflash_batch_rows_total"] - before["dflash_batch_rows_total"]
    assert rounds > 0 and rows / rounds > 1.2, (rows, rounds)
    assert after["dflash_max_batch"] == 4 and after["dflash_batch_size"] == 0


def test_a_client_leaving_mid_stream_leaves_the_others_exact(batched, serial):
    n = 40
    refs = [_alone(batched, _chat(a), n) for a in ASKS[1:]]
    before = batched.health()
    conn, resp = ss.open_stream(batched, CHAT, {"messages": HELLO, "max_tokens": 1900})
    for _ in range(6):  # role chunk, a blank line, then text: it is in the batch
        assert resp.readline()
    out = {}
    others = threading.Thread(target=lambda: out.update(r=_together(
        lambda a: _streamed(batched, _chat(a), n), [(a,) for a in ASKS[1:]])))
    others.start()
    ss.wait_for(lambda: _metrics(batched)["dflash_batch_size"] >= 2)
    ss.hang_up(conn, resp)
    others.join(120)
    assert out["r"] == refs
    health = ss.wait_for(lambda: (h := batched.health())["cancelled"] > before["cancelled"]
                         and not h["running"] and h)
    assert health["status"] == "ok" and health["failed"] == before["failed"]
    assert health["cancelled"] == before["cancelled"] + 1
    assert _alone(batched, HELLO, 20) == _alone(serial, HELLO, 20)  # still up, still exact


def test_a_grammar_request_runs_while_others_stream(batched, serial):
    n = 40
    fmt = {"response_format": {"type": "json_object"}}
    ref = _alone(serial, HELLO, 60, **fmt)
    refs = [_alone(serial, _chat(a), n) for a in ASKS[1:]]
    jobs = [(lambda a=a: _streamed(batched, _chat(a), n)) for a in ASKS[1:]]
    jobs.append(lambda: _alone(batched, HELLO, 60, **fmt))
    got = _together(lambda f: f(), [(f,) for f in jobs])
    assert got == refs + [ref]


LOGGED = re.compile(r"INFO: +request \w+: \d+ prompt tokens \(\d+ cached\), \d+ generated, "
                    r"TTFT [0-9.]+ ms, per output token [0-9.]+ ms$")


def _logged(server) -> int:
    return sum(bool(LOGGED.match(ln)) for ln in server.log.read_text().splitlines())


def test_latencies_reach_metrics_and_the_log(batched):
    before, lines = _metrics(batched), _logged(batched)
    _together(lambda a: _alone(batched, _chat(a), 12), [(a,) for a in ASKS[:3]])
    after = _metrics(batched)
    for name in ("time_to_first_token", "time_per_output_token"):
        count = f"dflash_{name}_seconds_count"
        assert after[count] - before.get(count, 0) == 3, name
        assert after[f"dflash_{name}_seconds_sum"] > before.get(f"dflash_{name}_seconds_sum", 0)
    assert _logged(batched) - lines == 3, batched.log.read_text()[-2000:]  # one per request


def _raw_post(server, body: dict):
    """(status, headers by lower-case name, parsed body) of one request."""
    conn = http.client.HTTPConnection(ss.HOST, server.port, timeout=60)
    try:
        conn.request("POST", CHAT, body=json.dumps(body),
                     headers={"Content-Type": "application/json"})
        r = conn.getresponse()
        return r.status, {k.lower(): v for k, v in r.getheaders()}, json.loads(r.read())
    finally:
        conn.close()


def test_503_with_retry_after_only_past_the_queue(oracle):
    before = oracle.health()
    streams = []
    for _ in range(2):  # the whole batch; neither waits in the queue
        conn, resp = ss.open_stream(oracle, CHAT, {"messages": HELLO, "max_tokens": 1900})
        assert resp.readline()
        streams.append((conn, resp))
    ss.wait_for(lambda: _metrics(oracle)["dflash_batch_size"] == 2)
    queued = {}
    t = threading.Thread(target=lambda: queued.update(r=_raw_post(
        oracle, {"messages": HELLO, "max_tokens": 8})))
    t.start()
    ss.wait_for(lambda: oracle.health()["queued"] == 1)
    status, headers, body = _raw_post(oracle, {"messages": HELLO, "max_tokens": 8})
    assert status == 503 and body["error"]["code"] == "server_busy", body
    assert int(headers["retry-after"]) >= 1
    for conn, resp in streams:
        ss.hang_up(conn, resp)
    t.join(60)
    status, headers, body = queued["r"]
    assert status == 200 and body["choices"][0]["message"]["content"] == "!" * 8
    assert "retry-after" not in headers
    health = oracle.health()
    assert health["status"] == "ok" and health["cancelled"] == before["cancelled"] + 2


def test_max_batch_option_is_checked(tiny):
    from typer.testing import CliRunner

    from dflash_mlx.cli import app

    base = ["serve", "--model", str(tiny.target), "--draft", str(tiny.draft)]
    for bad in ("0", "257"):
        r = CliRunner().invoke(app, base + ["--max-batch", bad])
        assert r.exit_code == 2 and "--max-batch must be between 1 and 256" in r.stderr, r.output


# -- in process --------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def pair(tiny):
    from dflash_mlx import load

    return load(tiny.target, tiny.draft)


def test_a_failed_round_fails_its_requests_and_a_fresh_batch_serves(pair):
    from dflash_mlx import stream_generate
    from dflash_mlx.server.batch_worker import BatchWorker
    from dflash_mlx.server.worker import Done, Failed, Job
    from dflash_mlx.speculate import SamplingParams, SpeculationConfig

    config = SpeculationConfig.for_pair(pair)
    worker = BatchWorker(pair, config, max_batch=4, cache_slots=4).start()
    prompts = [[5, 6, 7, 8, 9], [10, 11, 12], [13, 14, 15, 16]]

    async def ask(*ids_list):
        jobs = [Job(ids, SamplingParams(), max_tokens=30) for ids in ids_list]
        for job in jobs:
            worker.submit(job)
        return [[m async for m in job.stream()] for job in jobs]

    broken = worker.batch
    steps = {"n": 0}
    real_step = broken.step

    def step():
        steps["n"] += 1
        if steps["n"] == 3:
            raise RuntimeError("boom")
        return real_step()

    broken.step = step
    try:
        ends = [msgs[-1] for msgs in asyncio.run(ask(*prompts[:2]))]
        assert all(isinstance(e, Failed) and e.status == 500 and "boom" in e.message
                   for e in ends), ends
        assert worker.batch is not broken and worker.cache_info()["slots"] == 0
        assert worker.counts["failed"] == 2
        results = asyncio.run(ask(*prompts))
        for ids, msgs in zip(prompts, results):
            ref = list(stream_generate(pair, ids, config, max_tokens=30))
            assert isinstance(msgs[-1], Done), msgs[-1]
            assert msgs[-1].finish_reason == ref[-1].finish_reason
            assert "".join(m.text for m in msgs[:-1]) == "".join(e.text for e in ref)
    finally:
        worker.close()
