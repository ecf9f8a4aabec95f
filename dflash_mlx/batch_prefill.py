"""Prefill several fresh prompts in shared target passes (sequences joining a batch together).

One prompt at a time, a batch of N new requests pays N prefill passes whose rows are few; on
a CPU (or a GPU) a pass of N prompts' rows costs much less than N passes. Here the prompts go
through the target together, a chunk of `prefill_step()` columns per pass: every row writes its
chunk at its own end of a temporary ragged cache (a shorter chunk is padded by repeating its
last token, and the padding is cut off right after, as a verify round's is), so each row ends
holding exactly its own prompt at the positions a single prefill gives it. Each prompt's taps
feed its own draft cache as `generate.prefill` feeds them, then every row is exported into its
session: the sessions are what one prefill each would have left, and join the batch as usual.
"""

from __future__ import annotations

import mlx.core as mx
from mlx_lm.models.cache import KVCache

from .generate import Session, _feed_draft, prefill_step
from .speculate.batch_cache import RaggedKVCache, set_lengths


def prefill_together(pair, sessions: list[Session], prompts: list[list[int]]) -> None:
    """Bring each fresh (empty) session to its prompt, as `generate.prefill` does, in shared
    passes. On an exception the sessions are left empty."""
    caches = [RaggedKVCache() for _ in pair.target.cache_types]
    for _ in prompts:  # one empty row each
        for c in caches:
            c.add(KVCache())
    bodies = [p[:-1] for p in prompts]  # the last token is the first round's slot 0
    use_draft = all(s.draft_cache is not None for s in sessions)
    floors = [None] * len(prompts)
    if use_draft:
        limit = pair.draft.context_rows_needed(sessions[0].draft_window)
        floors = [None if limit is None else len(b) - limit for b in bodies]
    step = prefill_step()
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
        for b, (s, p) in enumerate(zip(sessions, prompts)):
            s.target_cache[:] = [c.export(b) for c in caches]
            s.tokens = list(p)
    except BaseException:
        for s in sessions:
            s.tokens, s.pending = [], None
        raise
