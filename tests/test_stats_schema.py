"""One stats schema: `Stats.as_dict()` is what the server's `speculation` (per response and in
/health), the benchmark card, the chat transcript and the chat panel report.

Three hand-made rounds with known numbers go through each writer; every one must give the same
keys and the same values (docs/stats.md documents them)."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest

from dflash_mlx.generate import BlockEvent
from dflash_mlx.stats import Stats


def _event(tokens, drafted, accepted, lookup, **kw) -> BlockEvent:
    # the prefill fields repeat on every event of a call; Stats counts them once
    base = dict(text="".join(chr(97 + t) for t in tokens), accept_flags=[
        i < accepted for i in range(len(drafted))], draft_s=0.01, verify_s=0.03,
        block_size=1 + len(drafted), prompt_tokens=10, reused_tokens=4, prompt_s=0.5)
    return BlockEvent(tokens=tokens, drafted=drafted, accepted=accepted,
                      lookup_flags=lookup, **{**base, **kw})


EVENTS = [
    # 2 of 3 drafts accepted, a lookup slot among them; one slot cut before verification
    _event([1, 2, 3], [1, 2, 9], 2, [False, True, True], trimmed=1, generation_tokens=3),
    _event([4, 5, 6, 7], [4, 5, 6], 3, [False, False, True], generation_tokens=7),
    # the last token under max_tokens: an AR step
    _event([8], [], 0, [], draft_s=0.0, verify_s=0.02, generation_tokens=8,
           finish_reason="length"),
]

EXPECTED = {
    "rounds": 3, "generation_tokens": 8, "tau": 2.6667, "acceptance_rates": [1.0, 1.0, 0.5],
    "drafted_tokens": 6, "accepted_tokens": 5, "trimmed_slots": 1, "lookup_slots": 3,
    "lookup_accepted": 2, "tree_rounds": 0, "tree_nodes": 0, "branch_tokens": 0,
    "draft_s": 0.02, "verify_s": 0.08, "generation_tps": 80.0, "prompt_tokens": 10,
    "reused_tokens": 4, "prompt_s": 0.5, "prompt_tps": 20.0, "finish_reason": "length",
}


def _stats(events=EVENTS) -> Stats:
    stats = Stats()
    for ev in events:
        stats.add(ev)
    return stats


def test_as_dict_counts_the_rounds_exactly():
    assert _stats().as_dict() == EXPECTED


def test_docs_table_lists_every_key():
    doc = (Path(__file__).resolve().parents[1] / "docs" / "stats.md").read_text()
    rows = [line.split("|")[1].strip().strip("`") for line in doc.splitlines()
            if line.startswith("| `")]
    assert rows == list(EXPECTED)


# -- the server --------------------------------------------------------------------------------

def _scripted_worker():
    """A worker whose engine replays EVENTS (no model): the server's own code around it."""
    from dflash_mlx.server.memory import RequestMemory
    from dflash_mlx.server.worker import Worker

    class Scripted(Worker):
        memory = RequestMemory(room=10**12, per_token=1)  # no model to measure

        def _new_session(self):
            return None

        def _generate(self, job):
            return (ev for ev in EVENTS)

        def _cached(self, job):  # no caches to take from the prompt cache
            return self._run(job)

    return Scripted(pair=None, config=None).start()


async def _ask(worker):
    from dflash_mlx.server.worker import Job

    job = Job([5, 6, 7], {})
    worker.submit(job)
    return [msg async for msg in job.stream()][-1]


async def _get(app, path: str) -> dict:
    """One GET through the ASGI app, without a socket."""
    sent = []

    async def receive():
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(msg):
        sent.append(msg)

    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "GET",
             "scheme": "http", "path": path, "raw_path": path.encode(), "root_path": "",
             "query_string": b"", "headers": [], "client": ("127.0.0.1", 1),
             "server": ("127.0.0.1", 80)}
    await app(scope, receive, send)
    return json.loads(b"".join(m.get("body", b"") for m in sent
                               if m["type"] == "http.response.body"))


def test_server_speculation_is_as_dict():
    from dflash_mlx.server.app import create_app
    from dflash_mlx.server.reply import Reply
    from dflash_mlx.server.worker import Delta
    from dflash_mlx.server.request import ServerConfig

    worker = _scripted_worker()
    try:
        done = asyncio.run(_ask(worker))
        assert done.speculation == EXPECTED
        assert (done.completion_tokens, done.cached_tokens) == (8, 4)
        assert Reply(False, "m").full([Delta("abc")], done)["speculation"] == EXPECTED
        # /health: the same keys, summed over both requests
        asyncio.run(_ask(worker))
        health = asyncio.run(_get(create_app(worker, ServerConfig("m")), "/health"))
    finally:
        worker.close()
    total = health["speculation"]
    assert set(total) == set(EXPECTED)
    assert (total["rounds"], total["generation_tokens"], total["prompt_tokens"]) == (6, 16, 20)
    assert (total["tau"], total["acceptance_rates"]) == (EXPECTED["tau"], [1.0, 1.0, 0.5])
    assert health["completed"] == 2


def test_client_reads_our_speculation():
    from dflash_mlx.server.openai_client import _from_ours

    spec = _from_ours(EXPECTED)
    assert (spec["tau"], spec["drafted_tokens"], spec["accepted_tokens"]) == (2.6667, 6, 5)


# -- the benchmark card ------------------------------------------------------------------------

def test_benchmark_card_stores_as_dict_per_run():
    from dflash_mlx.bench import runner as bench

    ar_events = [_event([t], [], 0, [], generation_tokens=i + 1) for i, t in enumerate(range(8))]
    sample = bench.Sample("gsm8k", 0, 0, 10)
    sample.runs = {1: [bench.Run(list(range(8)), "", 0.2, _stats(ar_events), ar_events)],
                   4: [bench.Run(list(range(1, 9)), "", 0.1, _stats(), EVENTS)]}
    (entry,) = bench.per_sample([sample], [4])
    assert entry["dflash"]["4"]["stats"] == EXPECTED
    assert entry["dflash"]["4"]["first_divergence"] == 0
    assert set(entry["ar"]["stats"]) == set(EXPECTED) and entry["ar"]["stats"]["tau"] == 1.0
    (row,) = bench.summarize([sample], [4], greedy=True)
    # a row aggregates runs; where it reports a schema quantity it uses the schema's key
    shared = {k: row[k] for k in set(row) & set(EXPECTED)}
    assert shared == {"generation_tokens": 8, "tau": 2.6667, "acceptance_rates": [1.0, 1.0, 0.5]}


# -- the chat: transcript and panel ------------------------------------------------------------

def test_chat_turn_and_transcript_use_as_dict():
    from tui.transcript import Transcript
    from tui.turn import Turn

    turn = Turn("hi", decode=lambda t: chr(97 + t))
    turn.add(EVENTS)
    saved = turn.to_dict()
    assert saved["stats"]["all"] == EXPECTED
    md = Transcript(turns=[saved]).to_markdown()
    assert "*8 tokens · τ 2.67 · 80.0 tok/s · length*" in md


def test_panel_numbers_read_as_dict():
    from tui.widgets.panel import numbers

    text = numbers(EXPECTED, 40.0, {"thinking": EXPECTED, "answer": {**EXPECTED, "tau": 3.0}})
    assert text.splitlines() == ["τ 2.67 · 80.0 tok/s", "AR 40.0 tok/s · ×2.00",
                                 "prompt 10 new · 4 reused", "prefill 20 tok/s",
                                 "thinking τ 2.67 · answer τ 3.00"]
    with pytest.raises(KeyError):  # the panel reads the schema's names, not its own
        numbers({k: v for k, v in EXPECTED.items() if k != "generation_tps"}, None, {})
