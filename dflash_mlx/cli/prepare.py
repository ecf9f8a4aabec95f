"""From command-line settings to a loaded pair, prompt ids and a block size (no printing).

Shared by every command that generates (generate, benchmark, chat, serve): settings are
checked before anything is downloaded or loaded, so a typo fails in a second.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from .. import registry
from ..errors import InvalidArgumentError
from ..checks import check_sampling  # noqa: F401  (re-exported for the commands)
from ..checks import check_text, decode_text
from ..speculate import SpeculationConfig

Say = Callable[[str], None] | None
DEFAULT_LOOKUP_BLOCK = 5  # draft-free `--block-size auto`: the cost curve times a draft pass


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
    # this pair's speculation defaults on this device (block size settled by `choose_block`)
    speculation: SpeculationConfig = SpeculationConfig()
    pad_verify: bool = True  # pad verify passes where the cost curve says so (`speculation`)

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
        from ..cpu.cost import model_key

        return model_key(self.spec.target, self.target_revision, self.weights, self.spec.draft,
                         self.draft_bits)


def check_load_options(draft_bits: int | None, weights: str,
                       min_confidence: float | None = None) -> None:
    from ..cpu.policy import DRAFT_BITS, WEIGHT_POLICIES

    if draft_bits is not None and draft_bits not in DRAFT_BITS:
        raise InvalidArgumentError(f"--draft-bits must be 4, 8 or 16 (16 keeps the draft as is), "
                                   f"got {draft_bits}")
    if weights not in WEIGHT_POLICIES:
        raise InvalidArgumentError(f"--weights must be one of {', '.join(WEIGHT_POLICIES)}, "
                                   f"got {weights!r}")
    if min_confidence is not None and not 0 <= min_confidence <= 1:
        raise InvalidArgumentError(f"--min-confidence must be in [0, 1], got {min_confidence}")


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


def check_block_size(pair, block: int, what: str = "--block-size") -> None:
    from ..speculate import check_block_size as check

    check(pair, block, pair.draft is None, what)


def default_block(entry: registry.Entry | None) -> int:
    """The block size without --block-size: the registry entry's, else the built-in one."""
    return registry.DEFAULT_BLOCK if entry is None else entry.block_size


def read_prompt(positional: str | None, option: str | None) -> str:
    """The prompt text: PROMPT or --prompt; `-` (or nothing, with piped stdin) reads stdin."""
    if positional is not None and option is not None:
        raise InvalidArgumentError("give the prompt once: as PROMPT or as --prompt, not both")
    text = positional if positional is not None else option
    if text is None:
        if sys.stdin is None or sys.stdin.isatty():
            raise InvalidArgumentError("no prompt: pass PROMPT, --prompt TEXT, or - to read stdin")
        text = "-"
    if text == "-":
        text = _read_stdin()
    else:  # argv: Python decoded its bytes with surrogateescape
        check_text(text, "the prompt", from_bytes=True)
    if not text.strip():
        raise InvalidArgumentError("the prompt is empty")
    return text


def _read_stdin() -> str:
    """stdin as UTF-8 whatever the locale, so a stray byte is named instead of raising."""
    buffer = getattr(sys.stdin, "buffer", None)
    if buffer is None:  # a text stream handed in by a caller (tests, embedding)
        return check_text(sys.stdin.read(), "stdin", from_bytes=True)
    return decode_text(buffer.read(), "stdin")


def check_arg_text(value: str | None, option: str) -> None:
    """A text option from argv (e.g. --system-prompt) must be UTF-8, like the prompt."""
    if value is not None:
        check_text(value, option, from_bytes=True)


def open_pair(spec: registry.Spec, draft_bits: int | None, weights: str, say: Say = None,
              min_confidence: float | None = None, lookup: bool = True,
              pad_verify: bool = True):
    """Download what `spec` names (narrow patterns, progress bars) and load it.

    `min_confidence` and `lookup` settle `Loaded.speculation` (None: the device's default);
    `pad_verify` lets verify passes run at a wider, cheaper width, settled by `speculation`
    once the other settings are checked. Returns (pair, Loaded).
    """
    from ..utils import DRAFT_PATTERNS, MODEL_PATTERNS, load, resolve

    check_load_options(draft_bits, weights, min_confidence)
    if say is not None and (line := blas_warning()):
        _first_use(say)(line)  # in logs too: without a fast BLAS answers come 10-50x slower
    if say and spec.entry and spec.entry.missing:
        say(f"note: {spec.entry.name} needs {', '.join(spec.entry.missing)} support, which this "
            "version does not have yet; it may fail to load or run")
    spec = registry.materialize(spec, progress=_first_use(say))
    bars = say is not None
    t_path = resolve(spec.target, MODEL_PATTERNS, spec.target_revision, progress=bars)
    d_path = None
    draft_free = spec.draft == registry.LOOKUP
    if spec.draft is not None and not draft_free:
        d_path = resolve(spec.draft, DRAFT_PATTERNS, spec.draft_revision, progress=bars)
    pair = load(t_path, d_path, draft_bits=draft_bits, weights=weights, progress=say)
    loaded = Loaded(
        spec, t_path, d_path,
        spec.target_revision or registry.snapshot_revision(t_path),
        None if d_path is None else spec.draft_revision or registry.snapshot_revision(d_path),
        pair.draft_bits if d_path is not None else 16, pair.weights,
    )
    loaded.pad_verify = pad_verify
    loaded.speculation = SpeculationConfig.for_pair(
        pair, min_confidence=min_confidence, lookup=lookup or draft_free,
        draft_free=draft_free or None)
    return pair, loaded


def speculation(pair, loaded: Loaded, block: int | None = None,
                say: Say = None) -> SpeculationConfig:
    """The pair's speculation settings at `block`, with the verify padding this machine's
    cost curve chooses (timed on first use). Called after every other setting is checked, so
    a typo never waits for the timing."""
    pads = verify_pads(pair, loaded, say) if loaded.pad_verify else {}
    return loaded.speculation.replace(block_size=block, verify_pad=pads)


def _first_use(say: Say) -> Say:
    """One-time steps (the demo download, the verify-cost timing) take a minute at worst: where
    `say` is the CLI's terminal-only progress, their lines go to stderr in logs and pipes too.
    Another callback (the TUI's) is kept; None stays quiet."""
    from . import render

    return render.note if say is render.progress else say


def blas_warning() -> str | None:
    """One line with the fix, where MLX's CPU matmuls miss the fast BLAS (None: all is well).

    Silent on macOS (Accelerate), on a GPU, and where the user chose `DFLASH_MLX_BLAS=bundled`.
    """
    from ..cpu import blas
    from ..cpu.policy import on_cpu

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


def verify_pads(pair, loaded: Loaded, say: Say = None) -> dict[int, int]:
    """The verify widths worth padding here, from this machine's cost curve (CPU only).

    On a GPU a wider pass costs about the same as a narrower one, so nothing pads there. The
    curve is measured once per machine and model (a few seconds) and cached, as for
    `--block-size auto`.
    """
    from ..cpu.policy import on_cpu

    if (pair.draft is None and not loaded.speculation.draft_free) or not on_cpu():
        return {}
    from ..cpu.cost import curve_for

    # a miss measures the curve once (its rounds go to `say`) and caches it for later runs
    curve = curve_for(pair, loaded.cost_key(), _first_use(say))[0]
    pads = curve.pads()
    if say and curve.noisy:
        say(f"the verify-cost timing was too noisy (spread {curve.spread:.0%}: the machine is "
            "busy), so no verify pass is padded; `dflash-mlx doctor --remeasure` re-times it")
    if say and pads:
        say("padding verify passes " + ", ".join(f"{w}→{p}" for w, p in pads.items())
            + " tokens wide: cheaper on this BLAS (the added rows are never read; "
            "--no-pad-verify turns it off)")
    return pads


def choose_block(pair, loaded: Loaded, requested: int | str | None, say: Say = None) -> int:
    """The block size to run: 1 without a draft (unless draft-free), `auto` from the cached
    cost curve, None (no --block-size) from the registry entry (`default_block`)."""
    if pair.draft is None and not loaded.speculation.draft_free:
        return 1
    if requested is None:
        entry, block = loaded.spec.entry, default_block(loaded.spec.entry)
        check_block_size(pair, block, "--block-size" if entry is None else
                         f"registry entry {entry.name!r}: block_size")
        return block
    if requested == "auto" and pair.draft is None:
        return DEFAULT_LOOKUP_BLOCK
    if requested == "auto":
        from ..cpu.cost import auto_block_size

        best, hit = auto_block_size(pair, loaded.cost_key(), _first_use(say))
        if say:
            how = "cached measurement" if hit else "measured now, cached"
            say(f"--block-size auto → {best.block_size} (break-even τ {best.break_even:.2f}, "
                f"predicted {best.speedup:.2f}× at the assumed acceptance; {how})")
        return best.block_size
    check_block_size(pair, int(requested))
    return int(requested)


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


def choose_tree(pair, loaded: Loaded, requested: int | str, block: int, say: Say = None) -> int:
    """Tree nodes per round at `block`: the number asked for, or for `auto` the budget this
    machine's cached cost curve allows (`cpu/tree_budget.py`; nothing is timed here: without a
    curve with tree widths, one path). A pair that verifies one path only gets 0, and a note
    when a number was asked for."""
    from ..speculate.rounds import tree_budget

    if requested == 0:
        return 0
    probe = 1 if requested == "auto" else requested  # can this pair run a tree at all?
    runs, note = tree_budget(pair, loaded.speculation.replace(block_size=block, tree=probe),
                             loaded.speculation.draft_free)
    if not runs:
        if say and note and requested != "auto":
            say(f"note: {note}")
        return 0
    if requested != "auto":
        return int(requested)
    from ..cpu import cost, tree_budget as policy

    choice = policy.choose(cost.known(loaded.cost_key()), block)
    if say and choice.budget:
        say(f"--tree auto → {choice.budget}: {choice.why}")
    return choice.budget


def encoder(pair, template_kwargs: dict, use_template: bool = True):
    """messages → prompt ids through the chat template (with the reasoning kwargs)."""
    from ..chat import apply_template

    return lambda messages: apply_template(pair.tokenizer, messages, use_template=use_template,
                                           kwargs=template_kwargs)


def prompt_ids(pair, text: str, system: str | None, template_kwargs: dict,
               use_template: bool = True) -> list[int]:
    """The prompt's ids through the chat template, checked against the target (its context,
    its vocabulary) before anything slow runs."""
    from ..checks import encode_prompt

    messages = [{"role": "system", "content": system}] if system else []
    messages.append({"role": "user", "content": text})
    return encode_prompt(pair, encoder(pair, template_kwargs, use_template)(messages))
