"""Sequences joining a batch (fresh prompts prefilled in shared target passes, rows copied
in) and leaving it for their sessions; `serial_reason`: targets whose rows cannot be joined.

One prompt at a time, a batch of N new requests pays N prefill passes whose rows are few; on
a CPU (or a GPU) a pass of N prompts' rows costs much less than N passes. Here the prompts go
through the target together: every row writes its chunk at its own end of a ragged cache (a
shorter chunk is padded by repeating its last token, and the padding is cut off right after,
as a verify round's is), so each row ends holding exactly its own prompt at the positions a
single prefill gives it. Each prompt's taps feed its own draft cache as `generate.prefill`
feeds them. The batch takes the ragged cache over whole: no row is copied out and back in.

A pass carries about `prefill_step()` tokens in all (a chunk per row of that over the rows), so
its temporaries (attention scores above all) stay those of one prompt's prefill however many
join; and prompts go together only when their lengths are close (`groups`), so a short
prompt is not padded through a long one's passes.
"""

from __future__ import annotations

import mlx.core as mx
from mlx_lm.models.cache import ArraysCache, KVCache, RotatingKVCache

from .generate import Session, _feed_draft, prefill_step
from .models.hybrid import HybridTarget
from .speculate.batch_cache import row_lengths, set_lengths
from .speculate.batch_window import ragged_caches

MIN_CHUNK = 32  # columns per row and pass, however many rows


def serial_reason(pair) -> str | None:
    """Why `pair`'s sequences cannot share one target pass (None: they can)."""
    kinds = set(pair.target.cache_types)
    if kinds <= {KVCache, RotatingKVCache}:
        return None  # sliding windows are the mask's in a batch (`batch_window.py`)
    if kinds == {KVCache, ArraysCache} and isinstance(pair.target, HybridTarget):
        return None  # each row replays its accepted steps (`batch_state.py`)
    if ArraysCache in kinds:
        return ("these recurrent caches roll back per sequence; "
                "its sequences run one after another")
    names = ", ".join(sorted(k.__name__ for k in kinds - {KVCache}))
    return f"{names} caches are not batched; its sequences run one after another"


def groups(lengths: list[int], slack: int = 64) -> list[list[int]]:
    """Indices of the prompts to prefill together, longest first: a group grows while the
    padding it carries (rows x its longest, less their tokens) stays within a quarter of its
    tokens or `slack` tokens."""
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    out: list[list[int]] = []
    for i in order:
        if out:
            g = out[-1] + [i]
            tokens = sum(lengths[j] for j in g)
            if len(g) * lengths[g[0]] - tokens <= max(slack, tokens // 4):
                out[-1] = g
                continue
        out.append([i])
    return out


def prefill_together(pair, sessions: list[Session], prompts: list[list[int]]) -> list:
    """Bring each fresh (empty) session to its prompt, as `generate.prefill` does, in shared
    passes, but for the target's cache: returns it, one ragged cache per layer whose row b
    is what `prefill` leaves in session b's. On an exception the sessions are left empty."""
    caches = ragged_caches(pair.target)
    for c in caches:  # one empty row each
        c.add(*[KVCache() for _ in prompts])
    bodies = [p[:-1] for p in prompts]  # the last token is the first round's slot 0
    use_draft = all(s.draft_cache is not None for s in sessions)
    floors = [None] * len(prompts)
    if use_draft:
        limit = pair.draft.context_rows_needed(sessions[0].draft_window)
        floors = [None if limit is None else len(b) - limit for b in bodies]
    step = max(MIN_CHUNK, prefill_step() // max(len(prompts), 1))
    try:
        for start in range(0, max(map(len, bodies), default=0), step):
            chunks = [b[start: start + step] for b in bodies]
            width = max(map(len, chunks))
            ids = [c + [(c or b or [0])[-1]] * (width - len(c)) for c, b in zip(chunks, bodies)]
            before = row_lengths(caches)
            valid = [len(c) for c in chunks]
            for c in caches:  # a recurrent layer masks the padding (mlx-lm's batch lengths)
                c.expect(valid if width > min(valid) else None)
            _, taps = pair.target(mx.array(ids), caches, taps=use_draft)
            set_lengths(caches, [n + len(c) for n, c in zip(before, chunks)])
            states = [c.state for c in caches]
            for b, (s, c) in enumerate(zip(sessions, chunks)):
                if use_draft and c:
                    _feed_draft(pair, s, taps[b: b + 1, : len(c)], floors[b])
                    states += [d.state for d in s.draft_cache] + [s.pending]
            mx.eval(states)
            del states  # held into the next pass, it would keep buffers a growth replaces
        for s, p in zip(sessions, prompts):
            s.tokens = list(p)
        return caches
    except BaseException:
        for s in sessions:
            s.tokens, s.pending = [], None
        raise


def let_go(pair, session: Session):
    """Empty `session` (its row lives in a batch now, or its prefill failed)."""
    session.target_cache[:] = pair.target.make_cache()
    if session.draft_cache is not None:
        session.draft_cache[:] = pair.draft.make_cache(session.draft_window)
    session.tokens, session.pending = [], None


def join_rows(pair, target_cache: list, draft_cache: list | None, sessions: list[Session],
              target_rows: list | None = None) -> list[tuple[list[int], mx.array | None]]:
    """Append prefilled sessions as rows of a batch's caches (their target rows from
    `target_rows`, the ragged caches `prefill_together` returned, when given), then empty the
    sessions. Returns each one's (tokens, pending taps). On an exception the batch's caches
    keep only their earlier rows and the sessions are as they were, but for the pending taps
    the draft took."""
    before = target_cache[0].batch_size
    try:
        for s in sessions if draft_cache is not None else ():
            # the draft takes the prompt's last taps now, as its first pass would have
            pair.draft.absorb_context(s.pending, s.draft_cache)
            s.pending = None
        for i, batch in enumerate(draft_cache or []):  # a layer at a time
            batch.add(*[s.draft_cache[i] for s in sessions])
            mx.eval(batch.state)
        for i, batch in enumerate(target_cache):
            if target_rows is not None:
                batch.extend(target_rows[i])
                target_rows[i] = None  # its rows now live in the batch's buffer only
            else:
                batch.add(*[s.target_cache[i] for s in sessions])
            mx.eval(batch.state)
    except BaseException:  # half joined: the running rows stay as they were
        for c in target_cache + (draft_cache or []):
            if c.batch_size > before:
                c.filter(list(range(before)))
        raise
    out = []
    for s in sessions:
        out.append((list(s.tokens), s.pending))
        let_go(pair, s)
    return out


def write_back(pair, target_cache: list, draft_cache: list | None, b: int, home: Session,
               tokens: list[int], pending, saved):
    """Row b of a batch's caches, its tokens and pending taps into `home`, as a single
    sequence's run would leave that session (`saved`: the row's prompt checkpoint, for a
    window or recurrent target)."""
    pair.target.refill(home.target_cache, [c.export(b) for c in target_cache],
                       len(tokens) - 1, saved)
    if draft_cache is not None and home.draft_cache is not None:
        home.draft_cache[:] = [c.export(b) for c in draft_cache]
    home.tokens, home.pending = list(tokens), pending
    mx.eval([c.state for c in home.target_cache + (home.draft_cache or [])])
