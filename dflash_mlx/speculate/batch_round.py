"""One verify round for a batch of sequences: one draft pass, one target pass, ragged acceptance.

Every row is a sequence with its own tokens, pending taps, sampling settings, keys and verify
width (1: a plain decoding step inside the batch). The draft proposes for all rows at once
(`batch_draft.py`); each row's proposal then goes through the same steps as a single
sequence's `path_round`: the lookup and the confidence cut, the logits processors on each of
its verify rows, greedy acceptance or exact rejection sampling, the stop rule. The target
verifies every row in one pass of the widest row's width (shorter rows are padded; their
padding is never read, and the feed-forward blocks and head skip it: `models/packed.py`).
Then each row keeps exactly what it accepted: its target cache row
ends at its own new length (`RaggedKVCache.set_lengths`, in `finally`, so an exception leaves
every row as it was), its taps wait for the next draft pass. A row with a grammar has its
forbidden drafted tokens cut and its verify rows masked, as in `path_round`. A row whose
grammar or processors raise, or whose logits are not finite, keeps nothing and ends (finish
"error", `Round.error`); the other rows go on exactly.

As in `rounds.py`, the round syncs the host once (the drafted ids, the answers and the logits
guard together) unless the lookup or the cut read the draft's tokens first.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import mlx.core as mx

from ..models.packed import packed
from . import guards
from .batch_cache import set_lengths
from .batch_draft import draft_rows
from .lookup import Hint, lookup_block
from .proposal import greedy_tokens, selector_path, settle_block, tokens_and_confidence
from .rounds import Request, Round, _constrain, _logprobs, _processed
from .sampling import greedy_accept, rejection_sample_device, sampling_probs


@dataclass
class Row:
    """One sequence's part in a batched round; the round updates `tokens` and `pending`."""

    tokens: list[int]  # committed so far; the last one is this round's slot 0
    pending: mx.array | None  # taps (1, n, T) the draft has not absorbed yet
    req: Request
    width: int = 1  # verify width this round (1 + drafted slots at most)
    dkey: mx.array | None = None  # DFlash 2's selector (T > 0)
    vkey: mx.array | None = None  # the rejection sampler (T > 0)


@dataclass
class _Proposal:
    tokens: mx.array  # (n,) int32 on the device
    q: mx.array | None = None  # (n, V) dense proposal, or None for one-hot
    hint: Hint | None = None
    offered: int = 0  # slots drafted before the cut
    allow: mx.array | None = None  # (rows, V) a grammar's allowed tokens per verify row
    grammar_cut: int = 0  # drafted slots the grammar forbids, cut before the verify pass


def _propose(pair, config, rows: list[Row], draft_cache) -> list[_Proposal]:
    """What every row verifies after its last token (nothing for width-1 rows)."""
    none = mx.zeros((0,), mx.int32)
    out = [_Proposal(none) for _ in rows]
    for i, r in enumerate(rows):
        if r.width > 1 and r.req.lookup_only:
            tokens, hint = lookup_block(r.tokens, r.width - 1)
            out[i] = _Proposal(tokens, None, hint, tokens.shape[0])
    drafting = [i for i, r in enumerate(rows) if r.width > 1 and not r.req.lookup_only]
    if not drafting or draft_cache is None:
        return out
    draft = pair.draft
    width = max(rows[i].width for i in drafting)
    mask = draft.config.mask_token_id
    block = mx.array([[r.tokens[-1]] + [mask] * (width - 1) for r in rows])
    # every row absorbs its pending taps (a width-1 row too: it would later anyway)
    hidden = draft_rows(draft, block, [r.pending for r in rows], draft_cache,
                        [r.width > 1 and not r.req.lookup_only for r in rows])[:, 1:]
    for r in rows:
        r.pending = None
    if draft.config.is_dflash2:  # the selector walks each row's own path
        for i in drafting:
            r = rows[i]
            tokens, q = selector_path(draft, hidden[i, : r.width - 1],
                                      mx.array([r.tokens[-1]]), r.req.params, r.dkey)
            out[i] = _Proposal(tokens.astype(mx.int32), q, None, r.width - 1)
        return out
    if config.lookup or config.min_confidence > 0:  # both read the draft's tokens on the host
        ids, confidence = tokens_and_confidence(draft, hidden)
        ids, confidence = ids.tolist(), confidence.tolist()
        for i in drafting:
            n = rows[i].width - 1
            tokens, hint = settle_block(ids[i][:n], confidence[i][:n], config, rows[i].tokens)
            out[i] = _Proposal(tokens, None, hint, n)
        return out
    ids = greedy_tokens(draft, hidden).astype(mx.int32)
    mx.async_eval(ids)  # the target pass is built while the draft runs
    for i in drafting:
        n = rows[i].width - 1
        out[i] = _Proposal(ids[i, :n], None, None, n)
    return out


def _constrain_row(r: Row, p: _Proposal):
    """Cut what the row's grammar forbids from its proposal; its verify rows' masks."""
    n = p.tokens.shape[0]
    p.tokens, p.allow = _constrain(r.req.grammar, p.tokens, p.q)
    p.grammar_cut = n - p.tokens.shape[0]


def _answer(lg: mx.array, drafted: mx.array, q: mx.array | None, r: Row) -> mx.array:
    """The row's target answer: per-slot argmax, or [accepted, next] by rejection sampling."""
    params = r.req.params
    if params.greedy:
        return mx.argmax(lg, axis=-1).astype(mx.int32)
    return rejection_sample_device(drafted, sampling_probs(lg, params), q, r.vkey)


def batch_round(pair, config, rows: list[Row], target_cache: list,
                draft_cache: list | None) -> list[Round]:
    """Draft, verify and commit one round for every row; one `Round` per row, in order."""
    tic = time.perf_counter()
    props = _propose(pair, config, rows, draft_cache)
    draft_s = time.perf_counter() - tic
    tic = time.perf_counter()
    bases = [len(r.tokens) - 1 for r in rows]
    lengths = list(bases)  # what every row keeps if anything below fails
    # a row whose grammar, processors or logits fail ends alone, the others go on
    errors: list[Exception | None] = [None] * len(rows)
    try:
        for b, (r, p) in enumerate(zip(rows, props)):
            if r.req.grammar is not None:
                try:
                    _constrain_row(r, p)
                except Exception as e:
                    errors[b], p.tokens, p.allow = e, p.tokens[:0], None
        widths = [1 + p.tokens.shape[0] for p in props]
        W = max(widths)
        ids = []
        for r, p, w in zip(rows, props, widths):
            last = mx.array([r.tokens[-1]], mx.int32)
            ids.append(mx.concatenate([last, p.tokens, mx.repeat(last, W - w)]))
        with packed(pair.target, widths, W):  # the padding skips the feed-forward work
            logits, taps = pair.target(mx.stack(ids), target_cache,
                                       taps=draft_cache is not None)
        # each row's verify rows, within its grammar and through its own processors (row i
        # after drafted slots 1..i)
        rows_logits = []
        for b, (r, p, w) in enumerate(zip(rows, props, widths)):
            lg = logits[b, :w] if p.allow is None else mx.where(p.allow, logits[b, :w], -mx.inf)
            try:
                lg = _processed(r.req.params, r.tokens,
                                lambda p=p, w=w: [p.tokens[:i] for i in range(w)], lg)
            except Exception as e:
                errors[b] = errors[b] or e
            rows_logits.append(lg)
        answers = [_answer(lg, p.tokens, p.q, r) for lg, p, r in zip(rows_logits, props, rows)]
        finite = mx.stack([guards.logits_ok(lg) for lg in rows_logits]).astype(mx.int32)
        host = mx.concatenate([*(p.tokens for p in props), *answers, finite]).tolist()
        for b, ok in enumerate(host[-len(rows):]):
            if not ok and errors[b] is None:
                errors[b] = guards.logits_error(pair.target_id)
        host = host[: -len(rows)]
        at = sum(w - 1 for w in widths)
        drafted_all, answer_all = host[:at], host[at:]
        out, commits = [], []
        for b, (r, p, w) in enumerate(zip(rows, props, widths)):
            drafted, drafted_all = drafted_all[: w - 1], drafted_all[w - 1:]
            n_ans = w if r.req.params.greedy else 2
            answer, answer_all = answer_all[:n_ans], answer_all[n_ans:]
            if errors[b] is not None:  # it keeps nothing of this round and leaves
                commits.append([])
                out.append(Round([], "error", drafted, 0, p.hint, draft_s, 0.0, error=errors[b]))
                continue
            accepted, nxt = greedy_accept(drafted, answer) if r.req.params.greedy else answer
            new, finish = r.req.stop(drafted[:accepted] + [nxt])
            lps, tops = _logprobs(rows_logits[b], new, r.req.logprobs)
            commits.append(new)
            trimmed = 0 if r.req.lookup_only else max(r.width - 1 - p.offered, 0)
            out.append(Round(new, finish, drafted, accepted, p.hint, draft_s, 0.0,
                             trimmed=trimmed, grammar_cut=p.grammar_cut, logprobs=lps,
                             top_logprobs=tops))
        for b, (r, new) in enumerate(zip(rows, commits)):
            if not new:
                continue
            if r.req.grammar is not None:
                r.req.grammar.advance(new)
            r.tokens.extend(new)
            lengths[b] = bases[b] + len(new)
            if taps is not None:
                t = taps[b: b + 1, : len(new)]
                r.pending = t if r.pending is None else mx.concatenate([r.pending, t], axis=1)
    finally:
        set_lengths(target_cache, lengths)
    verify_s = time.perf_counter() - tic
    for rnd in out:
        rnd.verify_s = verify_s
    return out
