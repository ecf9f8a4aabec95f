"""The small DFlash 2 sampling setting that test_dflash2.py and test_hybrid.py share."""

V = 32  # the sampling tests use a small vocabulary so every cell of the chi-square is filled
MASK = V - 1
T = 2.0  # flat enough that p and the selector's q overlap: the accept branch is exercised
PROMPT = [20, 28, 13, 21, 19, 10, 15, 28]  # a context where p and q overlap (≈20% accepts)
