"""One tree round (DDTree): one draft pass, a best-first tree, one target pass, the walk.

`stream_generate` runs this instead of the single-path round when `SpeculationConfig.tree` is
set and the pair supports it (`tree_budget`). The round keeps generate.py's invariant: after it,
and after an exception or interrupt at any point, the target cache holds exactly
`session.tokens[:-1]` and the draft cache plus `session.pending` cover the same positions.

The target pass appends every tree row to the cache; the walk accepts one path; `keep_rows`
moves that path's K/V right after the context and the `finally` trims the rest, so the cache
is what a prefill of the emitted tokens gives. Only the accepted path's taps reach the draft.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable

import mlx.core as mx

from . import guards
from .models.tree import keep_rows, tree_forward, unsupported
from .proposal import Hint, find, slot_candidates
from .sample_utils import SamplingParams, sampling_probs
from .tree import build_tree, graft, walk


@dataclass
class TreeRound:
    """What one tree round did (generate.py turns it into a BlockEvent)."""

    tokens: list[int]  # committed (cut at EOS / max_tokens)
    finish: str | None
    drafted: list[int]  # the accepted path, continued along the tree's best children
    accepted: int
    hint: Hint | None  # which drafted slots the context lookup's branch supplied
    nodes: int  # tree nodes verified besides the root
    branch: int  # accepted tokens off the draft's argmax path
    draft_s: float
    verify_s: float


def tree_budget(pair, config, lookup_only: bool) -> tuple[int, str | None]:
    """(nodes per round, a one-line note when a tree was asked for but one path runs)."""
    if not config.tree or config.block_size == 1:
        return 0, None
    reason = tree_unavailable(pair, lookup_only)
    if reason is None:
        return config.tree, None
    return 0, f"--tree is not available {reason}; verifying one path per round"


def tree_unavailable(pair, lookup_only: bool = False) -> str | None:
    """Why `pair` verifies one path only, as the end of a sentence (None: trees work)."""
    if lookup_only or pair.draft is None:
        return "without a draft model"
    if pair.draft.config.is_dflash2:
        return "with a DFlash 2 draft (it selects its own path)"
    why = unsupported(pair.target)
    return None if why is None else f"for {why}"


def target_tokens(logits: mx.array, params: SamplingParams, key: mx.array) -> mx.array:
    """Per tree row, the target's token after its path: the argmax, or one draw from the
    target's distribution (temperature, top-p, top-k).

    The draws are independent and the walk reads one row per depth, so every emitted token is
    a fresh sample given the tokens before it: no proposal probability enters, because every
    tree is a deterministic proposal.
    """
    if params.greedy:
        return mx.argmax(logits, axis=-1).astype(mx.int32)
    return mx.random.categorical(mx.log(sampling_probs(logits, params)), key=key).astype(mx.int32)


def tree_round(pair, session, config, width: int, params: SamplingParams, key: mx.array,
               stop: Callable[[list[int]], tuple[list[int], str | None]]) -> TreeRound:
    """Draft, verify and commit one tree of `config.tree` nodes and depth `width - 1`; with
    `config.lookup`, the context lookup's continuation joins it as one more branch.

    `stop(tokens)` cuts the emitted tokens at EOS or max_tokens: (kept, finish reason).
    """
    budget = config.tree
    last = session.tokens[-1]
    base = len(session.tokens) - 1  # target cache length before this round
    tic = time.perf_counter()
    draft_len = session.draft_cache[0].offset
    block = mx.array([[last] + [pair.draft.config.mask_token_id] * (width - 1)])
    try:
        ids, logp = slot_candidates(pair.draft, block, session.pending, session.draft_cache,
                                    budget)
        ids, logp = ids.tolist(), logp.tolist()  # the tree is built on the host
        session.pending = None
    except BaseException:
        for c in session.draft_cache:  # the draft absorbed nothing after all
            if c.offset > draft_len:
                c.trim(c.offset - draft_len)
        raise
    tree = build_tree(last, ids, logp, budget)
    if config.lookup:  # deterministic too: one more proposal, verified like the draft's
        tree = graft(tree, find(session.tokens, width - 1)[0])
    draft_s = time.perf_counter() - tic

    tic = time.perf_counter()
    committed = base  # what the target cache may keep; grows only on success
    try:
        logits, taps = tree_forward(pair.target, tree.tokens, tree.depths, tree.visible(),
                                    session.target_cache)
        logits = logits[0]
        finite = guards.logits_ok(logits)
        answer = target_tokens(logits, params, key)
        host = mx.concatenate([answer, finite.astype(mx.int32)[None]]).tolist()
        guards.check_logits(host.pop(), pair.target_id)
        path, bonus = walk(tree, host)
        new, finish = stop([tree.tokens[r] for r in path[1:]] + [bonus])
        rows = path[: len(new)]  # the root and the accepted nodes that stay cached
        keep_rows(session.target_cache, base, rows)
        session.tokens.extend(new)
        committed = base + len(new)
        kept = taps[:, mx.array(rows, dtype=mx.int32)]
        session.pending = (kept if session.pending is None
                           else mx.concatenate([session.pending, kept], axis=1))
    finally:
        # rows past `committed` hold the rest of the tree (or a half-done pass): drop them
        pair.target.truncate(session.target_cache, committed)
    rows = path[1:] + tree.best_continuation(path[-1])
    # grafted rows only have grafted children: on the path they are a suffix
    grafted = [i for i, r in enumerate(rows) if tree.ranks[r] < 0]
    hint = Hint(session.tokens, grafted[0] if grafted else None) if config.lookup else None
    return TreeRound(
        tokens=new, finish=finish, drafted=[tree.tokens[r] for r in rows],
        accepted=len(path) - 1, hint=hint,
        nodes=len(tree) - 1, branch=tree.off_main(path[1: len(new)]),
        draft_s=draft_s, verify_s=time.perf_counter() - tic,
    )
