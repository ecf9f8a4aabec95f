"""Fail-loud guards for the round loop: a broken target stops the run, a useless draft steps aside.

Both are cheap enough for every round. `logits_ok` builds a lazy scalar that is evaluated in
the same `mx.eval` as the acceptance (no extra sync); `check_logits` turns a False into one
line naming the model. `AcceptanceWatch` sees each round's drafted and accepted counts and says
when a draft that keeps accepting nothing (say, paired with the wrong target) should give way to
plain AR for the rest of the answer; output is the target's either way.
"""

from __future__ import annotations

import mlx.core as mx

from ..errors import CheckpointError


class NonFiniteLogitsError(CheckpointError):
    """The target produced NaN or +inf logits: a broken checkpoint or a bad quantization."""


def logits_ok(logits: mx.array) -> mx.array:
    """A lazy boolean scalar: no NaN and no +inf anywhere, and every row has a finite max.

    -inf alone is allowed (some models mask tokens that way); NaN fails both comparisons.
    """
    return mx.logical_and(mx.all(logits < mx.inf), mx.all(logits.max(axis=-1) > -mx.inf))


def check_logits(ok, model: str) -> None:
    """Raise one line naming `model` when `ok` (from `logits_ok`, already evaluated) is False."""
    if not bool(ok.item() if isinstance(ok, mx.array) else ok):
        raise logits_error(model)


def logits_error(model: str) -> NonFiniteLogitsError:
    return NonFiniteLogitsError(
        f"{model}: the target's logits are NaN or infinite; the checkpoint or its "
        "quantization is broken (try other weights or --weights float32)")


class AcceptanceWatch:
    """Says when to switch to plain AR: `patience` drafting rounds in a row accepted nothing.

    Rounds that drafted nothing (every slot cut, or already AR) neither count nor reset. Once
    it has said switch, it keeps saying so: the rest of the answer is AR.
    """

    def __init__(self, patience: int = 16):
        if patience < 1:
            raise ValueError(f"patience must be at least 1, got {patience}")
        self.patience = patience
        self.streak = 0
        self.rounds = 0
        self.switched = False

    def feed(self, drafted: int, accepted: int) -> bool:
        """One round's counts; True from the round the draft should be dropped on."""
        if self.switched:
            return True
        if drafted <= 0:
            return False
        self.rounds += 1
        self.streak = self.streak + 1 if accepted <= 0 else 0
        self.switched = self.streak >= self.patience
        return self.switched

    def feed_event(self, event) -> bool:
        """`feed` from a BlockEvent (its `drafted` tokens and `accepted` count)."""
        return self.feed(len(event.drafted), event.accepted)

    @property
    def note(self) -> str:
        return (f"the draft accepted nothing in {self.streak} rounds in a row (is it meant for "
                "this target?); continuing with plain autoregressive decoding")
