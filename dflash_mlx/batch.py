"""Many sequences at once: `Batch` (join, step, leave) and `batch_generate` on top of it.

A `Batch` runs one round for all its running sequences per `step()`: one draft pass and one
target verify pass over every row (`speculate/batch_round.py`), each sequence accepting its own
number of tokens; the width controller picks which sequences speculate and which decode
plainly (`speculate/width.py`). Sequences join between steps (`add`) and leave when they finish
or are cancelled, so a server schedules requests at round boundaries. Each sequence's events
are what `stream_generate` would yield for it, and its output is exactly the target's.

Plain KV, sliding-window (`speculate/batch_window.py`) and GatedDeltaNet
(`speculate/batch_state.py`) targets run batched; any other cache runs its sequences one after
another inside each step (`Batch.serial` says why). While every row decodes plainly, each round
is launched before the previous one is read (`speculate/batch_plain.py`); a sequence alone also
reads its lookup's cue (`_read_cue`), so a batch of one runs `stream_generate`'s rounds. A
grammar masks its row's verify rows as in a single sequence's round. Draft trees are refused.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import mlx.core as mx
from mlx_lm.generate import wired_limit

from .batch_prefill import (groups, join_rows, let_go, prefill_together, serial_reason,
                            write_back)
from .errors import InvalidArgumentError
from .generate import (
    BlockEvent,
    Session,
    _Budget,
    _event,
    _keys,
    _settle,
    _text,
    prefill,
    start,
)
from .inputs import encode_prompt
from .speculate import SamplingParams, SpeculationConfig, guards
from .speculate.batch_cache import filter_rows, row_lengths, set_lengths
from .speculate.batch_window import ragged_caches
from .speculate.batch_plain import (Ahead, ReadClock, can_go_ahead, commit, launch,
                                    next_tokens)
from .speculate.batch_draft import make_draft_caches
from .speculate.batch_round import Row, batch_round
from .speculate.lookup import Cue
from .speculate.rounds import Request, Round, path_round
from .speculate.width import WidthControl, remember, remembered


@dataclass
class BatchEvent(BlockEvent):
    """A `BlockEvent` of one sequence of a batch."""

    index: int = -1  # the sequence, as `Batch.add` numbered it
    error: Exception | None = None  # its round failed (finish_reason "error"): it alone ended


@dataclass
class _Seq:
    """One running sequence: what it asks, how far it is, and its cache state."""

    index: int
    req: Request
    budget: _Budget
    key: mx.array
    detok: object
    block: int  # its widest verify (1 once the acceptance watch gives up on the draft)
    watch: guards.AcceptanceWatch | None
    prompt: tuple[int, int, float]  # (prefilled, reused, seconds)
    row: Row | None = None  # batched: tokens and pending taps (the caches are the batch's)
    session: Session | None = None  # serial: its own caches
    home: Session | None = None  # batched: the caller's session, which gets the row back
    widths: tuple | None = None  # serial: this round's (width, (draft key, verify key))
    fixed: bool = False  # seeded sampling: its widths must not depend on the load
    note: str | None = None
    limit_note: str | None = None  # said when it stops at the model's context
    saved: tuple | None = None  # window/recurrent target: its prompt's end, to rewind to
    cue: Cue | None = None  # its lookup's cue (`WidthControl.cue`), read before each choice


class Batch:
    """Sequences decoded together, one speculative round per `step()`.

    Args:
        pair: a loaded `Pair`.
        config: how to speculate, shared by every sequence (None: `SpeculationConfig.for_pair`).
            block_size 1 is batched plain decoding. Trees are refused.
    """

    def __init__(self, pair, config: SpeculationConfig | None = None):
        config = config or SpeculationConfig.for_pair(pair)
        if config.tree and config.block_size > 1:
            raise InvalidArgumentError("draft trees (--tree) are not available in a batch yet")
        self.pair, self.config = pair, config
        self.serial = serial_reason(pair)  # None: one target pass for all sequences
        self._seqs: list[_Seq] = []
        self._fresh: list[tuple[_Seq, Session, list[int]]] = []  # prefilled at the next step
        self._count = 0
        self._ahead: Ahead | None = None  # a plain round launched and not read yet
        self._decided: list[bool] | None = None  # the next round's choice, a step early
        self._clock = ReadClock()  # plain rounds read ahead: what one costs
        self.target_cache = self.draft_cache = None
        # speculation or plain decoding, per round, from the costs measured at each batch size
        self.control = (WidthControl(config.pass_costs, remembered(pair, config.block_size))
                        if config.adaptive and config.block_size > 1 else None)
        if self.serial is None:
            self.target_cache = ragged_caches(pair.target)
            if pair.draft is not None and config.block_size > 1 and not config.draft_free:
                self.draft_cache = make_draft_caches(pair.draft, config.draft_window)

    @property
    def rows(self) -> list[int]:
        """Indices of the sequences in the batch's cache rows, in row order."""
        return [s.index for s in self._seqs]

    @property
    def running(self) -> list[int]:
        """Indices of the sequences still generating, in row order (then those joining)."""
        return [s.index for s in self._seqs] + [f[0].index for f in self._fresh]

    def add(self, prompt: str | list[int], *, sampling: SamplingParams | None = None,
            max_tokens: int = 256, logprobs: int | None = None,
            session: Session | None = None) -> int:
        """Prefill `prompt`; it joins the next `step()`. Returns its index.

        Fresh prompts (no session, or an empty one) of a batched target are prefilled at the
        next `step()`, together with the others added since (`batch_prefill.py`); the rest
        now. `session`: caches to start from (only what the prompt adds is prefilled); the
        sequence ends in it, as with `stream_generate` (a batched target's row is written back
        when it leaves)."""
        pair, config = self.pair, self.config
        params = sampling or SamplingParams()
        home = session  # where the sequence's caches go when it leaves (a batched target)
        session, lookup_only = _settle(pair, config, session, params)
        ids = encode_prompt(pair, prompt)
        req, budget, key, watch, limit_note = start(pair, config, params, ids, max_tokens,
                                                    lookup_only, logprobs)
        seq = _Seq(self._count, req, budget, key, pair.tokenizer.detokenizer,
                   config.block_size, watch, (0, 0, 0.0),
                   fixed=not params.greedy and params.seed is not None, limit_note=limit_note,
                   cue=Cue() if self.control and config.lookup and not lookup_only else None)
        self._count += 1
        if self.serial is None and not session.tokens and session.pending is None:
            self._fresh.append((seq, session, ids))
            seq.home = home
            return seq.index
        tic = time.perf_counter()
        n_prompt, n_reused = prefill(pair, session, ids)
        if self.serial is None:
            self._join([seq], [session])
            seq.home = home
        else:
            seq.session = session
        seq.prompt = (n_prompt, n_reused, time.perf_counter() - tic)
        self._seqs.append(seq)
        return seq.index

    def _join_fresh(self) -> list[BatchEvent]:
        """Prefill the fresh prompts in groups of close lengths and join them; a group whose
        prefill fails alone ends (error events), the running sequences never saw it."""
        fresh, self._fresh = self._fresh, []
        failed = []
        for group in groups([len(f[2]) for f in fresh]):
            part = [fresh[i] for i in sorted(group)]
            seqs, sessions, prompts = zip(*part)
            tic = time.perf_counter()
            try:
                rows = prefill_together(self.pair, list(sessions), list(prompts))
                self._join(list(seqs), list(sessions), rows)
            except Exception as e:
                for s in sessions:
                    let_go(self.pair, s)
                failed += [self._event(seq, Round([], "error", [], 0, None, 0.0, 0.0, error=e))
                           for seq in seqs]
                continue
            seconds = time.perf_counter() - tic
            for seq, ids in zip(seqs, prompts):
                seq.prompt = (len(ids) - 1, 0, seconds)
                self._seqs.append(seq)
        return failed

    def _join(self, seqs: list[_Seq], sessions: list[Session], target_rows=None):
        """Prefilled sessions' rows into the batch's caches (`join_rows`); the sessions let
        go of theirs."""
        keep = getattr(self.pair.target, "rows_checkpoint", None)
        first = len(self._seqs)  # their rows follow the running ones'
        for b, (seq, (tokens, pending)) in enumerate(zip(seqs, join_rows(
                self.pair, self.target_cache, self.draft_cache, sessions, target_rows))):
            seq.row = Row(tokens, pending, seq.req)
            if keep is not None:  # the prompt's end: where a later turn can rewind to
                seq.saved = (len(tokens) - 1, keep(self.target_cache, first + b))

    def cancel(self, index: int) -> bool:
        """Drop a sequence between steps (False: it is not running); the others go on exactly."""
        joining = [f for f in self._fresh if f[0].index == index]
        if joining:  # nothing prefilled yet
            self._fresh.remove(joining[0])
            return True
        rows = [i for i, s in enumerate(self._seqs) if s.index == index]
        if not rows:
            return False
        self._leave(set(rows))
        return True

    def _leave(self, rows: set[int]):
        keep = [i for i in range(len(self._seqs)) if i not in rows]
        if self.target_cache is not None and rows:
            # a leaving row keeps what it committed (a launched round may have written more)
            lengths = row_lengths(self.target_cache)
            for i in rows:
                lengths[i] = len(self._seqs[i].row.tokens) - 1
            set_lengths(self.target_cache, lengths)
        if self._ahead is not None:
            self._ahead.keep([i for i in keep if i < len(self._ahead.rows)])
            if not self._ahead.rows:
                self._ahead = None
        for i in sorted(rows):
            s = self._seqs[i]
            if self.control is not None:
                self.control.forget(s.index)
            if s.home is not None:  # a server's next turn of that conversation reuses it
                write_back(self.pair, self.target_cache, self.draft_cache, i, s.home,
                           s.row.tokens, s.row.pending, s.saved)
                s.home = None
        self._seqs = [self._seqs[i] for i in keep]
        filter_rows(self.target_cache, keep)
        filter_rows(self.draft_cache, keep)

    def step(self) -> list[BatchEvent]:
        """One round for every running sequence: one event each; finished ones leave."""
        if self._ahead is not None:  # a plain round is running: read it, start the next
            return self._step_ahead()
        failed = self._join_fresh()
        if not self._seqs:
            return failed
        keys = [s.index for s in self._seqs]
        wide = self._decide(keys)
        widths = self._widths(wide)
        if self.serial is None and all(w == 1 for w in widths) and can_go_ahead(
                [s.row for s in self._seqs]):
            self._clock.start()
            self._ahead = self._launch(mx.array([s.row.tokens[-1] for s in self._seqs]))
            return failed + self._step_ahead()
        self._draw_keys(widths)
        if self.serial is None:
            rounds = batch_round(self.pair, self.config, [s.row for s in self._seqs],
                                 self.target_cache, self.draft_cache)
        else:  # one sequence after another, each with its own caches
            rounds = [self._serial_round(s) for s in self._seqs]
        if self.control is not None:
            seconds = (rounds[0].draft_s + rounds[0].verify_s if self.serial is None
                       else sum(r.draft_s + r.verify_s for r in rounds))
            if any(not s.budget.produced for s in self._seqs):
                seconds = None  # a first round (new shapes, a joiner's context): not typical
            rows = max(1 + len(r.drafted) for r in rounds)  # every row is padded to the widest
            self.control.record(keys, [w > 1 for w in widths], seconds,
                                [len(r.tokens) for r in rounds], rows)
        return failed + self._finish(rounds)

    def _decide(self, keys: list[int]) -> list[bool]:
        """Which sequences the next round speculates for (decided once per round, even
        across steps)."""
        if self._decided is not None:
            wide, self._decided = self._decided, None
            return wide
        if self.control is None:
            return [True] * len(keys)
        self._read_cue(True)
        return self.control.choose(keys, any(s.fixed for s in self._seqs))

    def _read_cue(self, tell: bool) -> bool:
        """A sequence alone reads its lookup's cue every round and, `tell`, passes it on while
        it decodes plainly. Returns whether the lookup guesses the next token: then no round
        goes ahead, whose choice would miss the cue (one a round late is worth little).
        Batches of several ignore it: it did not pay there (docs/measurements.md)."""
        s = self._seqs[0] if len(self._seqs) == 1 else None
        if s is None or s.cue is None:
            return False
        if s.cue((s.row or s.session).tokens) and self.control.plain and tell:
            self.control.cue()
        return s.cue.guessing

    def _widths(self, wide: list[bool]) -> list[int]:
        cap = self.control and self.control.rows  # one sequence's narrow probe (the floor)
        return [min(s.block if w else 1, s.budget.max_tokens - s.budget.produced, cap or s.block)
                for s, w in zip(self._seqs, wide)]

    def _draw_keys(self, widths: list[int]):
        """This round's widths and random keys, per sequence."""
        for s, width in zip(self._seqs, widths):
            drafts = width > 1 and not s.req.lookup_only
            s.key, dkey, vkey = _keys(s.key, s.req.params, drafts)
            if s.row is not None:
                s.row.width, s.row.dkey, s.row.vkey = width, dkey, vkey
            else:
                s.widths = (width, (dkey, vkey))

    def _launch(self, last: mx.array):
        self._draw_keys([1] * len(self._seqs))
        return launch(self.pair, [s.row for s in self._seqs], last, self.target_cache,
                      self.draft_cache is not None)

    def _step_ahead(self) -> list[BatchEvent]:
        """Read the launched plain round; before that, launch the next one from its answers
        on the device when the batch goes on plainly as it is (nobody joined or joins)."""
        ahead, self._ahead = self._ahead, None
        keys = [s.index for s in self._seqs]
        # a cue exists only with a controller (`add`)
        if not self._fresh and len(ahead.rows) == len(self._seqs) and not self._read_cue(False):
            wide = self._decide(keys)
            if all(w == 1 for w in self._widths(wide)):
                self._ahead = self._launch(next_tokens(ahead))
            else:
                self._decided = wide  # the next step's round, after this one is read
        rounds = commit(self.pair, ahead, self._clock.since)
        seconds = self._clock.read(ahead.trimmed, self._ahead is not None)
        if self.control is not None:
            self.control.record(keys[: len(rounds)], False, seconds)
        return self._finish(rounds)

    def _finish(self, rounds: list[Round]) -> list[BatchEvent]:
        """Events of a round over the first len(rounds) sequences; finished ones leave."""
        events, done = [], set()
        for i, (s, rnd) in enumerate(zip(self._seqs, rounds)):
            events.append(self._event(s, rnd))
            if rnd.finish is not None:
                done.add(i)
        if done:
            self._leave(done)
        return events

    def _serial_round(self, s: _Seq) -> Round:
        try:
            return path_round(self.pair, s.session, self.config, s.widths[0], s.req, s.widths[1])
        except Exception as e:  # this sequence alone ends (its own caches go with it)
            return Round([], "error", [], 0, None, 0.0, 0.0, error=e)

    def _event(self, s: _Seq, rnd) -> BatchEvent:
        s.budget.produced += len(rnd.tokens)
        note, s.note = s.note, None
        if rnd.finish == "length" and s.limit_note:
            note = s.limit_note
        if s.watch is not None and s.watch.feed(len(rnd.drafted), rnd.accepted):
            s.block, s.watch, note = 1, None, s.watch.note  # the rest is plain decoding
        text = _text(s.detok, rnd.tokens, rnd.finish, s.budget.eos)
        ev = _event(rnd, text, *s.prompt, s.budget.produced, note)
        return BatchEvent(**vars(ev), index=s.index, error=rnd.error)

    def tokens(self, index: int) -> list[int]:
        """A running sequence's tokens so far (prompt included)."""
        for seq, _, ids in self._fresh:
            if seq.index == index:
                return list(ids)
        s = next(s for s in self._seqs if s.index == index)
        return list(s.row.tokens if s.row is not None else s.session.tokens)

    def close(self):
        """Drop every sequence and free the caches."""
        self._fresh = []
        self._leave(set(range(len(self._seqs))))
        if self.control is not None:  # the next batch of this pair starts from what it measured
            remember(self.pair, self.config.block_size, self.control)


def batch_generate(
    pair,
    prompts: Sequence[str | list[int]],
    config: SpeculationConfig | None = None,
    sampling: SamplingParams | Sequence[SamplingParams] | None = None,
    *,
    max_tokens: int | Sequence[int] = 256,
    logprobs: int | None = None,
) -> Iterator[BatchEvent]:
    """Generate for every prompt together; yields each sequence's events as its rounds finish.

    Args:
        pair: a loaded `Pair`.
        prompts: texts (tokenized as is) or token ids, one per sequence.
        config: how to speculate (None: this device's defaults for the pair).
        sampling: one `SamplingParams` for all, or one per prompt (None: greedy).
        max_tokens: one limit for all, or one per prompt.
        logprobs: as in `stream_generate`.

    Yields:
        `BatchEvent`s; `event.index` is the prompt's position in `prompts`, and each
        sequence's last event carries its `finish_reason`: "error" with `event.error` when
        that sequence alone failed (its processors raised, its logits were not finite).
    """
    n = len(prompts)
    params = list(sampling) if isinstance(sampling, Sequence) else [sampling] * n
    limits = list(max_tokens) if isinstance(max_tokens, Sequence) else [max_tokens] * n
    if len(params) != n or len(limits) != n:
        raise InvalidArgumentError("give one sampling setting and one max_tokens per prompt")
    batch = Batch(pair, config)
    try:
        with wired_limit(pair.target.model):
            for p, s, m in zip(prompts, params, limits):
                batch.add(p, sampling=s, max_tokens=m, logprobs=logprobs)
            while batch.running:
                yield from batch.step()
    finally:
        batch.close()
