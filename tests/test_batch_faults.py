"""One sequence's fault ends that sequence alone: a logits processor that raises, or one that
turns its logits into NaN, ends its request with finish_reason "error" (and the error), while
every other sequence of the batch decodes exactly what it decodes alone and its caches stay a
fresh prefill after every round. Plain KV and sliding-window targets, both batched."""

from __future__ import annotations

import mlx.core as mx
import pytest

from dflash_mlx import tiny
from dflash_mlx.batch import Batch
from dflash_mlx.speculate.guards import NonFiniteLogitsError
from dflash_mlx.speculate import SamplingParams, SpeculationConfig
from support.engine import GATED, float32_pair, make_draft4, mlx_lm_greedy
from support.rows_oracle import RowsOracleDraft

PROMPTS = [[3, 14, 15, 92, 6], [5, 35, 89, 79], [32, 38, 46, 26, 43, 38], [27, 18, 28]]


@pytest.fixture(scope="module")
def pairs(tmp_path_factory):
    root = tmp_path_factory.mktemp("batch-faults")
    draft = tiny.make_draft(root / "d", tiny.draft_config(block_size=8))
    draft4 = make_draft4(root / "d4")
    return {"qwen3": float32_pair(tiny.make_target(root / "q"), draft, RowsOracleDraft),
            "gemma3": float32_pair(tiny.make_target(root / "g", **GATED), draft4,
                                   RowsOracleDraft)}


def _faulty(after: int, fault) -> SamplingParams:
    """Greedy sampling whose processor runs `fault(logits)` from its `after`-th call on."""
    calls = [0]

    def processor(tokens, logits):
        calls[0] += 1
        return fault(logits) if calls[0] > after else logits

    params = SamplingParams()
    params.__dict__["processors"] = [processor]  # the cached property, set for this test
    return params


def _boom(logits):
    raise RuntimeError("processor exploded")


def _nan(logits):
    return logits * mx.array(float("nan"))


@pytest.mark.parametrize("family", ["qwen3", "gemma3"])
def test_a_faulty_sequence_ends_alone_and_the_others_stay_exact(pairs, family):
    pair = pairs[family]
    pair.draft.plan = None
    sampling = [SamplingParams(), _faulty(6, _boom), SamplingParams(), _faulty(9, _nan)]
    batch = Batch(pair, SpeculationConfig(block_size=5, lookup=False, adaptive=False))
    for p, s in zip(PROMPTS, sampling):
        batch.add(p, sampling=s, max_tokens=24)
    outs, ends = {i: [] for i in range(4)}, {}
    while batch.running:
        for ev in batch.step():
            outs[ev.index] += ev.tokens
            if ev.finish_reason is not None:
                ends[ev.index] = ev
        assert batch.serial is None
        for b, index in enumerate(batch.rows):  # batched rows: still their tokens' prefill
            tokens = batch.tokens(index)[:-1]
            assert all(c.lengths()[b] == len(tokens) for c in batch.target_cache)
    for i in (0, 2):
        ref = mlx_lm_greedy(pair.target.model, PROMPTS[i], 24)
        assert outs[i] == ref[: len(outs[i])] and ends[i].error is None
        assert ends[i].finish_reason in ("length", "stop")
    assert ends[1].finish_reason == "error" and "exploded" in str(ends[1].error)
    assert isinstance(ends[3].error, NonFiniteLogitsError) and ends[3].finish_reason == "error"
    for i in (1, 3):  # what they committed before the fault is the target's own
        ref = mlx_lm_greedy(pair.target.model, PROMPTS[i], 24)
        assert 0 < len(outs[i]) < 24 and outs[i] == ref[: len(outs[i])]


def test_the_server_fails_that_request_alone(tiny):
    """In the batching server the faulty request gets its 500, the others their answers."""
    import asyncio

    from dflash_mlx import load, stream_generate
    from dflash_mlx.server.batch_worker import BatchWorker
    from dflash_mlx.server.worker import Done, Failed, Job

    pair = load(tiny.target, tiny.draft)
    config = SpeculationConfig.for_pair(pair)
    worker = BatchWorker(pair, config, max_batch=4, cache_slots=4).start()

    async def ask():
        jobs = [Job(PROMPTS[0], SamplingParams(), max_tokens=20),
                Job(PROMPTS[1], _faulty(3, _boom), max_tokens=20),
                Job(PROMPTS[2], SamplingParams(), max_tokens=20)]
        for job in jobs:
            worker.submit(job)
        return [[m async for m in job.stream()] for job in jobs]

    try:
        good0, bad, good2 = asyncio.run(ask())
        assert isinstance(bad[-1], Failed) and bad[-1].status == 500
        assert "exploded" in bad[-1].message
        for ids, msgs in ((PROMPTS[0], good0), (PROMPTS[2], good2)):
            assert isinstance(msgs[-1], Done), msgs[-1]
            alone = "".join(e.text for e in stream_generate(pair, ids, config, max_tokens=20))
            assert "".join(m.text for m in msgs[:-1]) == alone
        assert worker.counts["failed"] == 1 and worker.batch_size == 0
    finally:
        worker.close()
