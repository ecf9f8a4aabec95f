"""The measured verify-cost curve behind verify padding and `--block-size auto`.

Speculation pays when τ (tokens per verify round) beats the cost of one round relative to one
plain AR step: verify(B) + draft(B). Both costs depend on the chip, the BLAS and the weights
format, so they are measured here, not assumed, and cached per machine and model.
"""

from __future__ import annotations

import json
import math
import platform
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Callable

import mlx.core as mx

from ..machine import cpu_name
from ..speculate.proposal import propose
from ..speculate.width import PassCosts
from . import blas

if TYPE_CHECKING:
    from ..loader import Pair

WIDTHS = tuple(range(1, 9))
# Tree verify widths (a tree of N nodes is one pass of N + 1 rows; `tree_budget.py`): only
# `doctor` times them, so the first-use timing in `generate` stays as short as before.
TREE_WIDTHS = (9, 17, 33, 65)
TREE_ROUNDS = 3  # timed rounds of the tree widths (after one warm-up), each width's fastest kept
DEFAULT_TAU = 3.0  # τ at block 5 assumed for the recommendation (Mac 4-bit reports: 2.9-3.4)
TAU_BLOCK = 5
# Pad a verify pass only where the wider one is clearly cheaper: repeat timings vary a few %.
PAD_MARGIN = 0.05
# Timing stops once every width's two fastest rounds agree within SPREAD (the kept minimum is
# then trustworthy) or after BUDGET_S seconds; a curve still above SPREAD is marked noisy.
SPREAD = 0.05
BUDGET_S = 8.0
MAX_ROUNDS = 30


@dataclass
class CostCurve:
    """One target pass of width W relative to W=1, and one draft pass relative to W=1."""

    widths: list[int]
    verify: list[float]
    draft: list[float | None]
    step_ms: float
    context: int
    measured_at: str
    # the largest gap between a width's two fastest rounds, relative (0.03: 3%)
    spread: float = 0.0
    # spread stayed above SPREAD (a busy machine): `verify` was made non-decreasing, since a
    # wider pass that timed cheaper may only have been luckier, so nothing pads
    noisy: bool = False
    # wider passes for draft trees, relative to W=1 like `verify` (empty: not timed; curves
    # cached before they existed load without them)
    tree_widths: list[int] = field(default_factory=list)
    tree_verify: list[float] = field(default_factory=list)

    def cost(self, block: int) -> tuple[float, float]:
        """(verify, draft) of one round at `block`; the verify as padded (see `pads`)."""
        i = self.widths.index(block)
        j = self.widths.index(self.pads().get(block, block))
        return self.verify[j], self.draft[i] or 0.0

    def verify_at(self, width: int) -> float | None:
        """One target pass of `width` rows (padded as the engine would within `widths`), or
        None where it was not timed."""
        if width in self.widths:
            return self.cost(width)[0]
        if width in self.tree_widths:
            return self.tree_verify[self.tree_widths.index(width)]
        return None

    def pass_costs(self, block: int) -> PassCosts:
        """Its passes as the width controller reads them (`speculate/width.py`): a pass of
        R rows, padded as the engine pads, and a draft pass at `block`."""
        rows = sorted({(w, self.verify_at(w)) for w in self.widths + self.tree_widths})
        i = self.widths.index(block) if block in self.widths else -1
        return PassCosts(tuple(rows), (self.draft[i] or 0.0) if i >= 0 else 0.0, block)

    def pads(self, margin: float = PAD_MARGIN) -> dict[int, int]:
        """{W: wider W'} for the widths whose verify pass is cheaper run at a wider width.

        BLAS kernels multiply token rows in fixed-size groups, so cost is not monotone in W:
        with OpenBLAS here 5 rows cost more than 8 (4 + a lone row against 8 at once). The
        engine then verifies W tokens in a pass of W' rows; the rows past W are padding.
        """
        out = {}
        for i, w in enumerate(self.widths):
            if w < 2:
                continue
            j = min(range(i, len(self.widths)), key=lambda k: self.verify[k])
            if self.verify[j] < self.verify[i] * (1 - margin):
                out[w] = self.widths[j]
        return out


@dataclass
class Plan:
    block_size: int
    verify: float
    draft: float
    break_even: float
    expected_tau: float
    speedup: float


def _spread(times: list[float]) -> float:
    """How far the second-fastest round is above the fastest (inf with fewer than two)."""
    if len(times) < 2:
        return float("inf")
    a, b = sorted(times)[:2]
    return b / a - 1


def measure(pair: Pair, widths=WIDTHS, context: int = 256, repeats: int = 2,
            progress: Callable[[str], None] | None = None, budget_s: float = BUDGET_S,
            spread: float = SPREAD, tree_widths=()) -> CostCurve:
    """Time one target pass at each width (and one draft pass) after `context` cached tokens.

    Widths are interleaved within each round so machine drift hits all of them alike; the
    fastest round is kept (interference only adds time). After one warm-up round, rounds run
    until `repeats` (at least two) have, and every width's two fastest rounds agree within
    `spread`; or until `budget_s` seconds in all have passed (one round at least): the curve
    is then marked noisy if they still disagree (or only one round fitted).

    `tree_widths` (wider than `widths`) are timed after that, target pass only (a tree's draft
    pass is a path's), in TREE_ROUNDS rounds of their own keeping each one's fastest: mixed
    into the path's rounds, a 65-row pass just before a 1-row one made the path's timings
    disagree by 8-14% on an idle machine, and leftover noise only makes a tree look dearer.
    """
    say = progress or (lambda _m: None)
    start = time.perf_counter()  # the budget counts the warm-up too: it is the user's wait
    tgt, draft = pair.target, pair.draft
    vocab = tgt.vocab_size or 1000
    cache = tgt.make_cache()
    _, taps = tgt(mx.random.randint(0, vocab, (1, context)), cache, taps=draft is not None)
    mx.eval([c.state for c in cache], taps)
    d_cache = None
    if draft is not None:
        d_cache = draft.make_cache()
        mask = draft.config.mask_token_id
        mx.eval(propose(draft, mx.array([[0, mask]]), taps, d_cache)[0])
    t_verify: dict[int, list[float]] = {w: [] for w in widths}
    t_draft: dict[int, list[float]] = {w: [] for w in widths}
    worst = float("inf")
    for r in range(MAX_ROUNDS + 1):
        _round(tgt, draft, cache, d_cache, taps, widths, context, vocab,
               t_verify if r else None, t_draft if r else None)
        elapsed = time.perf_counter() - start
        if r:
            worst = max(_spread(t) for t in [*t_verify.values(), *t_draft.values()] if t)
            agree = "" if worst == float("inf") else f", rounds agree within {worst:.0%}"
            say(f"timing verify cost: round {r}{agree} ({elapsed:.0f} s)")
        # past the budget one timed round is enough: a busy machine's curve is noisy anyway
        if r >= 1 and elapsed >= budget_s or r >= max(repeats, 2) and worst <= spread:
            break
    wide = [w for w in tree_widths if w > max(widths)]
    t_wide: dict[int, list[float]] = {w: [] for w in wide}
    for r in range(TREE_ROUNDS + 1 if wide else 0):
        _round(tgt, None, cache, None, taps, wide, context, vocab, t_wide if r else None, None)
        say(f"timing tree widths: round {r + 1} of {TREE_ROUNDS + 1}")
    step = min(t_verify[widths[0]])
    verify = [round(min(t[w]) / step, 4) for t, ws in ((t_verify, widths), (t_wide, wide))
              for w in ws]
    noisy = not worst <= spread
    if noisy:  # no padding: no wider pass counts as cheaper
        verify = [max(verify[: i + 1]) for i in range(len(verify))]
    verify, tree_verify = verify[: len(widths)], verify[len(widths):]
    return CostCurve(
        widths=list(widths),
        verify=verify,
        draft=[round(min(t_draft[w]) / step, 4) if t_draft[w] else None for w in widths],
        step_ms=round(step * 1e3, 3),
        context=context,
        measured_at=time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        spread=round(worst, 4) if worst != float("inf") else 1.0,
        noisy=noisy,
        tree_widths=wide,
        tree_verify=tree_verify,
    )


def _round(tgt, draft, cache, d_cache, taps, widths, context, vocab, t_verify, t_draft) -> None:
    """One pass at each width (and a draft pass); times appended unless this is the warm-up."""
    for w in widths:
        ids = mx.random.randint(0, vocab, (1, w))
        mx.eval(ids)
        tic = time.perf_counter()
        logits, t = tgt(ids, cache, taps=taps is not None and w > 1)
        mx.eval(mx.argmax(logits, axis=-1), t)
        elapsed = time.perf_counter() - tic
        tgt.truncate(cache, context)
        if t_verify is not None:
            t_verify[w].append(elapsed)
        if draft is None or w < 2:
            continue
        block = mx.array([[0] + [draft.config.mask_token_id] * (w - 1)])
        tic = time.perf_counter()
        mx.eval(propose(draft, block, taps[:, :w], d_cache)[0])
        elapsed = time.perf_counter() - tic
        for c in d_cache:
            c.trim(w)
        if t_draft is not None:
            t_draft[w].append(elapsed)


def tau_at(alpha: float, block: int) -> float:
    """Expected τ at `block` if each draft position is accepted with probability alpha."""
    return sum(alpha**k for k in range(block))


def alpha_from_tau(tau: float, block: int = TAU_BLOCK) -> float:
    tau = min(max(tau, 1.0), block - 1e-6)
    lo, hi = 0.0, 1.0
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if tau_at(mid, block) < tau else (lo, mid)
    return lo


def plan(curve: CostCurve, tau: float = DEFAULT_TAU, max_block: int | None = None) -> list[Plan]:
    """Break-even τ, expected τ and predicted speedup for each block size 2..max."""
    from ..stats import break_even_tau, predicted_speedup

    alpha = alpha_from_tau(tau)
    rows = []
    for b in curve.widths:
        if b < 2 or (max_block is not None and b > max_block):
            continue
        v, d = curve.cost(b)
        exp = tau_at(alpha, b)
        rows.append(Plan(b, v, d, break_even_tau(v, d), exp, predicted_speedup(exp, v, d)))
    return rows


def recommend(rows: list[Plan]) -> Plan:
    return max(rows, key=lambda p: p.speedup)


# -- cache: per machine and model ------------------------------------------------------------

def machine_key() -> str:
    from importlib.metadata import version

    st = blas.status()  # the release, not just the name: its kernels shape the curve
    return "|".join([platform.system(), platform.machine(), cpu_name(), str(mx.default_device()),
                     f"mlx {version('mlx')}", st["version"] or st["active"]])


def model_key(target: str, revision: str | None, weights: str, draft: str | None,
              draft_bits: int) -> str:
    return f"{target}@{revision or '-'}|{weights}|{draft or 'no-draft'}|draft-bits {draft_bits}"


def cache_file() -> Path:
    from ..demo.target import cache_dir

    return cache_dir() / "verify-cost.json"


def forget(key: str | None = None) -> int:
    """Drop this machine's cached curve for `key` (None: every model); return how many.

    Raises OSError when the cache cannot be rewritten."""
    path = cache_file()
    data = _read(path)
    mine = data.get(machine_key(), {})
    gone = [k for k in mine if key is None or k == key]
    for k in gone:
        del mine[k]
    _measured.clear()
    if gone:
        _write(path, data)
    return len(gone)


def cached(key: str) -> CostCurve | None:
    """The stored curve for `key`; None if absent, unreadable or malformed (it is re-measured)."""
    return _curve(_read(cache_file()).get(machine_key(), {}).get(key))


def store(key: str, curve: CostCurve) -> Path:
    """Add `curve` to the cache, atomically. Raises OSError when it cannot be written."""
    path = cache_file()
    data = _read(path)
    data.setdefault(machine_key(), {})[key] = asdict(curve)
    _write(path, data)
    return path


def _read(path: Path) -> dict:
    """The cache as {machine: {model: curve}}; {} for a missing, unreadable or foreign file."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError, RecursionError):  # ValueError: half-written JSON, not UTF-8
        return {}
    if not isinstance(data, dict):
        return {}
    return {m: v for m, v in data.items() if isinstance(v, dict)}


def _curve(raw) -> CostCurve | None:
    """A CostCurve from its JSON, or None unless every field is what `measure` writes: the
    consumers index widths and compare costs without further checks."""
    if not isinstance(raw, dict):
        return None
    try:
        c = CostCurve(**raw)
    except TypeError:
        return None

    def num(x, low=0.0):
        return isinstance(x, (int, float)) and not isinstance(x, bool) and low <= x < math.inf

    lists = all(isinstance(v, list) for v in (c.widths, c.verify, c.draft))
    if not (lists and len(c.widths) >= 2 and len(c.verify) == len(c.draft) == len(c.widths)):
        return None
    if c.widths != list(range(1, len(c.widths) + 1)):
        return None
    ok = (all(num(v, 1e-9) for v in c.verify) and all(d is None or num(d) for d in c.draft)
          and num(c.step_ms, 1e-9) and num(c.spread) and isinstance(c.noisy, bool))
    return c if ok and _tree_ok(c, num) else None


def _tree_ok(c: CostCurve, num) -> bool:
    """The tree widths: ints past `widths`, increasing, each with a cost."""
    w, v = c.tree_widths, c.tree_verify
    if not (isinstance(w, list) and isinstance(v, list) and len(w) == len(v)):
        return False
    ints = all(isinstance(x, int) and not isinstance(x, bool) for x in w)
    return (ints and w == sorted(set(w)) and (not w or w[0] > c.widths[-1])
            and all(num(x, 1e-9) for x in v))


def _write(path: Path, data: dict) -> None:
    from ..atomic import write_atomic

    path.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(path, json.dumps(data, indent=1))  # never half a cache, even on a full disk


# curves this process measured but could not store: not re-timed at every call
_measured: dict[str, CostCurve] = {}


def auto_block_size(pair: Pair, key: str, progress: Callable[[str], None] | None = None,
                    tau: float = DEFAULT_TAU) -> tuple[Plan, bool]:
    """The block size with the best predicted speedup; measures once per machine and model.

    Returns (plan, whether the curve came from the cache).
    """
    curve, hit = curve_for(pair, key, progress)
    return recommend(plan(curve, tau, max_block=pair.draft.config.block_size)), hit


def known(key: str) -> CostCurve | None:
    """This machine's curve for `key` if one was measured (cached, or earlier in this
    process); never times anything."""
    return cached(key) or _measured.get(key)


def curve_for(pair: Pair, key: str, progress: Callable[[str], None] | None = None
              ) -> tuple[CostCurve, bool]:
    """The cached cost curve of this machine and model, measured and stored on a miss.

    The cache is an optimisation: when it cannot be read the curve is measured, and when it
    cannot be written `progress` gets one line and the run goes on."""
    curve = known(key)
    if curve is not None:
        return curve, True
    if progress:
        progress(f"timing verify cost once for this machine and model (about {BUDGET_S:.0f} s; "
                 "cached after)")
    curve = measure(pair, progress=progress)
    try:
        store(key, curve)
    except OSError as e:
        _measured[key] = curve
        if progress:
            progress(f"note: could not cache the verify-cost timing in {cache_file()} "
                     f"({e.strerror or e}); it is timed again next run")
    return curve, False
