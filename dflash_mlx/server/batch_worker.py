"""Continuous batching: the engine thread decodes up to `max_batch` requests together.

`BatchWorker` runs a `batch.Batch`: between two rounds it takes queued jobs while fewer than
`max_batch` run (each prefilled from its prompt-cache session, then joining the next round),
runs one round for all of them, and hands every sequence's event to its job's `Output` (the
same stop strings, log-probabilities, stats and timings as one request at a time). A job ends
on its finish reason, a stop string, or its client leaving: it leaves the batch at that round
boundary, the others go on exactly.

Prompt cache: a job holds its slot while it runs; the batch decodes in copies of the slot's
caches and writes the job's row back into the slot when it leaves, so the next turn of that
conversation reuses the reply too, as with one request at a time.

Memory (`memory.py`): a job whose cache could not fit even alone is refused with a 400; one
that does not fit beside the running jobs and the prompt cache waits (first in line, so no
later job overtakes it) until one of them ends.

Requests the batch cannot take (grammars: response_format, a forced tool choice) run one at
a time between two rounds, as `Worker` runs every request. A round that raises fails every
running request (500), drops their slots and starts a fresh batch; the server goes on.
"""

from __future__ import annotations

import logging
import queue
from dataclasses import dataclass

from mlx_lm.generate import wired_limit

from ..batch import Batch, serial_reason
from ..errors import InvalidArgumentError
from ..generate import Session
from .worker import Failed, Job, Output, Worker

log = logging.getLogger("dflash_mlx.server")


def batch_refusal(pair, config, group=None) -> str | None:
    """Why this server runs its requests one at a time whatever --max-batch says (None: it
    batches)."""
    if group is not None:
        return "under mlx.launch every rank follows one generation at a time"
    if config.tree and config.block_size > 1:
        return "draft trees (--tree) are not batched yet"
    return serial_reason(pair)


@dataclass
class _Running:
    job: Job
    out: Output
    session: Session  # its prompt-cache slot, held until the job ends
    bytes: int  # the cache it may grow to (prompt and max_tokens)


class BatchWorker(Worker):
    """Decodes up to `max_batch` jobs together, one speculative round for all at a time."""

    def __init__(self, pair, config, queue_size: int = 64, *, max_batch: int, **cache):
        super().__init__(pair, config, queue_size, **cache)
        self.max_batch = max_batch
        self.batch = Batch(pair, config)
        self.active: dict[int, _Running] = {}  # by batch index (changed under `lock`)
        self.waiting: Job | None = None  # taken from the queue, joins when memory frees
        self.rounds = self.rows = 0  # batched rounds, and sequences summed over them

    @property
    def batch_size(self) -> int:
        return len(self.active)

    def cancel_all(self) -> None:
        super().cancel_all()
        with self.lock:
            running = list(self.active.values())
        for job in [r.job for r in running] + [self.waiting]:
            if job is not None:
                job.cancel()

    @property
    def queued(self) -> int:
        return self.jobs.qsize() + (self.waiting is not None)

    def _loop(self) -> None:
        while True:
            job = self.jobs.get()  # idle until a job comes
            # mlx-lm's wired limit on Metal while busy (keeps the weights resident)
            with wired_limit(self.pair.target.model):
                try:
                    self._take(job)
                    while self.active or self.waiting:
                        self._round()
                        self._admit()
                except Exception as e:  # never let the worker end
                    self._restart(e)

    def _admit(self) -> None:
        """Queued jobs join while there is room (between two rounds)."""
        while len(self.active) < self.max_batch:
            job, self.waiting = self.waiting, None
            if job is None:
                try:
                    job = self.jobs.get_nowait()
                except queue.Empty:
                    return
            refused = self._refused(job)
            if refused is not None:
                job.emit(refused)
            elif self.active and not self._fits(job):
                self.waiting = job  # until a running job ends
                return
            else:
                self._start(job)

    def _fits(self, job: Job) -> bool:
        held = sum(r.bytes for r in self.active.values())
        return self.memory.admits(held, self.cache.info()["bytes"],
                                  len(job.ids) + job.max_tokens)

    def _take(self, job: Job) -> None:
        refused = self._refused(job)
        if refused is not None:
            job.emit(refused)
        else:
            self._start(job)

    def _start(self, job: Job) -> None:
        if job.sampling.constraint is not None:  # the batch has no grammars yet
            self._serve(job)  # one at a time, between two rounds
        else:
            self._join(job)

    def _join(self, job: Job) -> None:
        """Prefill the job from its slot; it joins the next round."""
        session = None
        try:
            session = self.cache.acquire(job.ids)
            index = self.batch.add(job.ids, sampling=job.sampling, max_tokens=job.max_tokens,
                                   logprobs=job.logprobs, session=session)
        except Exception as e:  # it alone ends; the running ones never saw it
            if session is not None:  # an invalid request was refused before the caches
                self.cache.release(session, ok=isinstance(e, InvalidArgumentError))
            job.emit(self._failed(e))
            return
        with self.lock:
            self.active[index] = _Running(job, Output(self, job), session,
                                          self.memory.need(len(job.ids) + job.max_tokens))

    def _round(self) -> None:
        for index, r in list(self.active.items()):  # clients that left: out before the round
            if r.job.cancelled.is_set():
                self.batch.cancel(index)
                r.out.finish = "cancelled"
                self._end(index)
        if not self.active:
            return
        try:
            events = self.batch.step()
        except Exception as e:
            return self._restart(e)
        self.rounds, self.rows = self.rounds + 1, self.rows + len(events)
        for ev in events:
            r = self.active[ev.index]
            if ev.error is not None:  # its own round failed: it alone ends, it left the batch
                self._end(ev.index, self._failed(ev.error))
                continue
            try:
                finish = r.out.feed(ev)
            except Exception as e:  # this request's own output failed: it alone ends
                self.batch.cancel(ev.index)
                self._end(ev.index, self._failed(e))
                continue
            if finish is not None:
                self.batch.cancel(ev.index)  # a stop string or a cancel: leave the batch now
                self._end(ev.index)

    def _end(self, index: int, failed: Failed | None = None) -> None:
        with self.lock:
            r = self.active.pop(index)
        self.cache.release(r.session, ok=failed is None)  # a failed job's slot is dropped
        # after it left `active`: a client that has its answer sees it gone
        r.job.emit(failed or r.out.done())

    def _restart(self, error: Exception) -> None:
        """A round raised: every running job fails, their slots go, a fresh batch starts."""
        failed = self._failed(error)  # logs and counts it once
        self.counts["failed"] += max(len(self.active) - 1, 0)
        log.warning("a batched round failed: its %d requests end with a %d; a fresh batch "
                    "starts", len(self.active), failed.status)
        old, self.batch = self.batch, Batch(self.pair, self.config)
        try:
            old.close()
        except Exception:  # its caches go with it anyway
            pass
        for index in list(self.active):
            self._end(index, failed)
