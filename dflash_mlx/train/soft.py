"""Soft labels: the target's whole next-token distribution, rebuilt from the stored taps.

Features keep only the target's argmax per position. The deepest tap sits a few layers below
the top of the target (the default taps end three layers from it), so running the remaining
layers, the final norm and the LM head over that tap gives the target's logits back for a
small part of a training step. The draft can then learn how sure the target is and what it
would say second, not one id per position, without re-running the target over the data.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from ..errors import TrainingDataError
from ..models.target import Target, _find


class TargetTail:
    """The target's layers above its deepest tap, its final norm and (through the draft) head."""

    def __init__(self, target: Target, tap_ids: list[int]):
        top = max(tap_ids)
        self.slot, self.hidden = tap_ids.index(top), target.hidden_size
        self.layers = target.layers[top + 1 :]
        self.norm = _find(target.model, ["model.norm", "language_model.model.norm", "norm"])
        if self.norm is None:
            raise TrainingDataError("soft labels need the target's final norm at model.norm")

    def hidden_states(self, ctx: mx.array) -> mx.array:
        """(K, L, n_taps*H) taps of K sequences from position 0 → (K, L, H) final hidden."""
        h = ctx[..., self.slot * self.hidden : (self.slot + 1) * self.hidden].astype(mx.float32)
        for layer in self.layers:
            h = layer(h, "causal")  # padding sits at the end, so causal masking suffices
        return self.norm(h)

    def label_logits(self, draft, batch: tuple) -> mx.array:
        """Target logits (N, B-1, V') behind every label of a `BlockSampler` batch, over the
        rows the draft proposes from (the restricted head when one is set)."""
        _, ctx, seq_of, anchors, labels = batch
        h = self.hidden_states(ctx)
        pos = anchors[:, None] + mx.arange(labels.shape[1])[None, :]
        return draft.proposal_logits(h[seq_of[:, None], pos]).astype(mx.float32)


def soft_targets(tail: TargetTail, draft, batch: tuple) -> mx.array:
    """The target's distribution over the draft's proposal rows at every label of `batch`."""
    return mx.stop_gradient(mx.softmax(tail.label_logits(draft, batch), axis=-1))


def tail_agreement(tail: TargetTail, draft, batches: list) -> float:
    """How often the rebuilt logits' argmax equals the stored prediction (labels ≥ 0 only).

    Labels must already be in the draft's proposal rows. Float16 taps make this a little under
    1; far under it means the tail does not reproduce the target (e.g. sliding-window layers).
    """
    same = total = 0
    for batch in batches:
        best = np.array(mx.argmax(tail.label_logits(draft, batch), axis=-1))
        labels = np.array(batch[4])
        ok = labels >= 0
        same += int((best == labels)[ok].sum())
        total += int(ok.sum())
    return same / max(1, total)
