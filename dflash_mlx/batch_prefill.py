"""Prefill several fresh prompts in shared target passes (sequences joining a batch together).

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
from mlx_lm.models.cache import KVCache

from .generate import Session, _feed_draft, prefill_step
from .speculate.batch_cache import RaggedKVCache, set_lengths

MIN_CHUNK = 32  # columns per row and pass, however many rows


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
    passes, but for the target's cache: returns it, one `RaggedKVCache` per layer whose row b
    is what `prefill` leaves in session b's. On an exception the sessions are left empty."""
    caches = [RaggedKVCache() for _ in pair.target.cache_types]
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
            before = caches[0].lengths()
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
