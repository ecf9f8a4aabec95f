"""Input files a user names (`--prompts`, `--text`, `--json-schema`): regular files only.

A FIFO, a socket or a device where a file is expected is one line, never a wait: opening a
FIFO for reading blocks until some program writes to it, so the file is opened non-blocking
and judged on the descriptor itself (nothing can be swapped in between the check and the
read).
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

from .errors import InvalidArgumentError

_KINDS = ((stat.S_ISDIR, "a folder"), (stat.S_ISFIFO, "a pipe (FIFO)"),
          (stat.S_ISSOCK, "a socket"), (stat.S_ISCHR, "a character device"),
          (stat.S_ISBLK, "a block device"))


def read_bytes(path: str | os.PathLike, flag: str) -> bytes:
    """The whole of the regular file `path`; one line naming `flag` if it is anything else."""
    fd = _open(path, flag)
    with os.fdopen(fd, "rb") as f:
        try:
            return f.read()
        except OSError as e:
            raise InvalidArgumentError(f"{flag} {path}: cannot read ({e.strerror or e})") from None


def check_regular(path: str | os.PathLike, flag: str) -> Path:
    """`path` is a regular file that can be read (checked before slow work that reads it)."""
    os.close(_open(path, flag))
    return Path(path)


def _open(path, flag: str) -> int:
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY)
    except FileNotFoundError:
        raise InvalidArgumentError(f"{flag} {path}: cannot read (no such file)") from None
    except OSError as e:
        raise InvalidArgumentError(f"{flag} {path}: cannot read ({e.strerror or e})") from None
    mode = os.fstat(fd).st_mode
    if not stat.S_ISREG(mode):
        os.close(fd)
        kind = next((name for test, name in _KINDS if test(mode)), "not a regular file")
        raise InvalidArgumentError(f"{flag} {path}: is {kind}, not a regular file; give a file")
    os.set_blocking(fd, True)
    return fd
