"""Errors shown in the app: one actionable line, never a traceback."""

from __future__ import annotations

from dflash_mlx.errors import DFlashError


def describe_error(exc: BaseException) -> tuple[str, str]:
    """A title and one actionable line for an exception (never a traceback)."""
    text = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
    low = text.lower()
    if isinstance(exc, MemoryError) or "out of memory" in low or "malloc" in low:
        return ("Out of memory", f"{text}. Try a smaller model or block size, "
                                 "or close other apps.")
    if isinstance(exc, DFlashError):
        return ("Error", text)
    return (type(exc).__name__, text)


def peak_memory() -> float:
    """Peak MLX memory in bytes."""
    import mlx.core as mx

    return float(mx.get_peak_memory())
