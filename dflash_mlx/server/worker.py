"""The server's engine side: one worker thread, a bounded queue, stop strings, per-request stats.

Every generation runs on one engine thread. HTTP handlers submit a `Job` and read its messages
from an asyncio queue. `Worker` runs jobs one at a time in arrival order, each in the session
the prompt cache gives it (the conversation sharing the longest prefix); `BatchWorker`
(batch_worker.py) decodes several at once. A job cancelled by its client (disconnect) is closed
at the next block boundary: the engine's `finally` blocks leave that session's caches exact,
so the next request reuses them. `Output` turns one job's block events into its messages
(stop strings, log-probabilities, stats, TTFT and time per output token) on either path.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from dataclasses import dataclass, field, replace
from functools import cached_property

from ..generate import Session, stream_generate
from ..speculate import SamplingParams, SpeculationConfig
from ..errors import DFlashError, InvalidArgumentError
from ..stats import Stats
from .memory import RequestMemory
from .prompt_cache import DEFAULT_SLOTS, PromptCache

log = logging.getLogger("dflash_mlx.server")


class Busy(Exception):
    """The bounded queue is full."""


# One emitted token's log-probability: (id, log-probability, [(id, log-probability), ...])
TokenLogprob = tuple[int, float, list[tuple[int, float]]]


@dataclass
class Delta:
    text: str
    logprobs: list[TokenLogprob] | None = None  # the tokens behind `text`, when asked
    tokens: int = 0  # how many tokens the block emitted (usage's reasoning_tokens counts them)


@dataclass
class Done:
    finish_reason: str  # stop | length | cancelled
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    speculation: dict  # `Stats.as_dict()` of this request


@dataclass
class Failed:
    status: int
    message: str


class StopFilter:
    """Cuts text at the first stop string; holds back a tail that may start one."""

    def __init__(self, stops: list[str]):
        self.stops = [s for s in stops if s]
        self.held = ""

    def feed(self, text: str) -> tuple[str, bool]:
        """(text safe to emit, whether a stop string was found)."""
        buf = self.held + text
        hits = [i for i in (buf.find(s) for s in self.stops) if i >= 0]
        if hits:
            self.held = ""
            return buf[: min(hits)], True
        keep = 0
        for s in self.stops:
            for k in range(min(len(s) - 1, len(buf)), keep, -1):
                if buf.endswith(s[:k]):
                    keep = k
                    break
        self.held = buf[len(buf) - keep:]
        return buf[: len(buf) - keep], False

    def flush(self) -> str:
        out, self.held = self.held, ""
        return out


@dataclass
class Job:
    """One request: prompt ids, sampling settings, stop strings, and the way back to HTTP."""

    ids: list[int]
    sampling: SamplingParams
    stop: list[str] = field(default_factory=list)
    max_tokens: int = 256
    logprobs: int | None = None  # top alternatives per token; None: no log-probabilities
    loop: asyncio.AbstractEventLoop | None = None
    messages: asyncio.Queue | None = None
    cancelled: threading.Event = field(default_factory=threading.Event)
    created: float = field(default_factory=time.perf_counter)  # TTFT counts from here

    def __post_init__(self):
        if self.loop is None:
            self.loop = asyncio.get_running_loop()
        if self.messages is None:
            self.messages = asyncio.Queue()

    def cancel(self) -> None:
        self.cancelled.set()

    def emit(self, msg) -> None:
        try:
            self.loop.call_soon_threadsafe(self.messages.put_nowait, msg)
        except RuntimeError:  # the event loop is gone (server shutting down)
            self.cancel()

    async def stream(self):
        """Messages until the job ends (Done or Failed)."""
        while True:
            msg = await self.messages.get()
            yield msg
            if not isinstance(msg, Delta):
                return


def _finite(lp) -> float:
    """A log-probability JSON can carry: a token the grammar forbids (-inf) reads -9999.0, as
    OpenAI reports such alternatives."""
    return max(float(lp), -9999.0)


@dataclass
class Summary:
    """Seconds summed over requests, and how many (a Prometheus summary without quantiles)."""

    sum: float = 0.0
    count: int = 0

    def add(self, seconds: float) -> None:
        self.sum += seconds
        self.count += 1


class Output:
    """One job's block events turned into its messages: stop strings, log-probabilities,
    stats and timings. `feed` returns the finish reason once the job is over."""

    def __init__(self, worker: Worker, job: Job):
        self.worker, self.job = worker, job
        self.stats, self.stop = Stats(), StopFilter(job.stop)
        self.finish: str | None = None
        self.eos = (set(getattr(worker.pair.tokenizer, "eos_token_ids", None) or [])
                    if job.logprobs is not None else set())  # only log-probabilities look at ids
        self.raw = self.emitted = 0  # characters generated (stop strings included) / sent
        self.first = self.last = None  # when the first and the latest event came

    def feed(self, ev) -> str | None:
        job, worker = self.job, self.worker
        self.last = time.perf_counter()
        self.first = self.first or self.last
        self.stats.add(ev)
        with worker.lock:
            worker.total.add(ev)
        text, hit = self.stop.feed(ev.text)
        if hit:
            self.finish = "stop"
        elif ev.finish_reason is not None:
            text += self.stop.flush()
            self.finish = ev.finish_reason
        lps = None
        if job.logprobs is not None and ev.logprobs is not None:
            # a stop string cuts the text: keep the tokens that start before the cut
            cut = self.emitted + len(text) if hit else None  # held text starts at `emitted`
            lps = worker._token_logprobs(ev, self.eos, self.raw, cut)
        self.raw += len(ev.text)
        self.emitted += len(text)
        # even empty: one chunk per block paces the client
        job.emit(Delta(text, lps, len(ev.tokens)))
        if self.finish is None and job.cancelled.is_set():
            self.finish = "cancelled"
        return self.finish

    def done(self) -> Done:
        """The job's Done; counts it, records its timings and logs them in one line."""
        worker, stats, finish = self.worker, self.stats, self.finish or "stop"
        ttft = tpot = None
        with worker.lock:
            worker.counts["cancelled" if finish == "cancelled" else "completed"] += 1
            worker.latency["request"].add(time.perf_counter() - self.job.created)
            if self.first is not None:
                ttft = self.first - self.job.created
                worker.latency["ttft"].add(ttft)
            if stats.tokens > 1:  # the time between tokens after the first
                tpot = (self.last - self.first) / (stats.tokens - 1)
                worker.latency["tpot"].add(tpot)
        log.info("request %s: %d prompt tokens (%d cached), %d generated, TTFT %s, "
                 "per output token %s", finish, len(self.job.ids), stats.reused_tokens,
                 stats.tokens, _seconds(ttft), _seconds(tpot))
        return Done(finish, len(self.job.ids), stats.reused_tokens, stats.tokens,
                    stats.as_dict())


def _seconds(value: float | None) -> str:
    return "-" if value is None else f"{value * 1000:.1f} ms"


class Worker:
    """Runs jobs one at a time on a dedicated thread, reusing conversations' caches."""

    group = None  # the mlx.distributed group under mlx.launch (`follower.Leader`)
    max_batch = 1

    def __init__(self, pair, config: SpeculationConfig, queue_size: int = 64, *,
                 cache_slots: int = DEFAULT_SLOTS, cache_bytes: int | None = None):
        if queue_size < 1:
            raise InvalidArgumentError(f"--queue-size must be at least 1, got {queue_size}")
        self.pair, self.config = pair, config
        self.jobs: queue.Queue[Job] = queue.Queue(maxsize=queue_size)
        self.cache = PromptCache(pair, self._new_session, cache_slots, cache_bytes)
        self.session: Session | None = None  # the running job's (`_generate` runs in it)
        self.counts = {"completed": 0, "cancelled": 0, "failed": 0}
        self.total = Stats()  # every request since start, for /health (guarded by `lock`)
        # submit to Done, submit to the first token, per token after it (guarded by `lock`)
        self.latency = {"request": Summary(), "ttft": Summary(), "tpot": Summary()}
        self.closing = False
        self.current: Job | None = None
        self.lock = threading.Lock()
        self.thread = threading.Thread(target=self._loop, name="dflash-engine", daemon=True)

    @cached_property
    def memory(self) -> RequestMemory:
        """What a request's cache may take here."""
        return RequestMemory.of(self.pair)

    def _new_session(self) -> Session:
        return Session.new(self.pair, self.config)

    def _generate(self, job: Job):
        """The job's block events (under mlx.launch, `follower.Leader` runs them in step)."""
        return stream_generate(self.pair, job.ids, self.config, session=self.session,
                               sampling=job.sampling, max_tokens=job.max_tokens,
                               logprobs=job.logprobs)

    def start(self) -> "Worker":
        if self.group is not None:  # every follower mirrors one session (follower.py)
            self.cache.slots = 1
        self.thread.start()
        return self

    def cancel_all(self) -> None:
        """Shutting down: the running job stops at its next block; queued ones are refused."""
        self.closing = True  # a job taken from the queue after this is refused
        with self.lock:
            current = self.current
        with self.jobs.mutex:
            pending = list(self.jobs.queue)
        for job in [*pending, current]:
            if job is not None:
                job.cancel()

    def close(self, timeout: float = 30.0) -> None:
        """Cancel everything and wait until the thread is idle, so exit never cuts a pass.

        The thread is left waiting on its queue rather than ended: MLX frees a thread's
        compile cache when the thread ends, which takes the GIL, and that aborts the process
        (std::terminate) if it races with the interpreter's own shutdown.
        """
        self.cancel_all()
        deadline = time.monotonic() + timeout
        while (self.running or self.jobs.qsize()) and time.monotonic() < deadline:
            time.sleep(0.02)

    @property
    def alive(self) -> bool:
        return self.thread.is_alive()

    @property
    def running(self) -> bool:
        return self.current is not None or self.batch_size > 0

    @property
    def batch_size(self) -> int:
        """Sequences in the running batch (`BatchWorker`; 0 here)."""
        return 0

    def timings(self) -> dict[str, Summary]:
        """The latency summaries since start (copies)."""
        with self.lock:
            return {k: replace(v) for k, v in self.latency.items()}

    def retry_after(self) -> int:
        """Seconds a refused client should wait: the queue's share of the mean request time."""
        with self.lock:
            done = replace(self.latency["request"])
        mean = done.sum / done.count if done.count else 1.0
        return max(1, min(60, round(mean * max(self.queued, 1) / self.max_batch)))

    @property
    def queued(self) -> int:
        return self.jobs.qsize()

    def speculation(self) -> dict:
        """`Stats.as_dict()` over every request served so far."""
        with self.lock:
            return self.total.as_dict()

    def cache_info(self) -> dict:
        """The prompt cache: slots and bytes used and allowed, hits, misses, reused tokens."""
        return self.cache.info()

    def submit(self, job: Job) -> None:
        if self.closing:
            raise Busy
        try:
            self.jobs.put_nowait(job)
        except queue.Full:
            raise Busy from None

    def _loop(self) -> None:
        while True:
            self._serve(self.jobs.get())

    def _serve(self, job: Job) -> None:
        """Run one job to its end in its prompt-cache session, then emit its last message."""
        with self.lock:
            self.current = job
        try:
            final = self._refused(job) or self._cached(job)
        except Exception as e:  # never let one request end the worker
            final = self._failed(e)
        finally:
            with self.lock:
                self.current = None
        # after `running` is cleared: a client that has its answer sees the worker idle
        job.emit(final)

    def _refused(self, job: Job) -> Failed | None:
        """A job taken from the queue after its client left, while shutting down, or whose
        cache this machine's memory cannot hold."""
        if not (job.cancelled.is_set() or self.closing):
            why = self.memory.refusal(len(job.ids), job.max_tokens)
            if why is None:
                return None
            self.counts["failed"] += 1
            log.warning("refused: %s", why)
            return Failed(400, why)
        self.counts["cancelled"] += 1
        return (Failed(503, "the server is shutting down") if self.closing
                else Failed(499, "cancelled before it started"))

    def _failed(self, e: Exception) -> Failed:
        """A job's error as its answer: the engine's own errors say what went wrong."""
        self.counts["failed"] += 1
        if isinstance(e, DFlashError):
            return Failed(400 if isinstance(e, InvalidArgumentError) else 500, str(e))
        log.error("generation failed", exc_info=e)
        return Failed(500, f"generation failed ({type(e).__name__}: {e})")

    def _cached(self, job: Job) -> Done:
        """`_run` in the session the prompt cache gives the job. A failed job's slot is dropped
        rather than trusted, unless its request was refused as invalid (the engine checks
        those before it touches a cache)."""
        self.session, ok = self.cache.acquire(job.ids), False
        try:
            done, ok = self._run(job), True
            return done
        except InvalidArgumentError:
            ok = True
            raise
        finally:
            self.cache.release(self.session, ok)
            self.session = None

    def _token_logprobs(self, ev, eos: set[int], start: int,
                        cut: int | None) -> list[TokenLogprob]:
        """The block's tokens with their log-probabilities, EOS left out (it is no text). With a
        stop string at character `cut` of the generated text, only the tokens that start before
        it (offsets by decoding the block's prefixes; the block's text starts at `start`)."""
        tops = ev.top_logprobs or [[] for _ in ev.tokens]
        out = []
        for i, (t, lp, top) in enumerate(zip(ev.tokens, ev.logprobs, tops)):
            if t in eos:
                continue
            if cut is not None and start + len(self.pair.tokenizer.decode(ev.tokens[:i])) >= cut:
                break
            out.append((int(t), _finite(lp), [(int(a), _finite(b)) for a, b in top]))
        return out

    def _run(self, job: Job) -> Done:
        out = Output(self, job)
        gen = self._generate(job)
        try:
            for ev in gen:
                if out.feed(ev) is not None:
                    break
        finally:
            gen.close()  # stops at this block boundary; the engine leaves the caches exact
        return out.done()
