"""Plain batched rounds run one ahead: the next round is built while this one computes.

When every row of a batch decodes plainly (width 1, as the load-adaptive width chooses on a
busy batch), a round's only input is each row's last token. The next round can then be built
from this round's answers still on the device, before the host has read them, so building the
graph in Python overlaps the previous pass's compute (as mlx-lm's batch generator does). A
launched round (`Ahead`) has written its K/V into the batch's caches; `commit` reads it,
applies each row's stop rule and logits guard, and extends its tokens and pending taps.

Only rows with nothing to decide on the host between rounds go ahead: no grammar (its mask
needs the committed token) and no logits processors (they read the committed history). Output
is the same as `batch_round` at width 1: the same answer function, the same keys.
"""

from __future__ import annotations

import time

from dataclasses import dataclass

import mlx.core as mx

from . import guards
from .batch_round import Row, _answer
from .rounds import Round, _logprobs


def can_go_ahead(rows: list[Row]) -> bool:
    """Whether these rows' next rounds can be built before this one is read."""
    return all(r.width == 1 and r.req.grammar is None and not r.req.params.processors
               for r in rows)


@dataclass
class Ahead:
    """One launched plain round: its rows' answers, still on the device."""

    rows: list[Row]
    logits: mx.array  # (B, V) each row's next-token logits
    answers: mx.array  # (B, 1) greedy, (B, 2) sampled ([accepted, next]); next is column -1
    finite: mx.array  # (B,) int32
    taps: mx.array | None  # (B, 1, T) the target's taps of each row's input token
    # rows left after it was launched: the leave ran while it did, so its time is not a round's
    trimmed: bool = False

    def keep(self, keep: list[int]):
        """Only these rows (in this order): the others left before this round was read."""
        self.trimmed = True
        idx = mx.array(keep, mx.int32)
        self.rows = [self.rows[i] for i in keep]
        self.logits, self.answers, self.finite = (
            self.logits[idx], self.answers[idx], self.finite[idx])
        if self.taps is not None:
            self.taps = self.taps[idx]


def launch(pair, rows: list[Row], last: mx.array, target_cache: list, taps: bool) -> Ahead:
    """Build one plain round over `rows` whose input tokens are `last` (B,) and start it.

    The rows' verify keys (`Row.vkey`) must already be this round's.
    """
    logits, t = pair.target(last.reshape(-1, 1), target_cache, taps=taps)
    logits = logits[:, 0]
    none = mx.zeros((0,), mx.int32)
    if all(r.req.params.greedy for r in rows):
        answers = mx.argmax(logits, axis=-1).astype(mx.int32)[:, None]
    else:  # rows draw with their own settings and keys; greedy rows' answer padded to two
        cols = []
        for b, r in enumerate(rows):
            a = _answer(logits[b: b + 1], none, None, r)
            cols.append(mx.concatenate([mx.zeros((1,), mx.int32), a]) if a.size == 1 else a)
        answers = mx.stack(cols)
    finite = mx.stack([guards.logits_ok(logits[b: b + 1]) for b in range(len(rows))])
    finite = finite.astype(mx.int32)
    mx.async_eval(answers, finite)
    return Ahead(list(rows), logits, answers, finite, t)


def next_tokens(ahead: Ahead) -> mx.array:
    """The launched round's answers (B,), on the device: the next round's inputs."""
    return ahead.answers[:, -1]


def commit(pair, ahead: Ahead, since: float) -> list[Round]:
    """Read a launched round and commit it: one `Round` per row, in order, each timed from
    `since` (the last read) to this read.

    A row that finishes or fails here keeps its committed tokens, but its cache row may
    already hold the next round's token (the caller rolls it back when the row leaves).
    """
    host = mx.concatenate([next_tokens(ahead), ahead.finite]).tolist()
    seconds = time.perf_counter() - since
    n = len(ahead.rows)
    out = []
    for b, (r, nxt, ok) in enumerate(zip(ahead.rows, host[:n], host[n:])):
        if not ok:  # it keeps nothing of this round and leaves
            out.append(Round([], "error", [], 0, None, 0.0, seconds,
                             error=guards.logits_error(pair.target_id)))
            continue
        new, finish = r.req.stop([nxt])
        lps, tops = _logprobs(ahead.logits[b: b + 1], new, r.req.logprobs)
        out.append(Round(new, finish, [], 0, None, 0.0, seconds, logprobs=lps,
                         top_logprobs=tops))
        r.tokens.extend(new)
        if ahead.taps is not None and new:
            t = ahead.taps[b: b + 1]
            r.pending = t if r.pending is None else mx.concatenate([r.pending, t], axis=1)
    return out


class ReadClock:
    """What a plain round read ahead costs.

    A read may wait for the round launched after it too (the CPU's does), and the last read
    of a run finds its round done: so a round costs the mean from a run's first read to a
    read that launched the next round. Exact whether a read waits for all work (CPU) or for
    its own round (a GPU)."""

    def __init__(self):
        self.since = 0.0  # the last read (or the run's launch)
        self._run: tuple[float, int] | None = None  # (the run's first read, reads since)

    def start(self):
        """A run of plain rounds is launched."""
        self.since, self._run = time.perf_counter(), None

    def read(self, trimmed: bool, launched: bool) -> float | None:
        """A round was read (`trimmed`: rows left since its launch; `launched`: the next
        round went before the read): a round's seconds, or None (not typical)."""
        self.since = now = time.perf_counter()
        if self._run is None or trimmed:
            self._run = (now, 0)
            return None
        first, reads = self._run[0], self._run[1] + 1
        self._run = (first, reads)
        return (now - first) / reads if launched else None
