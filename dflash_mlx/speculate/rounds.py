"""One verify round: a path round (the draft's block, or the lookup's) or a tree round (DDTree).

Both draft, run one target pass and commit through `_verify`, which keeps the invariant of
generate.py: after a round, and after an exception or interrupt at any point, the target cache
holds exactly `session.tokens[:-1]` and the draft cache plus `session.pending` cover the same
positions. A round syncs the host once: the drafted ids, the target's answer and the logits
guard come back together.

A tree pass appends every tree row to the cache; the walk accepts one path; `keep_rows` moves
that path's K/V right after the context and the `finally` trims the rest, so the cache is what
a prefill of the emitted tokens gives. Only the accepted path's taps reach the draft.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable

import mlx.core as mx

from ..models.tree import keep_rows, tree_forward, unsupported
from . import guards
from .lookup import Hint, find, lookup_block
from .grammar import Grammar
from .processors import process_rows
from .proposal import draft_block, slot_candidates
from .sampling import SamplingParams, greedy_accept, rejection_sample_device, sampling_probs
from .tree import build_tree, graft, walk

Stop = Callable[[list[int]], tuple[list[int], str | None]]


@dataclass
class Request:
    """What one generation call asks of every round.

    Args:
        params: how to choose tokens (sampling, processors).
        stop: cuts emitted tokens at EOS or max_tokens: (kept, finish reason).
        lookup_only: draft-free speculation (the context lookup proposes).
        logprobs: report the emitted tokens' log-probabilities and this many alternatives
            each (None: none).
        grammar: the call's structured-output matcher (`grammar.py`), or None.
    """

    params: SamplingParams
    stop: Stop
    lookup_only: bool = False
    logprobs: int | None = None
    grammar: Grammar | None = None


@dataclass
class Round:
    """What one round did (generate.py turns it into a BlockEvent)."""

    tokens: list[int]  # committed (cut at EOS / max_tokens)
    finish: str | None
    drafted: list[int]  # verified drafted ids (a tree: the accepted path and its best children)
    accepted: int
    hint: Hint | None  # which drafted slots the context lookup supplied
    draft_s: float
    verify_s: float
    trimmed: int = 0  # drafted slots cut before verification for low draft confidence
    grammar_cut: int = 0  # drafted slots cut before verification: the grammar forbids them
    nodes: int = 0  # a tree round: nodes verified besides the root
    branch: int = 0  # ... accepted tokens off the draft's argmax path
    logprobs: list[float] | None = None  # per emitted token, when asked (`_logprobs`)
    top_logprobs: list[list[tuple[int, float]]] | None = None
    error: Exception | None = None  # a batched row's own failure (finish "error"; nothing kept)


def _sync(pair, logits: mx.array, answer: mx.array, *head: mx.array) -> list[int]:
    """The round's one host sync: `head` (e.g. the drafted ids), then the target's answer, with
    the logits guard evaluated alongside (a broken checkpoint fails loud, not silent)."""
    finite = guards.logits_ok(logits).astype(mx.int32)[None]
    host = mx.concatenate([*head, answer, finite]).tolist()
    guards.check_logits(host.pop(), pair.target_id)
    return host


def _processed(params: SamplingParams, history: list[int],
               paths: Callable[[], list[mx.array]], logits: mx.array) -> mx.array:
    """`logits` rows through the request's processors, row r after `paths()[r]` (none: as is)."""
    if not params.processors:
        return logits
    return process_rows(params.processors, history, params.processing.context, paths(), logits)


def _logprobs(logits: mx.array, new: list[int], top: int | None):
    """Log-probabilities of the emitted tokens (row j emitted new[j]) and, with `top` > 0,
    each row's `top` likeliest tokens: after the processors, before temperature and the
    filters, as mlx-lm reports them. None, None when not asked."""
    if top is None:
        return None, None
    lp = logits[: len(new)].astype(mx.float32)
    lp = lp - mx.logsumexp(lp, axis=-1, keepdims=True)
    chosen = lp[mx.arange(len(new)), mx.array(new)]
    if not top:
        return chosen.tolist(), None
    k = min(top, lp.shape[-1])
    ids = mx.argpartition(-lp, k - 1, axis=-1)[:, :k]
    vals = mx.take_along_axis(lp, ids, axis=-1)
    order = mx.argsort(-vals, axis=-1)
    ids, vals = mx.take_along_axis(ids, order, axis=-1), mx.take_along_axis(vals, order, axis=-1)
    chosen, ids, vals = chosen.tolist(), ids.tolist(), vals.tolist()
    return chosen, [list(zip(i, v)) for i, v in zip(ids, vals)]


def _verify(pair, session, run: Callable[[], tuple]) -> tuple:
    """Run one target pass and commit what it accepts.

    `run()` returns (new tokens, taps of their rows or None, *extra); the tokens join
    `session.tokens`, the taps `session.pending`. Whatever happens, the `finally` drops the
    cache rows past what was committed: rejected drafts, the rest of a tree, a half-done pass.
    """
    base = len(session.tokens) - 1  # target cache length before this round
    committed = base  # grows only on success
    try:
        new, taps, *extra = run()
        session.tokens.extend(new)
        committed = base + len(new)
        if taps is not None:
            session.pending = (taps if session.pending is None
                               else mx.concatenate([session.pending, taps], axis=1))
    finally:
        pair.target.truncate(session.target_cache, committed)
    return (new, *extra)


def _rolled_back(session, propose: Callable[[], tuple]) -> tuple:
    """`propose()` against the draft cache, which absorbs the pending taps; if it fails the
    cache is cut back (the pending taps stay pending)."""
    draft_len = session.draft_cache[0].offset
    try:
        out = propose()
        session.pending = None
        return out
    except BaseException:
        for c in session.draft_cache:
            if c.offset > draft_len:
                c.trim(c.offset - draft_len)
        raise


def path_round(pair, session, config, width: int, req: Request,
               keys: tuple[mx.array | None, mx.array | None]) -> Round:
    """Verify one path of up to `width - 1` drafted tokens (width 1: a plain AR step).

    `keys` (None when greedy): DFlash 2's selector's, and the rejection sampler's.
    """
    params, grammar = req.params, req.grammar
    last = session.tokens[-1]
    dkey, vkey = keys
    tic = time.perf_counter()
    tokens, q, hint = mx.zeros((0,), mx.int32), None, None
    if width > 1 and req.lookup_only:
        tokens, hint = lookup_block(session.tokens, width - 1)
    elif width > 1:
        block = mx.array([[last] + [pair.draft.config.mask_token_id] * (width - 1)])
        tokens, q, hint = _rolled_back(session, lambda: draft_block(
            pair.draft, block, session.pending, session.draft_cache, config, session.tokens,
            params=params, key=dkey))
        tokens = tokens.astype(mx.int32)
        # the drafted ids stay on the device: on a GPU the draft runs while the verify pass is
        # built. Without the lookup or the cut nothing waits for it here, so draft_s is only
        # its launch and verify_s holds the rest of the round.
        mx.async_eval(tokens)
    n_drafted, allow = tokens.shape[0], None
    if grammar is not None:
        tokens, allow = _constrain(grammar, tokens, q)
    draft_s = time.perf_counter() - tic

    def run():
        n = tokens.shape[0]
        w = n + 1
        # rows past the block only pad the pass to a width the BLAS runs faster; their logits
        # are never read and `_verify` drops their cache entries
        pad = config.width(w) - w
        ids = mx.concatenate([mx.array([last], mx.int32), tokens, mx.full((pad,), last, mx.int32)])
        # taps whenever a draft shares this session, so an AR turn keeps its context
        logits, taps = pair.target(ids[None], session.target_cache,
                                   taps=session.draft_cache is not None)
        logits = logits[0, :w] if allow is None else mx.where(allow, logits[0, :w], -mx.inf)
        # row i follows drafted slots 1..i: the processors see exactly that prefix
        logits = _processed(params, session.tokens, lambda: [tokens[:i] for i in range(w)],
                            logits)
        if params.greedy:
            answer = mx.argmax(logits, axis=-1).astype(mx.int32)
        else:
            answer = rejection_sample_device(tokens, sampling_probs(logits, params), q, vkey)
        host = _sync(pair, logits, answer, tokens)
        drafted, answer = host[:n], host[n:]
        accepted, nxt = greedy_accept(drafted, answer) if params.greedy else answer
        new, finish = req.stop(drafted[:accepted] + [nxt])
        lps = _logprobs(logits, new, req.logprobs)
        if grammar is not None:
            grammar.advance(new)
        # a width-1 round drafts nothing, so earlier pending rows may still wait
        return new, None if taps is None else taps[:, : len(new)], finish, drafted, accepted, lps

    tic = time.perf_counter()
    new, finish, drafted, accepted, (lps, tops) = _verify(pair, session, run)
    # slots cut for low confidence (a lookup with nothing to offer cuts none)
    trimmed = 0 if req.lookup_only else max(width - 1 - n_drafted, 0)
    return Round(new, finish, drafted, accepted, hint, draft_s, time.perf_counter() - tic,
                 trimmed=trimmed, grammar_cut=n_drafted - len(drafted), logprobs=lps,
                 top_logprobs=tops)


def _constrain(grammar: Grammar, tokens: mx.array, q: mx.array | None):
    """The drafted tokens to verify and each verify row's allowed tokens.

    A one-hot proposal (v1, the lookup) is cut at its first forbidden token: it could never
    be accepted, and the bonus after a one-hot rejection is drawn from p anyway. A sampled
    proposal (DFlash 2 at T > 0) is kept whole: its residual max(p - q, 0) needs the drafted
    slot, and a forbidden slot is rejected by the masked p alone; rows past it are never read.
    """
    drafted = tokens.tolist()
    keep = grammar.allowed(drafted)
    if q is None:
        drafted, tokens = drafted[:keep], tokens[:keep]
    allow = grammar.masks(drafted[:keep])
    if allow.shape[0] < len(drafted) + 1:
        rest = mx.ones((len(drafted) + 1 - allow.shape[0], allow.shape[1]), dtype=mx.bool_)
        allow = mx.concatenate([allow, rest])
    return tokens, allow


def tree_budget(pair, config, lookup_only: bool,
                constrained: bool = False) -> tuple[int, str | None]:
    """(nodes per round, a one-line note when a tree was asked for but one path runs)."""
    if not config.tree or config.block_size == 1:
        return 0, None
    # a grammar masks one path's rows; a tree's would need a matcher walk per branch
    reason = "with structured output" if constrained else tree_unavailable(pair, lookup_only)
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


def target_tokens(logits: mx.array, params: SamplingParams, key: mx.array | None) -> mx.array:
    """Per tree row, the target's token after its path: the argmax, or one draw from the
    target's distribution (temperature, top-p, top-k).

    The draws are independent and the walk reads one row per depth, so every emitted token is
    a fresh sample given the tokens before it: no proposal probability enters, because every
    tree is a deterministic proposal.
    """
    if params.greedy:
        return mx.argmax(logits, axis=-1).astype(mx.int32)
    return mx.random.categorical(mx.log(sampling_probs(logits, params)), key=key).astype(mx.int32)


def tree_round(pair, session, config, width: int, req: Request, key: mx.array | None) -> Round:
    """Draft, verify and commit one tree of `config.tree` nodes and depth `width - 1`; with
    `config.lookup`, the context lookup's continuation joins it as one more branch."""
    budget = config.tree
    last = session.tokens[-1]
    base = len(session.tokens) - 1
    tic = time.perf_counter()
    block = mx.array([[last] + [pair.draft.config.mask_token_id] * (width - 1)])
    ids, logp = _rolled_back(session, lambda: [a.tolist() for a in slot_candidates(
        pair.draft, block, session.pending, session.draft_cache, budget)])  # built on the host
    tree = build_tree(last, ids, logp, budget)
    if config.lookup:  # deterministic too: one more proposal, verified like the draft's
        tree = graft(tree, find(session.tokens, width - 1)[0])
    draft_s = time.perf_counter() - tic

    def run():
        logits, taps = tree_forward(pair.target, tree.tokens, tree.depths, tree.visible(),
                                    session.target_cache)
        logits = _processed(req.params, session.tokens, tree.paths, logits[0])
        path, bonus = walk(tree, _sync(pair, logits, target_tokens(logits, req.params, key)))
        new, finish = req.stop([tree.tokens[r] for r in path[1:]] + [bonus])
        rows = mx.array(path[: len(new)], dtype=mx.int32)  # the root and accepted nodes
        keep_rows(session.target_cache, base, path[: len(new)])
        return new, taps[:, rows], finish, path, _logprobs(logits[rows], new, req.logprobs)

    tic = time.perf_counter()
    new, finish, path, (lps, tops) = _verify(pair, session, run)
    rows = path[1:] + tree.best_continuation(path[-1])
    # grafted rows only have grafted children: on the path they are a suffix
    grafted = [i for i, r in enumerate(rows) if tree.ranks[r] < 0]
    hint = Hint(session.tokens, grafted[0] if grafted else None) if config.lookup else None
    return Round(new, finish, [tree.tokens[r] for r in rows], len(path) - 1, hint, draft_s,
                 time.perf_counter() - tic, nodes=len(tree) - 1,
                 branch=tree.off_main(path[1: len(new)]), logprobs=lps, top_logprobs=tops)
