"""One engine assembly for every front-end: load a pair and settle how it speculates.

`check` is the cheap part, run before anything is downloaded so a typo fails in a second.
`open` loads the pair and settles, once, what every generation on it uses: the block size
(`auto` and the registry's default included), the verify padding, the confidence cut, the
draft-tree budget, and what mlx.launch allows. The CLI, the chat app, the server and the
benchmark all start here. Nothing here prints: progress and notes go to callbacks.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable

from . import registry
from .errors import InvalidArgumentError
from .speculate import SpeculationConfig, check_block_size

Say = Callable[[str], None] | None
DEFAULT_LOOKUP_BLOCK = 5  # draft-free `--block-size auto`: the cost curve times a draft pass


@dataclass(frozen=True)
class EngineSettings:
    """What a front-end asks for; `open` settles the `auto` and None values.

    Args:
        block_size: the verify width; None: the registry entry's (else the built-in one),
            "auto": from this machine's verify-cost curve, 1: plain autoregressive.
        sweep: more block sizes a benchmark runs, checked against the draft like block_size.
        tree: draft-tree nodes per round (0: one path), or "auto" from the cost curve.
        min_confidence: the cut of unsure draft slots (None: the device's default).
        lookup: context lookup where the draft is unsure.
        adaptive: speculate only in rounds where it pays (`speculate/width.py`).
        pad_verify: run verify passes wider where this machine's BLAS does that faster.
        draft_bits, weights: how the pair is loaded (`cpu/policy.py`).
    """

    block_size: int | str | None = None
    sweep: tuple[int, ...] = ()
    tree: int | str = "auto"
    min_confidence: float | None = None
    lookup: bool = True
    adaptive: bool = True
    pad_verify: bool = True
    draft_bits: int | None = None
    weights: str = "auto"


@dataclass
class Loaded:
    """What was loaded, for stats, event summaries and benchmark cards."""

    spec: registry.Spec
    target_path: Path
    draft_path: Path | None
    target_revision: str | None
    draft_revision: str | None
    draft_bits: int
    weights: str

    def models(self) -> dict:
        return {
            "target": {"id": self.spec.target, "revision": self.target_revision,
                       "path": str(self.target_path.resolve())},
            "draft": None if self.spec.draft is None else
            {"id": self.spec.draft, "revision": self.draft_revision, "bits": self.draft_bits,
             "path": str(self.draft_path.resolve())},
            "registry_name": self.spec.entry.name if self.spec.entry else None,
            "weights": self.weights,
        }

    def cost_key(self) -> str:
        from .cpu.cost import model_key

        return model_key(self.spec.target, self.target_revision, self.weights, self.spec.draft,
                         self.draft_bits)


@dataclass
class Engine:
    """A loaded pair and the speculation settings every generation on it runs with."""

    pair: object
    loaded: Loaded
    config: SpeculationConfig

    @property
    def block_size(self) -> int:
        return self.config.block_size


def check(settings: EngineSettings) -> None:
    """The checks that need no model, run before anything is downloaded or loaded (`open`
    runs them too): the ranges, and what mlx.launch refuses."""
    from .cpu.policy import DRAFT_BITS, WEIGHT_POLICIES

    s = settings
    if s.draft_bits is not None and s.draft_bits not in DRAFT_BITS:
        raise InvalidArgumentError(f"--draft-bits must be 4, 8 or 16 (16 keeps the draft as is), "
                                   f"got {s.draft_bits}")
    if s.weights not in WEIGHT_POLICIES:
        raise InvalidArgumentError(f"--weights must be one of {', '.join(WEIGHT_POLICIES)}, "
                                   f"got {s.weights!r}")
    if s.min_confidence is not None and not 0 <= s.min_confidence <= 1:
        raise InvalidArgumentError(f"--min-confidence must be in [0, 1], got {s.min_confidence}")
    for b in (s.block_size, *s.sweep):
        if not (b is None or b == "auto" or isinstance(b, int) and b >= 1):
            raise InvalidArgumentError(
                f"--block-size must be an integer ≥ 2 or 'auto', got {b!r}")
    if s.tree != "auto":
        parse_tree(s.tree)
    if s.block_size == "auto":
        from .distributed import world

        if world() is not None:  # per-rank timings would pick different widths
            raise InvalidArgumentError("--block-size auto is not available under mlx.launch: "
                                       "give a number")


def open(spec: registry.Spec, settings: EngineSettings = EngineSettings(), say: Say = None,
         note: Say = None) -> Engine:
    """Load what `spec` names and settle every speculation setting against it, once.

    Args:
        say: progress meant for a terminal (download bars go with it); None: quiet.
        note: lines worth keeping in logs too: a first-use timing, what `auto` chose, a tree
            that cannot run (None: `say`).
    """
    pair, loaded = load(spec, settings, say, note)
    return settle(pair, loaded, settings, say, note)


def load(spec: registry.Spec, settings: EngineSettings = EngineSettings(), say: Say = None,
         note: Say = None):
    """The first half of `open`: download what `spec` names (narrow patterns, progress bars)
    and load it, as (pair, Loaded). A front-end with checks of its own that need the pair (a
    prompt against its context) runs them between this and `settle`, before any timing."""
    from .loader import DRAFT_PATTERNS, MODEL_PATTERNS, load as load_pair, resolve

    settings = _agreed(settings)
    note = note or say
    if say is not None and (line := blas_warning()):
        note(line)  # in logs too: without a fast BLAS answers come 10-50x slower
    if say and spec.entry and spec.entry.missing:
        say(f"note: {spec.entry.name} needs {', '.join(spec.entry.missing)} support, which this "
            "version does not have yet; it may fail to load or run")
    spec = registry.materialize(spec, progress=note)
    bars = say is not None
    t_path = resolve(spec.target, MODEL_PATTERNS, spec.target_revision, progress=bars)
    d_path = None
    if spec.draft is not None and spec.draft != registry.LOOKUP:
        d_path = resolve(spec.draft, DRAFT_PATTERNS, spec.draft_revision, progress=bars)
    pair = load_pair(t_path, d_path, draft_bits=settings.draft_bits, weights=settings.weights,
                     progress=say)
    loaded = Loaded(
        spec, t_path, d_path,
        spec.target_revision or registry.snapshot_revision(t_path),
        None if d_path is None else spec.draft_revision or registry.snapshot_revision(d_path),
        pair.draft_bits if d_path is not None else 16, pair.weights,
    )
    return pair, loaded


def settle(pair, loaded: Loaded, settings: EngineSettings = EngineSettings(), say: Say = None,
           note: Say = None) -> Engine:
    """The second half of `open`: block size, padding, cut and tree for the loaded pair. The
    timing comes after every other check, so a typo never waits for it."""
    settings, note = _agreed(settings), note or say
    draft_free = loaded.spec.draft == registry.LOOKUP
    base = SpeculationConfig.for_pair(pair, min_confidence=settings.min_confidence,
                                      lookup=settings.lookup or draft_free,
                                      adaptive=settings.adaptive,
                                      draft_free=draft_free or None)
    block = choose_block(pair, loaded, base, settings.block_size, note)
    for b in settings.sweep:
        check_block_size(pair, b, base.draft_free or pair.draft is None, "--block-size")
    pads = verify_pads(pair, loaded.cost_key(), base.draft_free, say, note) \
        if settings.pad_verify else {}
    config = base.replace(block_size=block, verify_pad=pads,
                          pass_costs=pass_costs(pair, loaded.cost_key(), block))
    return Engine(pair, loaded, config.replace(
        tree=choose_tree(pair, loaded, config, settings.tree, note)))


def _agreed(settings: EngineSettings) -> EngineSettings:
    """`settings`, checked; under mlx.launch, what every rank settles alike."""
    from .distributed import world

    check(settings)
    if world() is None:
        return settings
    # padding and `--tree auto` come from this machine's timings, which differ per rank
    return replace(settings, pad_verify=False,
                   tree=0 if settings.tree == "auto" else settings.tree)


def default_block(entry: registry.Entry | None) -> int:
    """The block size without --block-size: the registry entry's, else the built-in one."""
    return registry.DEFAULT_BLOCK if entry is None else entry.block_size


def choose_block(pair, loaded: Loaded, config: SpeculationConfig, requested: int | str | None,
                 note: Say = None) -> int:
    """The block size to run: 1 without a draft (unless draft-free), `auto` from the cached
    cost curve, None (no --block-size) from the registry entry (`default_block`)."""
    if pair.draft is None and not config.draft_free:
        return 1
    if requested is None:
        entry, block = loaded.spec.entry, default_block(loaded.spec.entry)
        check_block_size(pair, block, config.draft_free, "--block-size" if entry is None else
                         f"registry entry {entry.name!r}: block_size")
        return block
    if requested == "auto" and pair.draft is None:
        return DEFAULT_LOOKUP_BLOCK
    if requested == "auto":
        from .cpu.cost import auto_block_size

        best, hit = auto_block_size(pair, loaded.cost_key(), note)
        if note:
            how = "cached measurement" if hit else "measured now, cached"
            note(f"--block-size auto → {best.block_size} (break-even τ {best.break_even:.2f}, "
                 f"predicted {best.speedup:.2f}× at the assumed acceptance; {how})")
        return best.block_size
    check_block_size(pair, int(requested), config.draft_free, "--block-size")
    return int(requested)


def verify_pads(pair, cost_key: str, draft_free: bool = False, say: Say = None,
                note: Say = None) -> dict[int, int]:
    """The verify widths worth padding here, from this machine's cost curve (CPU only).

    On a GPU a wider pass costs about the same as a narrower one, so nothing pads there. The
    curve is measured once per machine and model (a few seconds) and cached, as for
    `--block-size auto`.
    """
    from .cpu.policy import on_cpu

    if (pair.draft is None and not draft_free) or not on_cpu():
        return {}
    from .cpu.cost import curve_for

    # a miss measures the curve once (its rounds go to `note`) and caches it for later runs
    curve = curve_for(pair, cost_key, note or say)[0]
    pads = curve.pads()
    if say and curve.noisy:
        say(f"the verify-cost timing was too noisy (spread {curve.spread:.0%}: the machine is "
            "busy), so no verify pass is padded; `dflash-mlx doctor --remeasure` re-times it")
    if say and pads:
        say("padding verify passes " + ", ".join(f"{w}→{p}" for w, p in pads.items())
            + " tokens wide: cheaper on this BLAS (the added rows are never read; "
            "--no-pad-verify turns it off)")
    return pads


def pass_costs(pair, cost_key: str, block: int):
    """This machine's pass costs for the width controller, where a cost curve was measured
    (the CPU's, for padding or `doctor`); None: the controller times rounds itself."""
    from .cpu.cost import known
    from .cpu.policy import on_cpu

    curve = known(cost_key) if on_cpu() and pair.draft is not None else None
    return None if curve is None or curve.noisy else curve.pass_costs(block)


def choose_tree(pair, loaded: Loaded, config: SpeculationConfig, requested: int | str,
                note: Say = None) -> int:
    """Tree nodes per round at `config.block_size`: the number asked for, or for `auto` the
    budget this machine's cached cost curve allows (`cpu/tree_budget.py`; nothing is timed
    here: without a curve with tree widths, one path). A pair that verifies one path only
    gets 0, and a note when a number was asked for."""
    from .speculate.rounds import tree_budget

    if requested == 0:
        return 0
    probe = 1 if requested == "auto" else requested  # can this pair run a tree at all?
    runs, why = tree_budget(pair, config.replace(tree=probe), config.draft_free)
    if not runs:
        if note and why and requested != "auto":
            note(f"note: {why}")
        return 0
    if requested != "auto":
        return int(requested)
    from .cpu import cost, tree_budget as policy

    choice = policy.choose(cost.known(loaded.cost_key()), config.block_size)
    if note and choice.budget:
        note(f"--tree auto → {choice.budget}: {choice.why}")
    return choice.budget


def parse_block_sizes(text: str | None, allow_auto: bool = True,
                      allow_list: bool = True) -> list[int | str | None]:
    """`5`, `auto` or a list `3,5,8`. Sizes below 2 draft nothing: plain AR is --no-draft.
    None (no --block-size) stays None until the model is known (`choose_block`)."""
    if text is None:
        return [None]
    parts = [p.strip() for p in str(text).split(",")]
    if len(parts) > 1 and not allow_list:
        raise InvalidArgumentError(f"--block-size takes one size here (lists are for benchmark), "
                                   f"got {text!r}")
    out: list[int | str] = []
    for part in parts:
        if part == "auto" and allow_auto:
            out.append(part)
            continue
        try:
            b = int(part)
        except ValueError:
            raise InvalidArgumentError(f"--block-size must be an integer ≥ 2 or 'auto', got {part!r}") from None
        if b < 2:
            raise InvalidArgumentError(
                f"--block-size must be at least 2 (the last token plus at least one drafted "
                f"token), got {b}; for plain autoregressive decoding use --no-draft"
            )
        out.append(b)
    return out


def parse_tree(text: str | int | None) -> int | str:
    """`--tree`: a node budget (0: one path), or 'auto' (None: auto; see `choose_tree`)."""
    text = "auto" if text is None else str(text).strip()
    if text == "auto":
        return text
    try:
        n = int(text)
    except ValueError:
        raise InvalidArgumentError(f"--tree must be a node count ≥ 0 or 'auto', got {text!r}") \
            from None
    if n < 0:
        raise InvalidArgumentError(f"--tree must be at least 0 (0: one path), got {n}")
    return n


def blas_warning() -> str | None:
    """One line with the fix, where MLX's CPU matmuls miss the fast BLAS (None: all is well).

    Silent on macOS (Accelerate), on a GPU, and where the user chose `DFLASH_MLX_BLAS=bundled`.
    """
    from .cpu import blas
    from .cpu.policy import on_cpu

    if not sys.platform.startswith("linux") or os.environ.get(blas.ENV) == "bundled":
        return None
    st = blas.status()
    if st["active"] == "OpenBLAS" or not on_cpu():
        return None
    why = st["reason"] or ""
    if "libgfortran" in why:
        why, fix = "OpenBLAS needs libgfortran.so.5", blas.GFORTRAN_FIX
    elif "mlx was imported" in why:
        fix = "import dflash_mlx before mlx"
    elif blas.candidate() is None:
        why, fix = "no OpenBLAS found", blas.INSTALL_HINT
    else:
        fix = f"unset {blas.ENV}, or point it at a libopenblas.so that loads"
    return f"warning: CPU matmuls use MLX's slow reference BLAS ({why}); fix: {fix}"
