"""The process environment a command runs in: made safe where a safe reading exists, else
refused in one line before the command starts.

`prepare()` runs first, before anything is printed or any library reads the environment:
- stdout and stderr replace what their encoding cannot show (`PYTHONIOENCODING=ascii`), so
  an answer never ends in UnicodeEncodeError;
- COLUMNS or LINES that are not a sane size (0, negative, text) are dropped, so the width is
  measured instead (Rich would otherwise print tables 0 columns wide: nothing at all);
- an empty HOME or TMPDIR and empty or relative XDG_* values are dropped, as if unset (the
  XDG spec says to ignore them); libraries that read them directly (huggingface_hub) then
  agree with `paths.py` instead of writing under `/` or the current folder.

`check()` runs before each command: a deleted current folder, a TMPDIR that is not a folder,
an open-file limit below what mlx-lm sets on import, a path-valued variable naming an unknown
`~user`: each one line, exit 2.
"""

from __future__ import annotations

import os
import sys

from ..errors import InvalidArgumentError

SIZES = ("COLUMNS", "LINES")
MAX_SIZE = 10_000
XDG = ("XDG_CACHE_HOME", "XDG_DATA_HOME", "XDG_CONFIG_HOME", "XDG_STATE_HOME")
TEMP = ("TMPDIR", "TEMP", "TMP", "TEMPDIR")  # what Python's tempfile and MLX (C++) read
PATH_VARIABLES = ("DFLASH_MLX_CACHE", "DFLASH_MLX_DATA", "DFLASH_MLX_MODELS", "HF_HOME",
                  "HF_HUB_CACHE")
MLX_LM_NOFILE = 4096  # mlx_lm.utils sets RLIMIT_NOFILE to (2048, 4096) when imported


def prepare() -> None:
    for stream in (sys.stdout, sys.stderr):
        _replace_unencodable(stream)
    for name in SIZES:
        if not _is_size(os.environ.get(name)):
            os.environ.pop(name, None)
    for name in ("HOME", *TEMP):  # empty: as if unset (HOME: the password database's)
        if os.environ.get(name) == "":
            del os.environ[name]
    for name in XDG:
        if name in os.environ and not os.path.isabs(os.environ[name]):
            del os.environ[name]


def _replace_unencodable(stream) -> None:
    if getattr(stream, "errors", None) != "strict":
        return  # stderr's default (backslashreplace) already never raises
    try:
        stream.reconfigure(errors="replace")
    except (AttributeError, ValueError, OSError):  # not a TextIOWrapper (a test's capture)
        pass


def _is_size(value: str | None) -> bool:
    return value is None or (value.isdigit() and 0 < int(value) <= MAX_SIZE)


def check() -> None:
    try:
        os.getcwd()
    except FileNotFoundError:
        raise InvalidArgumentError("the current folder no longer exists (it was deleted): "
                                   "cd to one that does") from None
    for name in TEMP:
        value = os.environ.get(name)
        if value is not None and not os.path.isdir(value):
            raise InvalidArgumentError(f"{name}={value} is not a folder: create it, or unset "
                                       f"{name}")
    _check_open_files()
    from ..paths import env_path

    for name in PATH_VARIABLES:
        env_path(name)  # an unknown ~user: one line naming the variable


def _check_open_files() -> None:
    try:
        import resource
    except ImportError:  # not a POSIX system
        return
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < MLX_LM_NOFILE:
        raise InvalidArgumentError(
            f"the open-file limit is {soft} (hard limit {hard}); mlx-lm needs a hard limit of "
            f"at least {MLX_LM_NOFILE}: raise it (ulimit -n {MLX_LM_NOFILE}) and run again")


def expand_paths(kwargs: dict) -> dict:
    """A command's path options with `~` and `~user` expanded (`paths.expand`), as a shell
    would have done had the path not been quoted; an unknown user names the option."""
    from pathlib import Path

    from ..paths import expand

    def one(name, value):
        flag = "--" + name.replace("_", "-")
        if isinstance(value, Path):
            return expand(value, flag)
        if isinstance(value, (list, tuple)) and value and all(isinstance(v, Path) for v in value):
            return type(value)(expand(v, flag) for v in value)
        return value

    return {name: one(name, value) for name, value in kwargs.items()}
