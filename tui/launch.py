"""Build and run the app from command-line settings (`python -m tui` and `dflash-mlx chat`).

The pair opens through the engine every front-end uses (`registry.resolve` → `engine.open`),
inside the app's loading worker, so a bad model or a failed download shows up in the app,
not as a traceback.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from typing import NoReturn

from dflash_mlx.engine import EngineSettings

from .settings import ChatSettings


def registry_loader(settings: ChatSettings, wanted: EngineSettings = EngineSettings(), *,
                    model: str | None = None, draft: str | None = None,
                    no_draft: bool = False) -> Callable:
    """A loader for the app's worker; it also settles block size, tree and reasoning in
    `settings`.

    Args:
        wanted: what to open and how to speculate (`engine.open` settles `auto` and the
            registry's defaults); notes, such as a tree that cannot run, go to `progress`.
    """

    def loader(progress):
        from dflash_mlx import engine, registry

        spec = registry.resolve(model, draft, no_draft)
        registry.reasoning_kwargs(spec.entry, settings.reasoning)  # checks the level
        opened = engine.open(spec, wanted, progress)
        settings.block_size, settings.tree = opened.block_size, opened.config.tree
        entry = spec.entry
        if entry is not None and entry.reasoning_kwarg:
            settings.reasoning_kwarg = entry.reasoning_kwarg
            settings.reasoning = settings.reasoning or entry.reasoning_default
        return opened.pair, opened.config

    return loader


def terminal_problem() -> str | None:
    """Why the chat app cannot run here (None: it can). It draws on the terminal and reads
    keys from it: without one (a pipe, a file, cron) it would write escape codes into a file
    and wait for keys forever."""
    missing = [name for name, stream in (("stdin", sys.stdin), ("stdout", sys.stdout))
               if stream is None or not stream.isatty()]
    if not missing:
        return None
    return (f"chat needs a terminal, but {' and '.join(missing)} "
            f"{'is' if len(missing) == 1 else 'are'} not one: run it in a terminal, or use "
            "`dflash-mlx generate` for a one-shot answer")


def run_chat(settings: ChatSettings, loader: Callable, *, resume: bool = False,
             baseline_tps: float | None = None) -> NoReturn:
    """Run the chat app until the user quits, then end the process with its exit code.

    The app evaluates MLX on worker threads, and MLX can abort the interpreter's exit after
    that (`terminate called without an active exception`, exit 134, in about half of the
    quits measured here). By the time the app returns, the terminal is restored and every
    transcript is saved (after each turn), so nothing is left for the interpreter's own
    teardown to do: the process ends at once.
    """
    if (problem := terminal_problem()) is not None:  # before the app takes the terminal
        sys.stderr.write(f"error: {problem}\n")
        raise SystemExit(2)
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
