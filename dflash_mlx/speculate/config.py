"""How to speculate: one frozen value per generation call (`SpeculationConfig`).

Exactness depends on none of its fields; only what a round costs does.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from types import MappingProxyType
from typing import Mapping

from ..bounds import count
from ..errors import InvalidArgumentError
from .width import PassCosts


LOOKUP_MAX_BLOCK = 16  # a lookup continuation longer than this rarely holds to its end

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
        adaptive: each round, speculate only while it beats plain decoding on this machine's
            measured round costs and the recent acceptance (`width.py`); False: speculate every
            round at `block_size` (the default here; `for_pair`, the device defaults, turns it
            on). Seeded sampling always keeps its widths fixed.
        pass_costs: this machine's relative cost of a target pass by rows and of a draft pass
            (the CPU's cost curve), which `adaptive` weighs; None: it times rounds instead.
    """

    block_size: int = 5
    min_confidence: float = 0.0
    lookup: bool = True
    verify_pad: Mapping[int, int] = field(default_factory=dict)
    draft_window: int | None = None
    fallback_after: int | None = None
    draft_free: bool = False
    tree: int = 0
    adaptive: bool = False
    pass_costs: PassCosts | None = None

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
        if self.tree:  # a tree's mask and verify rows grow with the budget: a ceiling first
            count("--tree", self.tree, low=0)

    @classmethod
    def for_pair(cls, pair, **overrides) -> "SpeculationConfig":
        """This device's defaults for `pair` (`cpu/policy.py`), then `overrides` (None skipped)."""
        from ..cpu.policy import auto_min_confidence, on_cpu

        # The lookup and the cut read the draft's tokens on the host between the draft and the
        # verify pass: a sync that leaves a GPU idle every round. They pay on the CPU, where a
        # verified token costs and the host waits anyway; off the CPU both default to off
        # (auto_min_confidence is 0 there), so a round syncs the host once.
        base = cls(min_confidence=auto_min_confidence(pair.draft), lookup=on_cpu(),
                   fallback_after=FALLBACK_AFTER, adaptive=True)
        return base.replace(**overrides)

    def replace(self, **overrides) -> "SpeculationConfig":
        """A copy with the given fields changed; None leaves a field as it is."""
        changes = {k: v for k, v in overrides.items() if v is not None}
        return replace(self, **changes) if changes else self

    def width(self, w: int) -> int:
        """The rows a verify pass of `w` tokens runs at (`verify_pad`)."""
        return self.verify_pad.get(w, w)


def check_block_size(pair, block: int, draft_free: bool = False, what: str = "block size"):
    """The one check of a block size against a pair: the draft's trained width, or the widest
    lookup block for draft-free speculation. `what` names the setting in the message."""
    if block < 1:
        raise InvalidArgumentError(f"{what} must be at least 1, got {block}")
    if block == 1:
        return
    if draft_free:
        if block > LOOKUP_MAX_BLOCK:
            raise InvalidArgumentError(
                f"{what} {block} is above {LOOKUP_MAX_BLOCK}, the widest draft-free lookup block")
        return
    if pair.draft is None:
        raise InvalidArgumentError(f"{what} > 1 needs a draft model (this pair has none)")
    trained = pair.draft.config.block_size
    if block > trained:
        raise InvalidArgumentError(
            f"{what} {block} is above the draft's trained block size {trained}")
