"""The batching server and memory (in process, tiny pair): a request whose cache cannot fit
even alone is refused with a 400 that says why and the others go on; one that does not fit
beside the running ones waits for them instead of joining; the default width comes from
memory; and a batched reply lands in the prompt cache, so the next turn reuses it."""

from __future__ import annotations

import asyncio

import mlx.core as mx
import pytest
from mlx_lm.models.cache import ArraysCache, KVCache

from dflash_mlx import load, stream_generate
from dflash_mlx.models.dflash import DFlashDraftModel
from dflash_mlx.server.batch_worker import BatchWorker
from dflash_mlx.server.memory import MAX_BATCH, RequestMemory
from dflash_mlx.server.worker import Done, Failed, Job, Worker
from dflash_mlx.speculate import SamplingParams, SpeculationConfig
from support.engine import float32_pair


@pytest.fixture(scope="module")
def pair(tiny):
    return load(tiny.target, tiny.draft)


@pytest.fixture
def worker(pair):
    w = BatchWorker(pair, SpeculationConfig.for_pair(pair), max_batch=4, cache_slots=4)
    sizes = []
    step = w.batch.step

    def counted():  # the batch's width at every round
        sizes.append(len(w.batch.running))
        return step()

    w.batch.step, w.sizes = counted, sizes
    w.start()
    try:
        yield w
    finally:
        w.close()


def _ask(worker, asks: list[tuple[list[int], int]]) -> list[list]:
    """Submit (ids, max_tokens) requests together; every request's messages."""
    async def run():  # jobs belong to the running loop
        jobs = [Job(ids, SamplingParams(), max_tokens=n) for ids, n in asks]
        for job in jobs:
            worker.submit(job)
        return [[m async for m in job.stream()] for job in jobs]
    return asyncio.run(run())


def _text(msgs) -> str:
    return "".join(m.text for m in msgs[:-1])


def _alone(pair, ids, n) -> str:
    return "".join(e.text for e in stream_generate(pair, ids, SpeculationConfig.for_pair(pair),
                                                   max_tokens=n))


def test_a_request_that_cannot_fit_is_refused_and_the_rest_go_on(pair, worker):
    per = worker.memory.per_token
    worker.memory = RequestMemory(room=per * 60, per_token=per)
    big_msgs, small_msgs = _ask(worker, [([5, 6, 7, 8], 100), ([9, 10, 11], 20)])
    end = big_msgs[-1]
    assert isinstance(end, Failed) and end.status == 400, end
    assert "4 prompt tokens + max_tokens 100" in end.message and "\n" not in end.message
    assert isinstance(small_msgs[-1], Done)
    assert _text(small_msgs) == _alone(pair, [9, 10, 11], 20)


@pytest.mark.parametrize("room_tokens, widest", [(60, 1), (10_000, 2)])
def test_a_request_waits_for_memory_rather_than_join(pair, worker, room_tokens, widest):
    """Room for one 40-token request at a time: the second waits, then runs, both exact
    (with ample room the same two run together: the check can tell)."""
    per = worker.memory.per_token
    worker.memory = RequestMemory(room=per * room_tokens, per_token=per)
    worker.cache.max_bytes = 1  # keep no idle conversation: its bytes would count too
    prompts = [[5, 6, 7, 8, 9], [10, 11, 12, 13]]
    results = _ask(worker, [(p, 30) for p in prompts])
    for p, msgs in zip(prompts, results):
        assert isinstance(msgs[-1], Done), msgs[-1]
        assert _text(msgs) == _alone(pair, p, 30)
    assert max(worker.sizes) == widest


def test_a_batched_reply_is_reused_by_the_next_turn(pair, worker):
    first = [20, 21, 22, 23, 24, 25]
    msgs = _ask(worker, [(first, 12)])[0]
    done = msgs[-1]
    assert isinstance(done, Done) and done.completion_tokens > 0
    events = list(stream_generate(pair, first, SpeculationConfig.for_pair(pair), max_tokens=12))
    reply = [t for e in events for t in e.tokens]  # greedy: what the batch generated
    assert "".join(e.text for e in events) == _text(msgs)
    turn = first + reply + [30, 31]
    again = _ask(worker, [(turn, 8)])[0]
    assert isinstance(again[-1], Done)
    # the prompt and the reply came from the slot; a slot keeping the prompt only reuses 5
    assert again[-1].cached_tokens >= len(first) + len(reply) - 1, again[-1]
    assert _text(again) == _alone(pair, turn, 8)


def test_the_default_width_comes_from_memory(pair, monkeypatch):
    from dflash_mlx.cli import serve
    from dflash_mlx.server import memory

    config = SpeculationConfig.for_pair(pair)
    per = memory.kv_bytes_per_token(pair)
    cache = 10**6
    weights = memory.weights_bytes(pair)
    # room for 3 sequences of `sequence` tokens in half of what the weights and cache leave
    seq = RequestMemory.of(pair).sequence
    monkeypatch.setattr(memory, "memory_limit_bytes",
                        lambda: weights + cache + 2 * 3 * per * seq + 1)
    w = serve._worker(pair, config, 4, None, cache_slots=2, cache_bytes=cache)
    assert isinstance(w, BatchWorker) and w.max_batch == 3
    assert isinstance(serve._worker(pair, config, 4, 1, cache_slots=2, cache_bytes=cache),
                      Worker)
    monkeypatch.setattr(memory, "memory_limit_bytes", lambda: 10**15)
    w = serve._worker(pair, config, 4, None, cache_slots=2, cache_bytes=cache)
    assert w.max_batch == MAX_BATCH


def test_a_hybrid_request_counts_its_attention_layers_and_its_states(tmp_path):
    """A GatedDeltaNet layer holds no K/V per token but a state per sequence: a hybrid's
    request needs its attention layers' K/V and its states (a row and its checkpoint), as its
    caches hold them after a prefill."""
    from dflash_mlx import tiny as models
    from dflash_mlx.server import memory

    pair = float32_pair(models.make_hybrid_target(tmp_path / "h"),
                        models.make_draft(tmp_path / "d", models.draft_config(block_size=8)),
                        DFlashDraftModel)
    cache = pair.target.make_cache()
    pair.target(mx.array([list(range(3, 43))]), cache, taps=False)
    kv = sum(c.keys[..., :40, :].nbytes + c.values[..., :40, :].nbytes
             for c in cache if isinstance(c, KVCache))
    states = sum(a.nbytes for c in cache if isinstance(c, ArraysCache) for a in c.state[0])
    assert memory.kv_bytes_per_token(pair) * 40 == kv
    assert memory.state_bytes_per_sequence(pair) == 2 * states
    assert RequestMemory.of(pair, 10**9).need(40) == kv + 2 * states
