"""Per-device defaults: dense float32 weights and the confidence cut on the CPU, none of it on GPUs.

MLX's CPU 4-bit matmul costs in proportion to the tokens it multiplies, so on the CPU device a
verify of B tokens would cost about B steps and speculation could never pay; dense float32
weights with a real BLAS (`blas.py`) make a verify pass cost little more than a step. On a GPU
the checkpoint runs as loaded.
"""

from __future__ import annotations

import mlx.core as mx

from ..errors import DFlashError

WEIGHT_POLICIES = ("auto", "quantized", "float32", "bfloat16")
DRAFT_BITS = (4, 8, 16)


def on_cpu() -> bool:
    return mx.default_device() == mx.cpu


# On the CPU every verified token costs, so slots the draft is unsure of are cut before
# verifying: slot k pays for itself when the draft's odds that slots 1..k all hold beat its
# share of the round's cost. With verify padding (OpenBLAS: 5 rows run as 8) a slot costs ~4%
# of a step; replayed on prompts outside the benchmark, cuts 0.05-0.25 come within 1% of the
# best, and the lowest of them keeps the most slots (τ). On a GPU a wider verify is nearly
# free: no cut.
CPU_MIN_CONFIDENCE = 0.05


def auto_min_confidence(draft) -> float:
    if draft is None or draft.config.is_dflash2:
        return 0.0  # DFlash 2's selector walks one joint path; it has no per-slot cut
    return CPU_MIN_CONFIDENCE if on_cpu() else 0.0


def auto_draft_bits(dtype: mx.Dtype | None) -> int:
    """4 while the target stays quantized; 16 when it runs dense, since a dense policy
    dequantizes the draft too: rounding it to 4 bits first would cost accuracy (demo pair on
    the CPU: τ +0.01 replayed on items the benchmark never runs, +0.002 on the benchmark) and
    save nothing."""
    return 4 if dtype is None else 16


def weights_dtype(weights: str) -> mx.Dtype | None:
    """The dense dtype a weight policy asks for (None: keep the checkpoint's quantization)."""
    if weights not in WEIGHT_POLICIES:
        raise DFlashError(f"weights must be one of {', '.join(WEIGHT_POLICIES)}, got {weights!r}")
    if weights == "auto":
        # MLX's CPU 4-bit matmul costs ∝ verify width; dense float32 makes speculation pay.
        return mx.float32 if on_cpu() else None
    return {"quantized": None, "float32": mx.float32, "bfloat16": mx.bfloat16}[weights]
