"""What the target verifies each round: the draft's tokens, the context lookup, the confidence cut.

`draft_block` applies a `SpeculationConfig` to one draft pass. The draft network only proposes
(`propose`: per-slot argmax or DFlash 2's selector path); everything here is a deterministic
function of that proposal and of the tokens so far, so the verification, and with it the output
distribution, never depends on it. Greedy verification and v1's rejection sampling (which treats
every drafted token as proposed with probability 1) stay exact. DFlash 2's selector samples its
own path with a recorded q, so it takes no lookup and no cut.
"""

from __future__ import annotations

import mlx.core as mx

from .config import SpeculationConfig
from .lookup import Hint, merge


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


def joint_keep(confidence: list[float], min_confidence: float) -> int:
    """How many leading slots the cut keeps: while their probabilities' product reaches it."""
    keep, joint = 0, 1.0
    for c in confidence:
        joint *= c
        if joint < min_confidence:
            break
        keep += 1
    return keep
