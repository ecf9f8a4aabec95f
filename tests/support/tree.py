"""Helpers for the tree tests: draft stand-ins whose slot distributions the test controls."""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from dflash_mlx.models.dflash import DFlashDraftModel
from dflash_mlx.speculate.tree import Tree


def paths(tree: Tree) -> list[tuple[int, ...]]:
    """Per node, its tokens from the root (root excluded)."""
    out = []
    for row in range(1, len(tree)):
        path, r = [], row
        while r > 0:
            path.append(tree.tokens[r])
            r = tree.parents[r]
        out.append(tuple(reversed(path)))
    return out


class TreeOracle:
    """Per-slot draft distributions around a reference continuation: the reference token sits
    at a random rank (or is missing) among random distractors."""

    def __init__(self, reference: list[int], prompt_len: int, rank_p: list[float], seed: int):
        self.reference, self.prompt_len, self.rank_p = reference, prompt_len, rank_p
        self.rng = np.random.default_rng(seed)
        self.pos = 0  # absolute position of the block's slot 0 (set by the draft)

    def logits(self, slots: int, vocab: int) -> np.ndarray:
        out = 2.0 * self.rng.normal(size=(slots, vocab)).astype(np.float32)
        for i, row in enumerate(out):
            j = self.pos + i + 1 - self.prompt_len
            if not 0 <= j < len(self.reference):
                continue
            ref = self.reference[j]
            row[ref] = -np.inf
            rank = self.rng.choice(len(self.rank_p), p=self.rank_p)  # the last: missing
            if rank < len(self.rank_p) - 1:
                top = np.sort(row)[::-1]
                row[ref] = top[0] + 1 if rank == 0 else (top[rank - 1] + top[rank]) / 2
        return out


class TreeOracleDraft(DFlashDraftModel):
    """A real draft (forward and cache bookkeeping run) whose slot distributions are the
    oracle's."""

    oracle: TreeOracle | None = None

    def __call__(self, block_ids, context, cache):
        hidden = super().__call__(block_ids, context, cache)
        if self.oracle is not None:
            self.oracle.pos = cache[0].offset
        return hidden

    def proposal_logits(self, hidden):
        if self.oracle is None:
            return super().proposal_logits(hidden)
        logits = self.oracle.logits(hidden.shape[-2], self.config.vocab_size)
        return mx.array(logits).reshape(*hidden.shape[:-1], -1)


RANKS = {  # P(reference at rank 0, 1, 2, 3, missing)
    "sure": [1.0, 0, 0, 0, 0],
    "mixed": [0.5, 0.2, 0.1, 0.1, 0.1],
    "flat": [0.2, 0.2, 0.2, 0.2, 0.2],
    "second": [0, 1.0, 0, 0, 0],
    "never": [0, 0, 0, 0, 1.0],
}


class FixedSlots:
    def __init__(self, logits: np.ndarray):
        self.logits = logits


class FixedTreeDraft(DFlashDraftModel):
    """A real draft whose slot distributions are fixed logits."""

    slots: FixedSlots | None = None

    def proposal_logits(self, hidden):
        if self.slots is None:
            return super().proposal_logits(hidden)
        return mx.array(self.slots.logits[: hidden.shape[-2]]).reshape(*hidden.shape[:-1], -1)
