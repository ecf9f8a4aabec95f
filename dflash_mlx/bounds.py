"""Sizes from flags, requests and config files, checked before anything is allocated from them.

Two kinds of limit, and every refusal names the one it hit: a ceiling far above any real use
(past it the value is a typo or hostile, and would only fail later, deep in MLX or as a
segfault), and the memory this process can hold (`machine.memory_limit_bytes`).
"""

from __future__ import annotations

import math

from .errors import InvalidArgumentError

# Ceilings per flag. A tree of 64 nodes is the widest `--tree auto` picks; doctor's context
# is far past what a timing needs. `serve --max-tokens` applies to every request that sets
# none, so it is bounded here too (a run's own --max-tokens stops at the model's context).
# `benchmark --concurrency` stops where `serve --max-batch` does: one batch, or one client
# thread per request.
CEILINGS = {
    "--concurrency": 256,
    "--tree": 1024,
    "--context": 1 << 20,
    "--repeats": 1000,
    "--max-tokens": 1 << 20,
    "--seconds": 24 * 3600,
}


def count(name: str, value, low: int = 1, ceiling: int | None = None) -> int:
    """An integer flag in [low, ceiling] (ceiling: the flag's in CEILINGS)."""
    ceiling = CEILINGS.get(name) if ceiling is None else ceiling
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidArgumentError(f"{name} must be an integer, got {value!r}")
    if value < low:
        raise InvalidArgumentError(f"{name} must be at least {low}, got {value}")
    if ceiling is not None and value > ceiling:
        raise InvalidArgumentError(f"{name} must be at most {ceiling}, got {value}")
    return value


def number(name: str, value, low: float, high: float | None = None) -> float:
    """A finite number flag in [low, high] (high: the flag's in CEILINGS): nan and inf are
    refused, as every comparison with nan is false and would let it through."""
    high = CEILINGS.get(name) if high is None else high
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise InvalidArgumentError(f"{name} must be a number, got {value!r}")
    if not math.isfinite(value):
        raise InvalidArgumentError(f"{name} must be a finite number, got {value}")
    if value < low:
        raise InvalidArgumentError(f"{name} must be at least {low:g}, got {value:g}")
    if high is not None and value > high:
        raise InvalidArgumentError(f"{name} must be at most {high:g}, got {value:g}")
    return float(value)


def rlimit_bytes() -> int | None:
    """The smallest address-space / data-segment limit on this process (None: unlimited)."""
    try:
        import resource
    except ImportError:  # not on POSIX
        return None
    limits = []
    for name in ("RLIMIT_AS", "RLIMIT_DATA"):
        if hasattr(resource, name):
            soft, _hard = resource.getrlimit(getattr(resource, name))
            if soft not in (resource.RLIM_INFINITY, -1) and soft > 0:
                limits.append(soft)
    return min(limits) if limits else None


def gb(n: float) -> str:
    return f"{n / 1e9:,.1f} GB" if n >= 1e8 else f"{n / 1e6:,.0f} MB"


def fits(what: str, need: int, limit: int | None) -> None:
    """Refuse `what` when it needs more than `limit`, the memory this process can hold
    (`machine.memory_limit_bytes`; None: unknown, allowed)."""
    if limit is not None and need > limit:
        raise InvalidArgumentError(f"{what} needs about {gb(need)}, more than the {gb(limit)} "
                                   "of memory this process can hold")


def forward_bytes(args: dict, tokens: int, dtype_bytes: int = 4) -> int:
    """About what one target pass over `tokens` new tokens allocates: its K/V cache, one
    layer's attention scores (tokens²) and activations, and the logits of every row."""
    hidden = args.get("hidden_size") or 0
    heads = args.get("num_attention_heads") or 1
    kv_heads = args.get("num_key_value_heads") or heads
    head_dim = args.get("head_dim") or (hidden // heads if hidden else 0)
    layers = args.get("num_hidden_layers") or 0
    inter = args.get("intermediate_size") or 4 * hidden
    vocab = args.get("vocab_size") or 0
    kv = layers * 2 * kv_heads * head_dim * tokens * dtype_bytes
    scores = heads * tokens * tokens * 4
    rows = tokens * (4 * hidden + 3 * inter + vocab) * 4
    return kv + scores + rows
