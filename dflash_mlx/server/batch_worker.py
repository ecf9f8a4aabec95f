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

A long prompt joining a running batch is prefilled one chunk (`prefill_step()` tokens) per
round, so the running streams are not starved while it prefills; alone, it prefills at once.

Memory (`memory.py`): a job whose cache could not fit even alone is refused with a 400; one
that does not fit beside the running jobs and the prompt cache waits (first in line, so no
later job overtakes it) until one of them ends.

Requests with a grammar (response_format, a forced tool choice) join the batch like any other:
their rows are masked by their own matcher. A request whose own grammar, processors or logits
fail ends alone (500); a round that raises otherwise fails every running request (500), drops
their slots and starts a fresh batch; the server goes on.
"""

from __future__ import annotations

import logging
import queue
from dataclasses import dataclass

from mlx_lm.generate import wired_limit

from ..batch import Batch, serial_reason
from ..errors import InvalidArgumentError
from ..generate import Session, _common_prefix as common_prefix, prefill, prefill_step
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


@dataclass
class _Joining:
    job: Job
    session: Session  # its slot, holding the prompt's first `upto` tokens
    upto: int


class BatchWorker(Worker):
    """Decodes up to `max_batch` jobs together, one speculative round for all at a time."""

    def __init__(self, pair, config, queue_size: int = 64, *, max_batch: int, **cache):
        super().__init__(pair, config, queue_size, **cache)
        self.max_batch = max_batch
        self.batch = Batch(pair, config)
        self.active: dict[int, _Running] = {}  # by batch index (changed under `lock`)
        self.waiting: Job | None = None  # taken from the queue, joins when memory frees
        self.joining: _Joining | None = None  # a long prompt, prefilled a chunk per round
        self.chunk = prefill_step()
        self.rounds = self.rows = 0  # batched rounds, and sequences summed over them

    @property
    def batch_size(self) -> int:
        return len(self.active)

    def cancel_all(self) -> None:
        super().cancel_all()
        with self.lock:
            running = list(self.active.values())
        joining = self.joining
        for job in [r.job for r in running] + [self.waiting, joining and joining.job]:
            if job is not None:
                job.cancel()

    @property
    def queued(self) -> int:
        return self.jobs.qsize() + (self.waiting is not None)

    @property
    def running(self) -> bool:
        return super().running or self.joining is not None

    def _loop(self) -> None:
        while True:
            job = self.jobs.get()  # idle until a job comes
            # mlx-lm's wired limit on Metal while busy (keeps the weights resident)
            with wired_limit(self.pair.target.model):
                try:
                    self._take(job)
                    while self.active or self.waiting or self.joining:
                        self._round()
                        self._prefill_chunk()
                        self._admit()
                except Exception as e:  # never let the worker end
                    self._restart(e)

    def _admit(self) -> None:
        """Queued jobs join while there is room (between two rounds), one prefill at a time."""
        while self.joining is None and len(self.active) < self.max_batch:
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
                self._join(job)

    def _fits(self, job: Job) -> bool:
        held = sum(r.bytes for r in self.active.values())
        return self.memory.admits(held, self.cache.info()["bytes"],
                                  len(job.ids) + job.max_tokens)

    def _take(self, job: Job) -> None:
        refused = self._refused(job)
        if refused is not None:
            job.emit(refused)
        else:
            self._join(job)


    def _join(self, job: Job) -> None:
        """Prefill the job from its slot; it joins the next round (a long prompt beside
        running jobs: after its chunks, `_prefill_chunk`)."""
        session = None
        try:
            session = self.cache.acquire(job.ids)
            upto = common_prefix(session.tokens, job.ids)
            if self.active and len(job.ids) - upto > self.chunk:
                self.joining = _Joining(job, session, upto)
                return
        except Exception as e:
            return self._join_failed(job, session, e)
        self._add(job, session)

    def _prefill_chunk(self) -> None:
        """The joining prompt's next chunk; its rest and its join once little is left or
        nobody runs to wait for it."""
        j = self.joining
        if j is None:
            return
        refused = self._refused(j.job)  # its client left, or the server is closing
        if refused is not None:
            self.joining = None
            self.cache.release(j.session)  # exact: prefill keeps whole chunks only
            j.job.emit(refused)
            return
        if self.active and len(j.job.ids) - j.upto > self.chunk:
            try:
                j.upto += self.chunk
                prefill(self.pair, j.session, j.job.ids[: j.upto])
            except Exception as e:
                self.joining = None
                self._join_failed(j.job, j.session, e)
            return
        self.joining = None
        self._add(j.job, j.session)

    def _add(self, job: Job, session: Session) -> None:
        try:
            index = self.batch.add(job.ids, sampling=job.sampling, max_tokens=job.max_tokens,
                                   logprobs=job.logprobs, session=session)
        except Exception as e:
            return self._join_failed(job, session, e)
        with self.lock:
            self.active[index] = _Running(job, Output(self, job), session,
                                          self.memory.need(len(job.ids) + job.max_tokens))

    def _join_failed(self, job: Job, session: Session | None, e: Exception) -> None:
        """It alone ends; the running ones never saw it."""
        if session is not None:  # an invalid request was refused before the caches
            self.cache.release(session, ok=isinstance(e, InvalidArgumentError))
        job.emit(self._failed(e))

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
