"""Per-request latency, measured the same way by the in-process and the remote benchmark.

TTFT: from a request's arrival to its first generated tokens. TPOT (time per output token
after the first): (last token time − first token time) / (tokens − 1). Plain Python: the
client backend uses it without loading MLX.
"""

from __future__ import annotations

import math
from collections.abc import Iterable


def tpot(first: float | None, last: float | None, tokens: int) -> float | None:
    """Seconds per token after the first (None: fewer than two tokens, or no timing)."""
    if first is None or last is None or tokens < 2 or last < first:
        return None
    return (last - first) / (tokens - 1)


def percentile(values: Iterable[float | None], q: float) -> float | None:
    """The q-th percentile (0-100) of the values that are not None, linear between the two
    nearest ranks (numpy's default, so p50 is the median); None when there are none."""
    xs = sorted(x for x in values if x is not None)
    if not xs:
        return None
    k = (len(xs) - 1) * q / 100
    lo, hi = math.floor(k), math.ceil(k)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


def spread_ms(name: str, seconds: Iterable[float | None]) -> dict:
    """{"<name>_p50_ms", "<name>_p95_ms"} of per-request seconds (None: no request has one)."""
    xs = list(seconds)
    return {f"{name}_{p}_ms": None if (v := percentile(xs, q)) is None else round(v * 1e3, 2)
            for p, q in (("p50", 50), ("p95", 95))}
