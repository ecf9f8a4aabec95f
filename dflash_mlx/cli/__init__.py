"""The `dflash-mlx` command line (Typer): the only part of the package that prints."""

from .main import app

__all__ = ["app"]
