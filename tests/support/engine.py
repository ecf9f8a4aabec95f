"""Shared helpers for the engine tests: tiny pairs, a reference AR decoder, an oracle draft."""

from __future__ import annotations

import random

import mlx.core as mx
from mlx_lm.generate import generate_step

from dflash_mlx import load, tiny
from dflash_mlx.models.dflash import DFlashDraftModel
from dflash_mlx.models.target import Target


# a 4-layer gemma3 target whose layers 0 and 2 keep an 8-row sliding window
GATED = {"model_type": "gemma3_text", "num_hidden_layers": 4, "sliding_window": 8,
         "sliding_window_pattern": 2, "query_pre_attn_scalar": 16,
         "rope_local_base_freq": 10000.0}


def make_draft4(path):
    """A draft for a 4-layer target (`GATED`): it taps layers 1 and 2."""
    return tiny.make_draft(path, tiny.draft_config(
        target_layers=4, dflash_config={"mask_token_id": tiny.MASK_ID,
                                        "target_layer_ids": [1, 2]}))

def float32_pair(target_dir, draft_dir, draft_cls, target_cls=None):
    """A float32 pair whose draft (and target) are test subclasses with the loaded weights."""
    pair = load(target_dir, draft_dir, draft_bits=16, weights="float32")
    draft = draft_cls(pair.draft.config)
    draft.update(pair.draft.parameters())
    if target_cls is not None:
        pair.target = target_cls(pair.target.model, pair.draft.config.target_layer_ids)
    pair.draft = draft.bind(pair.target)
    return pair


def mlx_lm_greedy(model, prompt: list[int], n: int) -> list[int]:
    """Plain mlx-lm greedy decoding: the reference the engine must reproduce."""
    out = []
    for tok, _ in generate_step(mx.array(prompt), model, max_tokens=n,
                                sampler=lambda x: mx.argmax(x, axis=-1)):
        out.append(int(tok))
    return out


class Oracle:
    """What the oracle draft proposes: a reference continuation, sometimes corrupted."""

    def __init__(self, reference: list[int], prompt_len: int, p_wrong: float, seed: int):
        self.reference, self.prompt_len, self.p_wrong = reference, prompt_len, p_wrong
        self.rng = random.Random(seed)


def peaked(ids: list[int], hidden: mx.array, vocab: int) -> mx.array:
    """Proposal logits for `hidden`'s slots whose per-slot argmax is `ids`: 0 there, far below
    elsewhere (the slot's proposal probability is then 1)."""
    logits = mx.where(mx.arange(vocab) == mx.array(ids)[:, None], 0.0, -1e9)
    return logits.reshape(*hidden.shape[:-1], vocab)


class PositionedDraft(DFlashDraftModel):
    """A real draft whose forward notes where the block sits (`pos`: the absolute position of
    block slot 0), for doubles whose proposal head then peaks at chosen tokens."""

    pos = 0

    def __call__(self, block_ids, context, cache):
        hidden = super().__call__(block_ids, context, cache)
        self.pos = cache[0].offset
        return hidden


class OracleDraft(PositionedDraft):
    """A real draft whose proposals are replaced by the oracle's.

    The real forward still runs, so the draft cache bookkeeping is exercised; the proposals
    make every accept pattern (0..B-1) happen, which a random draft never would. The forward
    notes where the block sits; the proposal head then peaks at the oracle's tokens.
    """

    oracle: Oracle | None = None

    def proposal_logits(self, hidden):
        if self.oracle is None:
            return super().proposal_logits(hidden)
        o = self.oracle
        out = []
        for i in range(1, hidden.shape[-2] + 1):
            j = self.pos + i - o.prompt_len
            tok = o.reference[j] if 0 <= j < len(o.reference) else 0
            if o.rng.random() < o.p_wrong:
                tok = o.rng.randrange(self.config.vocab_size)
            out.append(tok)
        return peaked(out, hidden, self.config.vocab_size)


class Recording:
    """Mixin for a Target class: keeps the logits of every pass (the greedy invariant is
    checked against them)."""

    def __init__(self, model, tap_ids=None):
        super().__init__(model, tap_ids)
        self.passes: list[mx.array] = []

    def __call__(self, ids, cache, taps=True):
        logits, t = super().__call__(ids, cache, taps)
        self.passes.append(logits[0])
        return logits, t


class RecordingTarget(Recording, Target):
    pass


def cache_arrays(cache: list, length: int) -> list[tuple[mx.array, mx.array]]:
    return [(c.keys[..., :length, :], c.values[..., :length, :]) for c in cache]
