"""Files written whole or not at all: a temporary file in the same folder, then a rename.

A failure (a full disk, a read-only folder) raises OSError and leaves the old file as it was,
with no temporary file behind; a reader, or a second process writing the same file, never
sees half of one.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import BinaryIO, Callable, Union

Data = Union[str, bytes, Callable[[BinaryIO], None]]


def write_atomic(path: str | os.PathLike, data: Data) -> Path:
    """Write `data` (text, bytes, or a function that writes to a binary file) to `path`."""
    path = Path(path)
    write_all_atomic({path: data})
    return path


def write_all_atomic(files: dict[Path, Data]) -> None:
    """Write every file to a temporary one first, then rename them all: a failure on any
    file leaves every one of them as it was (a checkpoint stays whole)."""
    staged: list[tuple[str, Path]] = []
    try:
        for path, data in files.items():
            staged.append((_stage(Path(path), data), Path(path)))
        for tmp, path in staged:
            os.replace(tmp, path)
    finally:
        for tmp, _ in staged:
            Path(tmp).unlink(missing_ok=True)


def make_writable_folder(folder: str | os.PathLike) -> Path:
    """Create `folder` if need be and prove it takes a file (OSError if not): checked before
    slow work that would write there, not after it."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    fd, probe = tempfile.mkstemp(dir=folder, prefix=".probe.")
    os.close(fd)
    os.unlink(probe)
    return folder


def _stage(path: Path, data: Data) -> str:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            if callable(data):
                data(f)
            else:
                f.write(data.encode("utf-8") if isinstance(data, str) else data)
            f.flush()
            os.fsync(f.fileno())  # a full disk may only say so here
        os.chmod(tmp, 0o644)  # mkstemp makes 0600; these are ordinary output files
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return tmp
