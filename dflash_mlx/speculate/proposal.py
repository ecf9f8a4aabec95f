"""What the target verifies each round: the draft's tokens, the context lookup, the confidence cut.

The draft is a network (layers, `__call__`, `proposal_logits`); what it proposes is decided here.
`propose` drafts one block (per-slot argmax, or DFlash 2's selector path) and `draft_block`
applies a `SpeculationConfig` to it: everything after the proposal is a deterministic function
of it and of the tokens so far, so the verification, and with it the output distribution, never
depends on it. Greedy verification and v1's rejection sampling (which treats
every drafted token as proposed with probability 1) stay exact. DFlash 2's selector samples its
own path with a recorded q, so it takes no lookup and no cut.
"""

from __future__ import annotations

import mlx.core as mx

from .config import SpeculationConfig
from .lookup import Hint, merge


def propose(draft, block_ids: mx.array, context: mx.array | None, cache: list, params=None,
            key: mx.array | None = None, confidence: bool = False,
            ) -> tuple[mx.array, mx.array | None, mx.array | None]:
    """Draft tokens for slots 1..L-1, their proposal distribution (None = one-hot) and,
    with `confidence`, each slot's proposal probability (else None).

    The block is drafted at the trained width (`slot_hidden`) and cut back to L-1 slots.
    v1 drafts propose the per-slot argmax: the slots are independent marginals, so
    sampling them would give an incoherent block; a one-hot q keeps the sampler exact.
    `params` (SamplingParams) and `key` are for DFlash 2's selector (`selector_propose`);
    v1 ignores them. What to verify of this (the cut, the context lookup) is `draft_block`'s
    business.
    """
    if draft.config.is_dflash2:
        return selector_propose(draft, block_ids, context, cache, params, key)
    hidden = slot_hidden(draft, block_ids, context, cache)
    if not confidence:
        return greedy_tokens(draft, hidden)[0], None, None
    ids, probs = tokens_and_confidence(draft, hidden[0])
    return ids, None, probs


def selector_propose(draft, block_ids: mx.array, context: mx.array | None, cache: list,
                     params=None, key: mx.array | None = None,
                     ) -> tuple[mx.array, mx.array | None, None]:
    """A DFlash 2 draft's selector path for slots 1..γ, and its q scattered to dense (γ, V)
    rows at T>0.

    The selector walks one joint path with a recorded q, so it has no per-slot confidence
    (the third value is always None) and takes neither the cut nor the lookup.

    The dense rows hold the K candidate probabilities at their ids and 0 elsewhere, so
    `sample_utils.rejection_sample` accepts iff u·q(d) < p(d) and draws the next token from
    max(p − q, 0) renormalised — p minus q on the candidate ids.
    """
    hidden = draft(block_ids, context, cache)[0, 1:]
    tokens, q = selector_path(draft, hidden, block_ids[0, :1], params, key)
    return tokens, q, None


def selector_path(draft, hidden: mx.array, anchor: mx.array, params=None,
                  key: mx.array | None = None) -> tuple[mx.array, mx.array | None]:
    """The selector's path (γ,) from `anchor` (1,) over slot hidden states `hidden` (γ, H), and
    its dense q (γ, V) at T>0 (None when greedy): `selector_propose` after the draft pass."""
    temperature = 0.0 if params is None else params.temperature
    selector = draft.candidate_selector
    cand, unary, succ = selector.candidates(hidden, draft.logits(hidden))
    tokens, q = selector.walk(anchor, cand, unary, succ, temperature, key)
    if q is None:
        return tokens[0], None
    dense = mx.zeros((cand.shape[0], draft.config.vocab_size), dtype=mx.float32)
    return tokens[0], mx.put_along_axis(dense, cand, q[0], axis=-1)


def slot_hidden(draft, block_ids: mx.array, context: mx.array | None, cache: list) -> mx.array:
    """Hidden states of slots 1..L-1 of `block_ids`, drafted at the trained width."""
    return draft(full_block(draft, block_ids), context, cache)[:, 1: block_ids.shape[1]]


def full_block(draft, block_ids: mx.array) -> mx.array:
    """`block_ids` padded with MASK to the trained block size.

    Every slot attends to the whole block, and training only ever showed blocks of the
    trained width: a narrower block shifts what each slot sees. Drafting at full width and
    keeping the leading slots proposes better (block 5 on the demo pair: τ +0.05), and the
    extra slots cost only draft compute: block K/V are never cached.
    """
    pad = draft.config.block_size - block_ids.shape[1]
    if pad <= 0:
        return block_ids
    masks = mx.full((block_ids.shape[0], pad), draft.config.mask_token_id, block_ids.dtype)
    return mx.concatenate([block_ids, masks], axis=1)


def tokens_and_confidence(draft, hidden: mx.array) -> tuple[mx.array, mx.array]:
    """Per-slot argmax ids and the proposal probability of each."""
    logits = draft.proposal_logits(hidden).astype(mx.float32)
    best = mx.argmax(logits, axis=-1)
    confidence = mx.exp(mx.max(logits, axis=-1) - mx.logsumexp(logits, axis=-1))
    head_ids = draft.head_token_ids()  # a restricted head's rows are these tokens
    return (best if head_ids is None else head_ids[best]), confidence


def greedy_tokens(draft, hidden: mx.array) -> mx.array:
    """Per-slot argmax ids, through the restricted head when one is set."""
    best = mx.argmax(draft.proposal_logits(hidden), axis=-1)
    head_ids = draft.head_token_ids()
    return best if head_ids is None else head_ids[best]


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
    out, q, confidence = propose(draft, block_ids, context, cache, params=params, key=key,
                                 confidence=lookup or cut > 0)
    if confidence is None:
        return out, q, None
    ids, hint = settle_block(out.tolist(), confidence.tolist(), config, tokens)
    return ids, None, hint


def settle_block(ids: list[int], confidence: list[float], config: SpeculationConfig,
                 tokens: list[int]) -> tuple[mx.array, "Hint | None"]:
    """A v1 draft's per-slot ids and confidences through the lookup and the cut (`draft_block`
    after the draft pass): the ids to verify and the lookup's record (None: it did not run)."""
    hint = None
    if config.lookup:
        hint = Hint(tokens)
        ids, confidence, hint.start = merge(ids, confidence, hint.context)
    cut = config.min_confidence
    keep = joint_keep(confidence, cut) if cut > 0 else len(ids)
    return mx.array(ids[:keep], dtype=mx.int32), hint


def slot_candidates(draft, block_ids: mx.array, context: mx.array | None, cache: list,
                    k: int) -> tuple[mx.array, mx.array]:
    """A v1 draft's `k` likeliest tokens per slot 1..L-1 of `block_ids`, best first, and their
    log-probabilities under its proposal head: (L-1, k) each, on the device (a tree's input)."""
    hidden = slot_hidden(draft, block_ids, context, cache)[0]
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
