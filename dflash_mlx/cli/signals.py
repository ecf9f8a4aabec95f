"""Ctrl-C and SIGTERM end a command like one Ctrl-C: at a block boundary, stats printed,
exit 130 (143 for SIGTERM), never a traceback, however many times they arrive."""

from __future__ import annotations

import os
import signal
import sys

EXIT_INTERRUPTED = 130
EXIT_TERMINATED = 143


class Terminated(KeyboardInterrupt):
    """SIGTERM, delivered where Ctrl-C would be so every Ctrl-C path handles it too."""


def _on_term(signum, frame):
    raise Terminated()


def install() -> None:
    """SIGTERM raises `Terminated` in the main thread (Python's default would kill the
    process without the stats or the caches' cleanup)."""
    signal.signal(signal.SIGTERM, _on_term)


def settle() -> None:
    """Once a command is stopping, later Ctrl-C and SIGTERM are ignored, so the stats and the
    cleanup after the first one finish."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)


class StopRequests:
    """Inside a `with` block, SIGINT and SIGTERM ask for a stop instead of raising wherever
    they land: for work that stops at a boundary of its own (a training step, so the checkpoint
    written there is consistent). Later signals add nothing; `stopping()` re-raises the first
    as the exception it would have been (exit 130 or 143)."""

    def __init__(self):
        self.signum: int | None = None
        self._old: dict = {}

    @property
    def requested(self) -> bool:
        return self.signum is not None

    def _ask(self, signum, frame) -> None:
        if self.signum is None:
            self.signum = signum

    def __enter__(self) -> "StopRequests":
        for sig in (signal.SIGINT, signal.SIGTERM):
            if signal.getsignal(sig) is not signal.SIG_IGN:  # `cmd &` keeps ignoring Ctrl-C
                self._old[sig] = signal.signal(sig, self._ask)
        return self

    def __exit__(self, *exc) -> None:
        for sig, handler in self._old.items():
            signal.signal(sig, handler)

    def stopping(self) -> KeyboardInterrupt:
        settle()
        return Terminated() if self.signum == signal.SIGTERM else KeyboardInterrupt()


def exit_code(exc: BaseException) -> int:
    return EXIT_TERMINATED if isinstance(exc, Terminated) else EXIT_INTERRUPTED


def interrupted_during_start(exc: KeyboardInterrupt) -> int:
    """Before a command runs (imports, argument parsing): one line, the exit code."""
    settle()
    sys.stderr.write("\ninterrupted\n")
    return exit_code(exc)


def guard_startup() -> None:
    """Until a command runs, an uncaught Ctrl-C (one landing in the imports) prints one line
    and exits 130 instead of a traceback. The package calls this first thing when it is
    imported by the `dflash-mlx` command, and only then."""
    default = sys.excepthook

    def hook(kind, value, tb):
        if issubclass(kind, KeyboardInterrupt):
            sys.stderr.write("\ninterrupted\n")
            sys.stderr.flush()
            os._exit(exit_code(value))
        default(kind, value, tb)

    sys.excepthook = hook


def started_as_cli(argv: list[str]) -> bool:
    """The console script, or `python -m dflash_mlx.cli` (runpy imports the package while
    argv[0] is still "-m")."""
    return bool(argv) and (argv[0] == "-m" or os.path.basename(argv[0]) == "dflash-mlx")
