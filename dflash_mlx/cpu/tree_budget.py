"""The default draft-tree budget (`--tree auto`), from the measured verify-cost curve.

A tree of N nodes is verified in one target pass of N + 1 rows where one path takes a pass of
B rows (the block size). The tree's gain is τ: on the demo pair trees of 8 / 16 / 32 nodes
raised it 16 / 21 / 30% over the path (docs/speculation.md). So a tree pays only where its
wider pass costs about what the path's does, as on GPUs, whose verify cost is nearly flat in
the width; on this CPU (float32 + OpenBLAS) the cost grows about linearly with the width and
the same trees ran at 0.97 / 0.86 / 0.72× the path's tokens/s, so the answer there is 0.
"""

from __future__ import annotations

from dataclasses import dataclass

from .cost import CostCurve

BUDGETS = (8, 16, 32, 64)  # what `auto` chooses among (0: one path)
# Policy: a tree may cost at most this much more per verify pass than the narrowest path pass.
# Its smallest measured τ gain is 16% (8 nodes, demo pair); the draft's top-k and building the
# tree on the host take a little of that, so 10% on the verify pass leaves the tree ahead.
MARGIN = 0.10
# ... and the path pass it is compared with is the narrowest one, 2 rows, not B: where the
# confidence cut runs (the CPU) a path verifies only the slots the draft is sure of, often
# 2-3 rows, and those unsure rounds are the ones a tree would widen. On a flat (GPU) curve the
# two comparisons agree. With B rows instead, this CPU's curve (9 rows 1.07x the path's 5)
# let 8 nodes in, which ran 3% slower than the path on the bundled prompts (speculation.md).
PATH_WIDTH = 2


@dataclass(frozen=True)
class TreeChoice:
    budget: int  # nodes per round (0: one path)
    why: str  # one line: the verify cost it compared


def choose(curve: CostCurve | None, block: int) -> TreeChoice:
    """The largest budget in BUDGETS, at least the path's B - 1 nodes, whose verify pass of
    N + 1 rows costs at most (1 + MARGIN) × the narrowest path pass (as padded); else 0."""
    if curve is None:
        return TreeChoice(0, "no verify-cost curve is cached for this model on this machine "
                          "(`dflash-mlx doctor --model M` measures one)")
    if block < 2:
        return TreeChoice(0, "no drafted tokens to branch (block size 1)")
    path = curve.verify_at(PATH_WIDTH)
    timed = [(n, v) for n in BUDGETS if n >= block - 1
             and (v := curve.verify_at(n + 1)) is not None]
    if not timed:
        return TreeChoice(0, "the cached verify-cost curve has no tree widths "
                          "(`dflash-mlx doctor --model M` times them)")
    fits = [(n, v) for n, v in timed if v <= (1 + MARGIN) * path]
    n, v = fits[-1] if fits else timed[0]
    how = (f"a verify pass of {n + 1} rows costs {v:.2f}× a step, {v / path:.2f}× the "
           f"narrowest path pass's {path:.2f}× ({PATH_WIDTH} rows)")
    if fits and curve.noisy:  # a busy machine's timings may have flattered the wide pass
        return TreeChoice(0, f"{how}, but the timing was too noisy to trust (a busy machine); "
                          "`dflash-mlx doctor --remeasure` re-times it")
    if fits:
        return TreeChoice(n, f"{how} (within {1 + MARGIN:.2f}×)")
    return TreeChoice(0, f"{how}, over the {1 + MARGIN:.2f}× a tree may cost")
