"""The server's prompt cache: conversations keep their caches in a bounded LRU of sessions.

Every expected value here comes from the tests' own bookkeeping (the tokens each conversation
has seen, a fresh session's output, byte counts read off the caches' arrays), never from the
prompt cache itself.
"""

from __future__ import annotations

import asyncio
import random

import numpy as np
import pytest

from dflash_mlx import load, stream_generate, tiny
from dflash_mlx.errors import InvalidArgumentError
from dflash_mlx.generate import Session
from dflash_mlx.server.prompt_cache import PromptCache, parse_bytes
from support import server as ss
from support.engine import GATED, make_draft4

BIG = 1 << 40  # a byte bound that never binds


def common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


@pytest.fixture(scope="module")
def pair(tiny):
    return load(tiny.target, tiny.draft, draft_bits=16, weights="float32")


@pytest.fixture(scope="module")
def special_pairs(tmp_path_factory):
    """A sliding-window target (gemma3: layers 0 and 2 keep an 8-row rotating window) and a
    hybrid GatedDeltaNet target (qwen3_5), each with a draft."""
    root = tmp_path_factory.mktemp("prompt-cache")
    draft4 = make_draft4(root / "draft4")
    sliding = tiny.make_target(root / "sliding", **GATED)
    hybrid = tiny.make_hybrid_target(root / "hybrid")
    return {"sliding": load(sliding, draft4, draft_bits=16, weights="float32"),
            "hybrid": load(hybrid, tiny.make_draft(root / "draft6"), draft_bits=16,
                           weights="float32")}


def generate(pair, prompt, session=None, n=10):
    """(tokens, tokens reused from the session) of a greedy call."""
    events = list(stream_generate(pair, prompt, session=session, max_tokens=n))
    return [t for e in events for t in e.tokens], events[0].reused_tokens


def served(cache: PromptCache, pair, prompt, n=10):
    """One request through the cache, as the worker runs it."""
    session = cache.acquire(prompt)
    try:
        return generate(pair, prompt, session, n)
    finally:
        cache.release(session)


def own_bytes(session: Session) -> int:
    """Bytes of the arrays a plain KV pair's session holds, counted here independently."""
    total = sum(c.keys.nbytes + c.values.nbytes for c in session.target_cache if c.keys is not None)
    total += sum(a.nbytes for c in session.draft_cache for a in c.state)
    return total + (0 if session.pending is None else session.pending.nbytes)


def snapshot(session: Session) -> list[np.ndarray]:
    """The rows a session's caches read, as host copies."""
    out = [np.array(a[..., : c.offset, :]) for c in session.target_cache for a in (c.keys, c.values)]
    out += [np.array(a) for c in session.draft_cache for a in (c.keys, c.values) if a is not None]
    return out + ([] if session.pending is None else [np.array(session.pending)])


def conversations(seed: int, shared: int, own: int, names="AB") -> dict[str, list[int]]:
    """First prompts that share `shared` tokens (a system prompt), then `own` tokens each."""
    rng = random.Random(seed)
    system = [rng.randrange(256) for _ in range(shared)]
    return {n: system + [rng.randrange(256) for _ in range(own)] for n in names}


# -- reuse and exactness ---------------------------------------------------------------------

def test_interleaved_conversations_reuse_their_prefix_and_stay_exact(pair):
    """A, B, A, B, ...: each request reuses at least 90% of what its conversation already
    holds (a single session would keep only the shared system prompt), and every output is a
    fresh session's."""
    cache = PromptCache(pair, lambda: Session.new(pair), slots=4, max_bytes=BIG)
    prompts, seen = conversations(0, shared=24, own=40), {}
    rng, reused_total = random.Random(1), 0
    for turn in range(4):
        for name in "AB":
            prompt = prompts[name]
            out, reused = served(cache, pair, prompt)
            assert out == generate(pair, prompt)[0], (name, turn)
            others = [common_prefix(prompt, t) for n, t in seen.items() if n != name]
            prefix = common_prefix(prompt, seen.get(name, [])) or max(others, default=0)
            assert reused >= 0.9 * prefix, (name, turn, reused, prefix)
            if turn:
                assert reused > max(others) + 20  # more than another conversation offers
            reused_total += reused
            seen[name] = prompt + out
            prompts[name] = prompt + out + [rng.randrange(256) for _ in range(6)]
    info = cache.info()
    assert info["reused_tokens"] == reused_total
    assert (info["hits"], info["misses"], info["slots"]) == (7, 1, 2)


def test_a_copy_shares_nothing_with_its_source(pair):
    """B shares A's system prompt: it gets a copy of A's caches cut to that prefix, and A's
    own caches stay bit for bit what they were while B generates in the copy."""
    cache = PromptCache(pair, lambda: Session.new(pair), slots=4, max_bytes=BIG)
    prompts = conversations(2, shared=30, own=20)
    out_a, _ = served(cache, pair, prompts["A"])
    (slot_a,) = cache.entries
    before = snapshot(slot_a.session)
    out_b, reused = served(cache, pair, prompts["B"])
    assert reused == 30 and out_b == generate(pair, prompts["B"])[0]
    assert len(cache.entries) == 2 and cache.entries[1].session is not slot_a.session
    after = snapshot(slot_a.session)
    assert len(before) == len(after) and all(np.array_equal(x, y) for x, y in zip(before, after))
    # A goes on from everything it held
    more = prompts["A"] + out_a + [7, 8, 9]
    out, reused = served(cache, pair, more)
    assert reused == len(prompts["A"]) + len(out_a) - 1 and out == generate(pair, more)[0]


@pytest.mark.parametrize("kind", ["sliding", "hybrid"])
def test_windows_and_recurrent_states_reuse_only_what_is_exact(special_pairs, kind):
    """A wrapped sliding window or a GatedDeltaNet state goes back only to a checkpoint (the
    end of the last prompt's prefill) or to the start: copies land there, and every output
    is a fresh session's."""
    pair = special_pairs[kind]
    cache = PromptCache(pair, lambda: Session.new(pair), slots=4, max_bytes=BIG)
    prompts = conversations(3, shared=12, own=18)  # both far past the 8-row window
    seen = {}
    for name in "AB":  # B shares 12 tokens with A, behind A's checkpoint: nothing exact
        out, reused = served(cache, pair, prompts[name])
        assert out == generate(pair, prompts[name])[0]
        assert reused == 0
        seen[name] = prompts[name] + out
    for name in "AB":  # each goes on from all its slot holds
        prompt = seen[name] + [5, 6, 7]
        out, reused = served(cache, pair, prompt)
        assert out == generate(pair, prompt)[0] and reused == len(seen[name]) - 1
        prompts[name], seen[name] = prompt, prompt + out
    # A's last prompt with another last token: a copy back to A's checkpoint
    edit = prompts["A"][:-1] + [9, 9, 9, 9]
    out, reused = served(cache, pair, edit)
    assert out == generate(pair, edit)[0] and reused == len(prompts["A"]) - 1
    assert len(cache.entries) == 3
    # and A, left intact, still goes on from everything it held
    prompt = seen["A"] + [1, 2]
    out, reused = served(cache, pair, prompt)
    assert out == generate(pair, prompt)[0] and reused == len(seen["A"]) - 1


# -- bounds ----------------------------------------------------------------------------------

def test_eviction_by_count_drops_the_least_recently_used(pair):
    cache = PromptCache(pair, lambda: Session.new(pair), slots=2, max_bytes=BIG)
    prompts = conversations(4, shared=0, own=30, names="ABC")
    held = {}
    for name in "ABC":
        out, _ = served(cache, pair, prompts[name])
        held[name] = prompts[name] + out
        assert cache.info()["slots"] <= 2
    # A was the least recently used: gone; B and C go on from all they held
    for name in "BCA":
        prompt = held[name] + [3, 4]
        out, reused = served(cache, pair, prompt)
        assert out == generate(pair, prompt)[0]
        assert reused == (0 if name == "A" else len(held[name]) - 1), name
        assert cache.info()["slots"] <= 2


def test_eviction_by_bytes_never_exceeds_the_bound(pair):
    probe = Session.new(pair)
    prompts = conversations(5, shared=0, own=40, names="ABCDEF")
    generate(pair, prompts["A"], probe)
    bound = int(2.5 * own_bytes(probe))  # room for two conversations of this size, not three
    cache = PromptCache(pair, lambda: Session.new(pair), slots=8, max_bytes=bound)
    counts = []
    for name in "ABCDEF":
        served(cache, pair, prompts[name])
        total = sum(own_bytes(s.session) for s in cache.entries)
        assert total <= bound and cache.info()["bytes"] == total
        counts.append(len(cache.entries))
    assert max(counts) == 2  # the bound was reached, not avoided
    # a bound smaller than one conversation keeps nothing once its job is over
    tight = PromptCache(pair, lambda: Session.new(pair), slots=8, max_bytes=1000)
    served(tight, pair, prompts["A"])
    assert tight.info()["slots"] == 0 and tight.info()["bytes"] == 0


def test_a_slot_in_use_is_never_evicted(pair):
    cache = PromptCache(pair, lambda: Session.new(pair), slots=1, max_bytes=1000)
    prompts = conversations(6, shared=0, own=30, names="ABC")
    out, _ = served(cache, pair, prompts["A"])
    assert cache.info()["slots"] == 0  # over the byte bound once idle
    cache.max_bytes = BIG
    out, _ = served(cache, pair, prompts["A"])
    cont = prompts["A"] + out + [1]
    running = cache.acquire(cont)  # A's slot, taken in place and now busy
    cache.max_bytes = 1000
    for name in "BC":  # over both bounds, yet A's slot stays
        served(cache, pair, prompts[name])
        assert any(s.session is running for s in cache.entries)
    out, reused = generate(pair, cont, running)
    assert reused == len(cont) - 2 and out == generate(pair, cont)[0]  # all but its last
    cache.release(running)
    assert cache.info()["slots"] == 0


# -- the server ------------------------------------------------------------------------------

def test_a_failed_job_drops_its_slot(pair):
    from dflash_mlx.server.worker import Done, Failed, Job, Worker
    from dflash_mlx.speculate import SamplingParams, SpeculationConfig

    worker = Worker(pair, SpeculationConfig.for_pair(pair), cache_slots=2, cache_bytes=BIG).start()

    async def ask(ids):
        job = Job(ids, SamplingParams(), max_tokens=6)
        worker.submit(job)
        return [m async for m in job.stream()][-1]

    try:
        prompt = conversations(7, shared=0, own=20, names="A")["A"]
        assert isinstance(asyncio.run(ask(prompt)), Done)
        assert worker.cache_info()["slots"] == 1
        healthy = worker._generate

        def broken(job):
            for i, ev in enumerate(healthy(job)):
                if i == 1:
                    raise RuntimeError("boom")
                yield ev

        worker._generate = broken
        assert isinstance(asyncio.run(ask(prompt + [1, 2])), Failed)
        assert worker.cache_info()["slots"] == 0  # dropped, not trusted
        worker._generate = healthy
        done = asyncio.run(ask(prompt))
        assert isinstance(done, Done) and done.cached_tokens == 0
    finally:
        worker.close()


def test_bytes_and_slot_options(tiny):
    from typer.testing import CliRunner

    from dflash_mlx.cli import app

    assert parse_bytes("2G") == 2 << 30 and parse_bytes("512M") == 512 << 20
    assert parse_bytes("1.5GiB") == 3 << 29 and parse_bytes("4096") == 4096
    for bad in ("", "0", "-1G", "lots", "2X", "1e9"):
        with pytest.raises(InvalidArgumentError, match="--cache-bytes"):
            parse_bytes(bad)
    base = ["serve", "--model", str(tiny.target), "--draft", str(tiny.draft)]
    for extra, msg in ((["--cache-slots", "0"], "--cache-slots must be at least 1"),
                       (["--cache-bytes", "lots"], "--cache-bytes must be a positive size")):
        r = CliRunner().invoke(app, base + extra)
        assert r.exit_code == 2 and msg in r.stderr and r.stderr.count("\n") == 1, r.output


@pytest.fixture(scope="module")
def server(tiny, tmp_path_factory):
    log = tmp_path_factory.mktemp("prompt-cache-server") / "serve.log"
    yield from ss.clean_tiny_server(tiny, log, "--cache-slots", "3")


def test_interleaved_chats_report_their_cached_tokens(server, pair):
    """Two chats with their own system prompts, turns interleaved over HTTP: from the second
    turn on each reuses at least 90% of its previous prompt, which only its own slot holds."""
    from dflash_mlx.chat import apply_template

    chats = {n: [{"role": "system", "content": f"{n} is who you are. " + n.lower() * 150}]
             for n in "AB"}
    last = {}
    for turn in range(3):
        for name, messages in chats.items():
            messages.append({"role": "user", "content": f"Question {turn} for {name}?"})
            status, body = server.post("/v1/chat/completions",
                                       {"messages": messages, "max_tokens": 6})
            assert status == 200, body
            usage = body["usage"]
            ids = apply_template(pair.tokenizer, messages)
            assert usage["prompt_tokens"] == len(ids)
            cached = usage["prompt_tokens_details"]["cached_tokens"]
            if turn:
                prefix = common_prefix(ids, last[name])
                other = common_prefix(ids, last["B" if name == "A" else "A"])
                assert prefix > 150 and other < 20
                assert cached >= 0.9 * prefix, (name, turn, cached, prefix)
            last[name] = ids
            messages.append({"role": "assistant",
                             "content": body["choices"][0]["message"]["content"]})
