"""A real draft whose proposals are each batch row's oracle's (ragged acceptance on demand)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import mlx.core as mx

from dflash_mlx import tiny
from dflash_mlx.models.dflash import DFlashDraftModel

if TYPE_CHECKING:
    from dflash_mlx.batch import Batch
    from support.engine import Oracle

V = tiny.VOCAB_SIZE


class Plan:
    """Which oracle proposes for each row of a batch (rows follow `batch.rows`)."""

    def __init__(self, batch: Batch, oracles: dict[int, Oracle]):
        self.batch, self.oracles = batch, oracles


def one_hot_logits(ids: list[list[int]], hidden: mx.array) -> mx.array:
    logits = mx.where(mx.arange(V) == mx.array(ids)[..., None], 0.0, -1e9)
    return logits.reshape(*hidden.shape[:-1], V)


class Where:
    """Per row, the absolute position of block slot 0 in the last draft pass (a plain object:
    nn.Module files arrays and lists as parameters)."""

    def __init__(self, pos: list[int], rows: list[int]):
        self.pos, self.rows = pos, rows  # rows: the batch's sequence indices


class RowsOracleDraft(DFlashDraftModel):
    """A real draft (its batched forward runs) whose proposals are each row's oracle's."""

    plan: Plan | None = None

    def __call__(self, block_ids, context, cache):
        hidden = super().__call__(block_ids, context, cache)
        off = cache[0].offset
        batch = self.plan and self.plan.batch
        rows = []
        if batch is not None and batch.serial:  # one sequence's own cache: which one
            rows = [s.index for s in batch._seqs if s.session.draft_cache is cache]
        elif batch is not None:
            rows = batch.rows
        self.where = Where(off.tolist() if isinstance(off, mx.array) else [off], rows)
        return hidden

    def proposal_logits(self, hidden):
        if self.plan is None:
            return super().proposal_logits(hidden)
        pos = self.where.pos
        out = []
        for b, index in enumerate(self.where.rows):
            o, row = self.plan.oracles[index], []
            for i in range(1, hidden.shape[-2] + 1):
                j = pos[b] + i - o.prompt_len
                tok = o.reference[j] if 0 <= j < len(o.reference) else 0
                if o.rng.random() < o.p_wrong:
                    tok = o.rng.randrange(V)
                row.append(tok)
            out.append(row)
        return one_hot_logits(out, hidden)
