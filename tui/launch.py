"""Build and run the app from command-line settings (`python -m tui` and `dflash-mlx chat`).

Model resolution is the CLI's own (`registry.resolve` → `prepare.open_pair` →
`prepare.choose_block`), run inside the app's loading worker so a bad model or a failed
download shows up in the app, not as a traceback.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from typing import NoReturn

from .settings import ChatSettings


def registry_loader(settings: ChatSettings, *, model: str | None = None,
                    draft: str | None = None, no_draft: bool = False, draft_bits: int | None = None,
                    weights: str = "auto", block_size: int | str = 5,
                    min_confidence: float | None = None, lookup: bool = True,
                    tree: int | str = 0) -> Callable:
    """A loader for the app's worker; it also settles block size and reasoning in `settings`.

    Args:
        block_size: a size, or "auto" (from the measured verify cost, as in `generate`).
        min_confidence: the cut of unsure draft slots (None: the device's default).
        lookup: context lookup for the draft's unsure slots (`dflash_mlx/proposal.py`).
        tree: draft-tree nodes per round, or "auto" (as in `generate`); settles
            `settings.tree`. Where the pair verifies one path, a note goes to `progress`.
    """

    def loader(progress):
        from dflash_mlx import registry
        from dflash_mlx.cli import prepare

        spec = registry.resolve(model, draft, no_draft)
        registry.reasoning_kwargs(spec.entry, settings.reasoning)  # checks the level
        pair, loaded = prepare.open_pair(spec, draft_bits, weights, progress, min_confidence,
                                         lookup)
        settings.block_size = prepare.choose_block(pair, loaded, block_size, progress)
        entry = spec.entry
        if entry is not None and entry.reasoning_kwarg:
            settings.reasoning_kwarg = entry.reasoning_kwarg
            settings.reasoning = settings.reasoning or entry.reasoning_default
        config = prepare.speculation(pair, loaded, settings.block_size, progress)
        settings.tree = prepare.choose_tree(pair, loaded, tree, settings.block_size, progress)
        return pair, config.replace(tree=settings.tree)

    return loader


def run_chat(settings: ChatSettings, loader: Callable, *, resume: bool = False,
             baseline_tps: float | None = None) -> NoReturn:
    """Run the chat app until the user quits, then end the process with its exit code.

    The app evaluates MLX on worker threads, and MLX can abort the interpreter's exit after
    that (`terminate called without an active exception`, exit 134, in about half of the
    quits measured here). By the time the app returns, the terminal is restored and every
    transcript is saved (after each turn), so nothing is left for the interpreter's own
    teardown to do: the process ends at once.
    """
    from .app import ChatApp

    app = ChatApp(loader=loader, settings=settings, resume=resume, baseline_tps=baseline_tps)
    app.run()
    code = app.return_code or 0
    failed = app.load_error
    if failed and not code:  # the pair never loaded: the terminal keeps the reason, exit 2
        sys.stderr.write(f"error: {failed}\n")
        code = 2
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
