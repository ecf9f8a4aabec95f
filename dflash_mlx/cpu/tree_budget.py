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
# Policy: a tree may cost at most this much more per verify pass than the path. Its smallest
# measured τ gain is 16% (8 nodes, demo pair); the draft's top-k and building the tree on the
# host take a little of that, so 10% on the verify pass leaves the tree ahead.
MARGIN = 0.10


@dataclass(frozen=True)
class TreeChoice:
    budget: int  # nodes per round (0: one path)
    why: str  # one line: the verify cost it compared


def path_verify(curve: CostCurve, block: int) -> tuple[int, float]:
    """(the width compared, its verify cost) for the path at `block`: as padded; a block past
    the timed widths (z-lab's 16) counts as the widest timed one, which only makes a tree
    look dearer."""
    width = block if block in curve.widths else max(w for w in curve.widths if w <= block)
    return width, curve.verify_at(width)


def choose(curve: CostCurve | None, block: int) -> TreeChoice:
    """The largest budget in BUDGETS, at least the path's B - 1 nodes, whose verify pass of
    N + 1 rows costs at most (1 + MARGIN) × the path's; else 0."""
    if curve is None:
        return TreeChoice(0, "no verify-cost curve is cached for this model on this machine "
                          "(`dflash-mlx doctor --model M` measures one)")
    if block < 2:
        return TreeChoice(0, "no drafted tokens to branch (block size 1)")
    width, path = path_verify(curve, block)
    timed = [(n, v) for n in BUDGETS if n >= block - 1
             and (v := curve.verify_at(n + 1)) is not None]
    if not timed:
        return TreeChoice(0, "the cached verify-cost curve has no tree widths "
                          "(`dflash-mlx doctor --model M` times them)")
    fits = [(n, v) for n, v in timed if v <= (1 + MARGIN) * path]
    n, v = fits[-1] if fits else timed[0]
    how = (f"a verify pass of {n + 1} rows costs {v:.2f}× a step, {v / path:.2f}× the "
           f"path's {path:.2f}× at width {width}")
    if fits and curve.noisy:  # a busy machine's timings may have flattered the wide pass
        return TreeChoice(0, f"{how}, but the timing was too noisy to trust (a busy machine); "
                          "`dflash-mlx doctor --remeasure` re-times it")
    if fits:
        return TreeChoice(n, f"{how} (within {1 + MARGIN:.2f}×)")
    return TreeChoice(0, f"{how}, over the {1 + MARGIN:.2f}× a tree may cost")
