"""Context lookup: a deterministic proposal from earlier text.

Answers repeat their prompt and themselves: a function's signature, names, numbers, whole
phrases. A DFlash draft predicts each slot from the target's hidden states and is often unsure
past slot 1; where the last few tokens occurred earlier in the conversation, the tokens that
followed them then are often the better guess. `merge` keeps the draft's tokens up to the first
slot where the lookup disagrees and the draft is unsure (or the text is plainly being copied),
and the lookup's from there.

Exactness: the lookup, like the draft, is a deterministic function of the tokens so far, so a
merged block is one more one-hot proposal.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx
import numpy as np


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


class Cue:
    """Whether the lookup has just been right: it predicted the last token before that token was
    decoded, and it proposes a continuation now. Free news, for a sequence decoding plainly, that
    a speculative round may pay (on the held-out answers such a round commits 2.9 tokens against
    1.75 elsewhere: docs/measurements.md, 2026-12-07 night). Call it each round with the
    tokens so far (again with as many tokens: the same answer, nothing searched); a round that
    committed more than one token resets it."""

    def __init__(self):
        self._at, self._guess, self._cued = -1, None, False

    def __call__(self, tokens: list[int]) -> bool:
        if len(tokens) != self._at:
            right = len(tokens) == self._at + 1 and tokens[-1] == self._guess
            found, _ = find(tokens, 1)
            self._at, self._guess = len(tokens), (found[0] if found else None)
            self._cued = right and self._guess is not None
        return self._cued

    @property
    def guessing(self) -> bool:
        """Whether the lookup guessed the token after those of the last call (so the round
        after that token may be cued)."""
        return self._guess is not None


def lookup_block(tokens: list[int], k: int) -> tuple[mx.array, "Hint"]:
    """Draft-free speculation: up to `k` tokens that followed the latest earlier occurrence of
    the context's last words (none: the round is a plain AR step). Deterministic, so exact."""
    found, _ = find(tokens, k)
    hint = Hint(tokens, start=0 if found else None)
    return mx.array(found, dtype=mx.int32), hint
