"""The `dflash-mlx` command line (Typer): the only part of the package that prints."""

from __future__ import annotations

import sys


def run() -> None:
    """The console entry point: Ctrl-C or SIGTERM at any moment, the imports included, ends
    with one line and exit 130 (143), never a traceback."""
    from . import signals

    try:
        signals.install()
        from .main import app

        app()
    except KeyboardInterrupt as e:
        sys.exit(signals.interrupted_during_start(e))


def __getattr__(name: str):
    if name == "app":  # `from dflash_mlx.cli import app` (tests, embedding) without main()
        from .main import app

        return app
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["app", "run"]
