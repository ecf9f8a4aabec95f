"""The `dflash-mlx` command line (Typer): the only part of the package that prints."""

from __future__ import annotations

import sys


def run() -> None:
    """The console entry point: Ctrl-C or SIGTERM at any moment, the imports included, ends
    with one line and exit 130 (143), never a traceback; so does a failing stdout (streams.py)."""
    from . import environment, signals, streams

    code = 0
    try:
        signals.install()
        environment.prepare()  # before anything prints or reads the environment
        streams.install()
        from .main import app

        app()
    except SystemExit as e:
        code = e.code
    except KeyboardInterrupt as e:
        code = signals.interrupted_during_start(e)
    except streams.ReaderGone:
        code = streams.reader_gone()
    except OSError as e:  # a write that bypassed the guarded streams
        code = streams.write_error(e)
    except streams.OutputFailed as e:  # outside a command (help, a usage line)
        sys.stderr.write(f"error: {e}\n")
        code = streams.EXIT_WRITE
    sys.exit(streams.finish(code))


def __getattr__(name: str):
    if name == "app":  # `from dflash_mlx.cli import app` (tests, embedding) without main()
        from .main import app

        return app
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["app", "run"]
