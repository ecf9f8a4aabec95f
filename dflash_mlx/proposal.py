"""What the target verifies each round: the draft's tokens, the context lookup, the confidence cut.

`SpeculationConfig` holds the policy (frozen, one per generation call); `draft_block` applies it
to one draft pass. The draft network only proposes (`propose`: per-slot argmax or DFlash 2's
selector path); everything here is a deterministic function of that proposal and of the tokens
so far, so the verification, and with it the output distribution, never depends on it.

Context lookup: answers repeat their prompt and themselves: a function's signature, names,
numbers, whole phrases. A DFlash draft predicts each slot from the target's hidden states and
is often unsure past slot 1; where the last few tokens occurred earlier in the conversation,
the tokens that followed them then are often the better guess. `merge` keeps the draft's tokens
up to the first slot where the lookup disagrees and the draft is unsure (or the text is plainly
being copied), and the lookup's from there.

Exactness: the lookup, like the draft, is a deterministic function of the tokens so far, so a
merged block is one more one-hot proposal. Greedy verification and v1's rejection sampling
(which treats every drafted token as proposed with probability 1) stay exact. DFlash 2's
selector samples its own path with a recorded q, so it takes no lookup and no cut.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from types import MappingProxyType
from typing import Mapping

import mlx.core as mx
import numpy as np

from .errors import InvalidArgumentError


# A draft that accepts nothing this many rounds running is not meant for this target: a real pair
# accepts slot 1 in most rounds, so 16 misses in a row almost never happen to one.
FALLBACK_AFTER = 16


@dataclass(frozen=True)
class SpeculationConfig:
    """How to speculate: one value per generation call, the same for every round.

    Args:
        block_size: verify width B: the last token plus B-1 drafted tokens (1: plain AR).
        min_confidence: verify only the leading drafted tokens whose joint draft probability
            reaches this (0: the whole block). Only the cost of a round depends on it.
        lookup: let a continuation found earlier in the context replace the unsure end of a
            v1 draft's block. Exact either way.
        verify_pad: {W: W'}: verify W tokens in a pass of W' rows where the BLAS runs that
            faster (the CPU's measured cost curve); the added rows are never read.
        draft_window: keep at most this many context rows in the draft's cache (None: the
            draft config's own sliding windows only).
        fallback_after: after this many drafting rounds in a row that accept nothing (a draft
            meant for another target), the rest of the answer is plain AR (None: never).
        draft_free: speculate with the context lookup alone, for a pair without a draft model
            (`--draft lookup`): each round verifies what followed the context's last words
            earlier, exact like any proposal.
        tree: verify a best-first tree of this many drafted nodes per round (DDTree; 0: one
            path). v1 drafts on llama / qwen2 / qwen3 targets; elsewhere one path is verified.
            The context lookup joins a tree as one more branch; the confidence cut does not apply.
    """

    block_size: int = 5
    min_confidence: float = 0.0
    lookup: bool = True
    verify_pad: Mapping[int, int] = field(default_factory=dict)
    draft_window: int | None = None
    fallback_after: int | None = None
    draft_free: bool = False
    tree: int = 0

    def __post_init__(self):
        object.__setattr__(self, "verify_pad", MappingProxyType(dict(self.verify_pad)))
        if self.block_size < 1:
            raise InvalidArgumentError(f"block size must be at least 1, got {self.block_size}")
        if not 0 <= self.min_confidence <= 1:
            raise InvalidArgumentError(
                f"min_confidence must be in [0, 1], got {self.min_confidence}")
        if self.draft_window is not None and self.draft_window < 1:
            raise InvalidArgumentError(
                f"--draft-window must be at least 1, got {self.draft_window}")
        if self.fallback_after is not None and self.fallback_after < 1:
            raise InvalidArgumentError(
                f"fallback_after must be at least 1, got {self.fallback_after}")
        if self.tree < 0:
            raise InvalidArgumentError(f"--tree must be at least 0, got {self.tree}")

    @classmethod
    def for_pair(cls, pair, **overrides) -> "SpeculationConfig":
        """This device's defaults for `pair` (`cpu/policy.py`), then `overrides` (None skipped)."""
        from .cpu.policy import auto_min_confidence, on_cpu

        # The lookup and the cut read the draft's tokens on the host between the draft and the
        # verify pass: a sync that leaves a GPU idle every round. They pay on the CPU, where a
        # verified token costs and the host waits anyway; off the CPU both default to off
        # (auto_min_confidence is 0 there), so a round syncs the host once.
        base = cls(min_confidence=auto_min_confidence(pair.draft), lookup=on_cpu(),
                   fallback_after=FALLBACK_AFTER)
        return base.replace(**overrides)

    def replace(self, **overrides) -> "SpeculationConfig":
        """A copy with the given fields changed; None leaves a field as it is."""
        changes = {k: v for k, v in overrides.items() if v is not None}
        return replace(self, **changes) if changes else self

    def width(self, w: int) -> int:
        """The rows a verify pass of `w` tokens runs at (`verify_pad`)."""
        return self.verify_pad.get(w, w)


def draft_block(draft, block_ids: mx.array, context: mx.array | None, cache: list,
                config: SpeculationConfig, tokens: list[int], params=None,
                key: mx.array | None = None) -> tuple[mx.array, mx.array | None, "Hint | None"]:
    """The tokens to verify after `block_ids[0, 0]`, their q (None = one-hot), and the lookup's
    record (None when it did not run).

    `tokens` are the tokens so far, for the lookup. The cut keeps the leading slots while the
    product of their proposal probabilities (the draft's own odds that all of them are
    accepted) reaches `min_confidence`, so the target verifies fewer tokens where the draft is
    unsure: that pays where each verified token costs (the CPU). Slot k adds a token only if
    slots 1..k all hold, so the product, not slot k's own probability, is what its verify cost
    buys.
    """
    v1 = not draft.config.is_dflash2
    lookup = config.lookup and v1
    cut = config.min_confidence if v1 else 0.0
    out, q, confidence = draft.propose(block_ids, context, cache, params=params, key=key,
                                       confidence=lookup or cut > 0)
    if confidence is None:
        return out, q, None
    ids, confidence = out.tolist(), confidence.tolist()
    hint = None
    if lookup:
        hint = Hint(tokens)
        ids, confidence, hint.start = merge(ids, confidence, hint.context)
    keep = joint_keep(confidence, cut) if cut > 0 else len(ids)
    return mx.array(ids[:keep], dtype=mx.int32), None, hint


def slot_candidates(draft, block_ids: mx.array, context: mx.array | None, cache: list,
                    k: int) -> tuple[mx.array, mx.array]:
    """A v1 draft's `k` likeliest tokens per slot 1..L-1 of `block_ids`, best first, and their
    log-probabilities under its proposal head: (L-1, k) each, on the device (a tree's input)."""
    hidden = draft.slot_hidden(block_ids, context, cache)[0]
    logits = draft.proposal_logits(hidden).astype(mx.float32)
    logp = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    k = min(k, logp.shape[-1])
    top = mx.argpartition(-logp, k - 1, axis=-1)[:, :k]
    vals = mx.take_along_axis(logp, top, axis=-1)
    order = mx.argsort(-vals, axis=-1)
    top, vals = mx.take_along_axis(top, order, axis=-1), mx.take_along_axis(vals, order, axis=-1)
    head_ids = draft.head_token_ids()  # a restricted head's rows are these tokens
    return (top if head_ids is None else head_ids[top]).astype(mx.int32), vals


def lookup_block(tokens: list[int], k: int) -> tuple[mx.array, "Hint"]:
    """Draft-free speculation: up to `k` tokens that followed the latest earlier occurrence of
    the context's last words (none: the round is a plain AR step). Deterministic, so exact."""
    found, _ = find(tokens, k)
    hint = Hint(tokens, start=0 if found else None)
    return mx.array(found, dtype=mx.int32), hint


def joint_keep(confidence: list[float], min_confidence: float) -> int:
    """How many leading slots the cut keeps: while their probabilities' product reaches it."""
    keep, joint = 0, 1.0
    for c in confidence:
        joint *= c
        if joint < min_confidence:
            break
        keep += 1
    return keep


# Suffix lengths tried, longest first: a 1-token match is mostly noise (replayed on items 3-7
# of the bundled sets with the demo pair: τ 2.11 with 3-then-2, 2.10 with 3-then-1, flat to 6).
NGRAMS = (3, 2)
# Draft slot probability below which a disagreeing lookup token takes over (replay: 0.5 → τ 2.04,
# 0.7 → 2.11, 0.9 → 2.10; the draft alone 1.75).
UNSURE = 0.7
# Probability a lookup slot counts with in the `--min-confidence` cut: lookup tokens that
# replace an unsure draft slot are right about this often when the slots before them are.
LOOKUP_CONFIDENCE = 0.8
# How far back to search; long chats would otherwise pay a scan of their whole history.
WINDOW = 8192
# A match this long means the answer is copying earlier text: the lookup then overrides even a
# sure draft slot. Replayed at the 0.1 cut (items 9-16 of the bundled sets, 128 tokens; items
# 3-7, 64 tokens): one lookup for the block τ 2.27, 2.10; chained per slot 2.30, 2.12; with
# this override 2.31, 2.14. MATCH_CAP bounds the backward comparison.
COPYING = 8
MATCH_CAP = 64


@dataclass
class Hint:
    """The context the lookup read; `start` says which slot it took over from."""

    context: list[int]
    start: int | None = None  # None: the draft's own block was kept

    def flags(self, n: int) -> list[bool]:
        """Per verified slot (the first `n`: the cut may drop the rest), whether it came from
        the lookup."""
        return [self.start is not None and i >= self.start for i in range(n)]


def find(tokens, k: int, ngrams: tuple[int, ...] = NGRAMS) -> tuple[list[int], int]:
    """Up to `k` tokens that followed the latest earlier occurrence of the longest suffix n-gram
    of `tokens` (list or array; the last WINDOW count), and how many tokens that occurrence
    shares with the end of `tokens` (at most MATCH_CAP)."""
    a = np.asarray(tokens[-WINDOW:], dtype=np.int64)
    n_all = len(a)
    for n in ngrams if k > 0 else ():
        if n_all <= n:
            continue
        starts = n_all - n  # candidate starts 0..starts-1 (the suffix itself excluded)
        hit = np.ones(starts, dtype=bool)
        for j in range(n):
            hit &= a[j:j + starts] == a[n_all - n + j]
        found = np.flatnonzero(hit)
        if len(found):
            s = int(found[-1])
            shared = n
            while shared < MATCH_CAP and s - 1 - (shared - n) >= 0 \
                    and a[s - 1 - (shared - n)] == a[n_all - 1 - shared]:
                shared += 1
            return a[s + n:s + n + k].tolist(), shared
    return [], 0


def merge(drafted: list[int], confidence: list[float], context: list[int],
          unsure: float = UNSURE) -> tuple[list[int], list[float], int | None]:
    """The draft's block, switched to a lookup continuation at the first slot that calls for it.

    Slot by slot, the lookup runs on the context followed by the draft's slots so far, so it
    continues the draft's own block. It takes over at the first slot where it disagrees with the
    draft and either the draft is unsure there or the text is being copied (the match shares at
    least COPYING tokens). Returns (tokens, slot confidences, the slot the lookup took over from
    or None).
    """
    a = np.asarray(context[-WINDOW:], dtype=np.int64)
    for k, (t, c) in enumerate(zip(drafted, confidence)):
        ctx = np.concatenate([a, np.asarray(drafted[:k], dtype=np.int64)]) if k else a
        found, shared = find(ctx, len(drafted) - k)
        if found and found[0] != t and (c < unsure or shared >= COPYING):
            conf = confidence[:k] + [max(c2, LOOKUP_CONFIDENCE)
                                     for c2 in confidence[k:k + len(found)]]
            return drafted[:k] + found, conf, k
    return drafted, confidence, None
