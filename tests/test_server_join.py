"""A long prompt joining a running batch is prefilled one chunk per round, so the running
streams go on meanwhile (in process, tiny pair): rounds and chunks alternate, every answer
equals its answer alone, and a client that leaves mid-prefill frees its place."""

from __future__ import annotations

import asyncio

import pytest

from dflash_mlx import load, stream_generate
from dflash_mlx.server import batch_worker
from dflash_mlx.server.batch_worker import BatchWorker
from dflash_mlx.server.worker import Done, Failed, Job
from dflash_mlx.speculate import SamplingParams, SpeculationConfig

SHORT = [5, 6, 7, 8]
LONG = list(range(20, 58))  # 38 tokens


@pytest.fixture(scope="module")
def pair(tiny):
    return load(tiny.target, tiny.draft)


@pytest.fixture
def worker(pair, monkeypatch):
    w = BatchWorker(pair, SpeculationConfig.for_pair(pair), max_batch=4, cache_slots=4)
    w.chunk = 4
    w.trace = []
    step, prefill = w.batch.step, batch_worker.prefill

    def traced_step():
        w.trace.append("round")
        return step()

    def traced_prefill(*args):
        w.trace.append("chunk")
        return prefill(*args)

    w.batch.step = traced_step
    monkeypatch.setattr(batch_worker, "prefill", traced_prefill)
    w.start()
    try:
        yield w
    finally:
        w.close()


def _alone(pair, ids, n) -> str:
    config = SpeculationConfig.for_pair(pair)
    return "".join(e.text for e in stream_generate(pair, ids, config, max_tokens=n))


def _run(worker, cancel_late: bool = False):
    async def go():
        first = Job(SHORT, SamplingParams(), max_tokens=120)
        worker.submit(first)
        a = [await first.stream().__anext__()]  # it runs: the long prompt joins a batch
        late = Job(LONG, SamplingParams(), max_tokens=10)
        worker.submit(late)
        if cancel_late:
            while worker.trace.count("chunk") < 2:
                await asyncio.sleep(0.005)
            late.cancel()
        b = [m async for m in late.stream()]
        a += [m async for m in first.stream()]
        return a, b
    return asyncio.run(go())


def test_a_long_prompt_joins_between_rounds(pair, worker):
    a, b = _run(worker)
    assert isinstance(a[-1], Done) and isinstance(b[-1], Done)
    assert "".join(m.text for m in a[:-1]) == _alone(pair, SHORT, 120)
    assert "".join(m.text for m in b[:-1]) == _alone(pair, LONG, 10)
    trace = worker.trace
    chunks = [i for i, t in enumerate(trace) if t == "chunk"]
    assert len(chunks) == 9  # prefixes of 4, 8, ..., 36 tokens beside rounds; the last 2 join
    assert all(trace[i + 1] == "round" for i in chunks)  # a round after every chunk


def test_a_client_leaving_mid_prefill_frees_its_place(pair, worker):
    a, b = _run(worker, cancel_late=True)
    assert isinstance(b[-1], Failed) and b[-1].status == 499, b[-1]
    assert isinstance(a[-1], Done)
    assert "".join(m.text for m in a[:-1]) == _alone(pair, SHORT, 120)
    assert worker.joining is None and not worker.running
    assert worker.cache_info()["slots"] >= 1 and worker.counts["cancelled"] == 1
