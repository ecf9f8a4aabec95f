"""Filesystem faults for tests: a full disk and a read-only folder, scoped to one folder.

A test may run as root (CI containers), where a folder's mode bits do not stop a write: there
`read_only` raises the error the kernel would (EACCES) from the calls that write, instead of
skipping the test.
"""

from __future__ import annotations

import builtins
import contextlib
import errno
import io
import os
import tempfile
from pathlib import Path

IS_ROOT = hasattr(os, "geteuid") and os.geteuid() == 0
WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_TRUNC


def _writing(mode: str) -> bool:
    return any(c in mode for c in "wax+")


def _under(path, folder: Path) -> bool:
    try:
        return Path(os.fsdecode(path)).resolve().is_relative_to(folder)
    except (TypeError, ValueError, OSError):
        return False


def no_space() -> OSError:
    return OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


class FullDisk:
    """Files opened for writing under `folder` take `budget` bytes (or characters) in all,
    then a write stores what still fits and raises ENOSPC, as a full disk does. Files made by
    `tempfile.mkstemp` and opened with `os.fdopen` (atomic writes) count too. `budget` may be
    changed while a run goes on."""

    def __init__(self, monkeypatch, folder: Path, budget: float = 0):
        self.folder, self.budget, self.hits = Path(folder).resolve(), budget, 0
        made: dict[int, tuple[int, int]] = {}  # fd → (device, inode) of a file made here
        real_mkstemp, real_fdopen, real_open = tempfile.mkstemp, os.fdopen, builtins.open

        def identity(fd):
            st = os.fstat(fd)
            return st.st_dev, st.st_ino

        def mkstemp(*a, **k):
            fd, name = real_mkstemp(*a, **k)
            if _under(name, self.folder):
                made[fd] = identity(fd)
            return fd, name

        def fdopen(fd, mode="r", *a, **k):
            # a number closed and reused for another file is not this one: compare inodes
            ours = made.pop(fd, None) == identity(fd) and _writing(mode)
            f = real_fdopen(fd, mode, *a, **k)
            return _Filling(f, self) if ours else f

        def open_(file, mode="r", *a, **k):
            f = real_open(file, mode, *a, **k)
            if _writing(mode) and not isinstance(file, int) and _under(file, self.folder):
                return _Filling(f, self)
            return f

        monkeypatch.setattr(tempfile, "mkstemp", mkstemp)
        monkeypatch.setattr(os, "fdopen", fdopen)
        monkeypatch.setattr(builtins, "open", open_)
        monkeypatch.setattr(io, "open", open_)


class _Filling:
    """A file object whose writes draw on a FullDisk's budget."""

    def __init__(self, f, disk: FullDisk):
        self._f, self._disk = f, disk

    def write(self, data):
        disk = self._disk
        if len(data) > disk.budget:
            if disk.budget > 0:
                self._f.write(data[: int(disk.budget)])
            disk.budget, disk.hits = 0, disk.hits + 1
            raise no_space()
        disk.budget -= len(data)
        return self._f.write(data)

    def __getattr__(self, name):
        return getattr(self._f, name)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self._f.close()

    def __iter__(self):
        return iter(self._f)


@contextlib.contextmanager
def read_only(folder: Path, monkeypatch):
    """`folder` (which exists) refuses new files, folders and renames into it: by its mode bits
    as a user, by the failing calls as root."""
    folder = Path(folder)
    if not IS_ROOT:
        mode = folder.stat().st_mode
        folder.chmod(0o555)
        try:
            yield
        finally:
            folder.chmod(mode)
        return
    real = folder.resolve()

    def denied(path):
        return PermissionError(errno.EACCES, os.strerror(errno.EACCES), os.fsdecode(path))

    def guard(fn, test):
        def wrapped(*a, **k):
            if test(*a, **k):
                raise denied(a[0] if not isinstance(a[0], int) else "")
            return fn(*a, **k)
        return wrapped

    rename = lambda src, dst, *a, **k: _under(dst, real)  # noqa: E731
    opens = lambda file, mode="r", *a, **k: (  # noqa: E731
        _writing(mode) and not isinstance(file, int) and _under(file, real))
    with monkeypatch.context() as m:
        m.setattr(os, "open", guard(os.open, lambda p, flags, *a, **k: bool(flags & WRITE_FLAGS)
                                    and _under(p, real)))
        # an existing folder still answers EEXIST, as the kernel does
        m.setattr(os, "mkdir", guard(os.mkdir, lambda p, *a, **k: _under(p, real)
                                     and not os.path.lexists(p)))
        m.setattr(os, "replace", guard(os.replace, rename))
        m.setattr(os, "rename", guard(os.rename, rename))
        m.setattr(builtins, "open", guard(builtins.open, opens))
        m.setattr(io, "open", guard(io.open, opens))
        yield
