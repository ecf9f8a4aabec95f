"""Files written whole or not at all: a temporary file in the same folder, then a rename.

A failure (a full disk, a read-only folder, Ctrl-C) leaves the old file as it was, with no
temporary file behind; a reader, or a second process writing the same file, never sees half of
one. A character device or a pipe (/dev/null, a FIFO another program reads) holds no old
content to keep: it is written directly, and never replaced by a rename.
"""

from __future__ import annotations

import errno
import os
import stat
import tempfile
import weakref
from pathlib import Path
from typing import BinaryIO, Callable, Union

Data = Union[str, bytes, Callable[[BinaryIO], None]]

# what a path names, for an output: written through a rename, written directly, or refused
RENAMED, DIRECT = "renamed", "direct"


def write_atomic(path: str | os.PathLike, data: Data) -> Path:
    """Write `data` (text, bytes, or a function that writes to a binary file) to `path`."""
    with Staged(path) as out:
        if callable(data):
            data(out.file)
        else:
            out.write(data)
    return Path(path)


def write_all_atomic(files: dict[Path, Data]) -> None:
    """Write every file to a temporary one first, then rename them all: a failure on any
    file leaves every one of them as it was (a checkpoint stays whole)."""
    staged: list[tuple[str, str]] = []
    try:
        for path, data in files.items():
            target = _regular_target(Path(path))
            staged.append((_stage(target, data), target))
        for tmp, target in staged:
            os.replace(tmp, target)
    finally:
        for tmp, _ in staged:
            Path(tmp).unlink(missing_ok=True)


def make_writable_folder(folder: str | os.PathLike) -> Path:
    """Create `folder` if need be and prove it takes a file (OSError if not): checked before
    slow work that would write there, not after it."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    _probe(folder)
    return folder


def output_kind(path: str | os.PathLike) -> str:
    """RENAMED (a regular file or a new one) or DIRECT (a character device, a pipe); OSError
    with a plain reason for a folder, a socket or a block device."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return RENAMED
    if stat.S_ISREG(st.st_mode):
        return RENAMED
    if stat.S_ISCHR(st.st_mode) or stat.S_ISFIFO(st.st_mode):
        return DIRECT
    why = "it is a folder" if stat.S_ISDIR(st.st_mode) else "it is not a regular file"
    raise OSError(errno.EISDIR if stat.S_ISDIR(st.st_mode) else errno.EINVAL, why, str(path))


def check_output(path: str | os.PathLike) -> None:
    """Whether `path` could be written, without touching what it holds now: checked before
    slow work, so a doomed run fails first and an existing file stays as it is."""
    if output_kind(path) == DIRECT:
        if stat.S_ISCHR(os.stat(path).st_mode):  # opening a pipe would end its reader's input
            os.close(os.open(path, os.O_WRONLY | os.O_NOCTTY))
        return
    _probe(Path(os.path.realpath(path)).parent)


class Staged:
    """An output file being written: into a temporary file beside `path`, renamed over it by
    `commit()` once complete; `discard()`, or leaving a `with` block by an exception, removes
    it and leaves `path` as it was. A device or a pipe is written directly (a
    pipe opened non-blocking, so one that no program reads is an error, not a hang).

    Every Staged not yet committed or discarded can be dropped at once (`discard_pending`):
    the CLI does so when a command ends, however it ends."""

    def __init__(self, path: str | os.PathLike):
        self.path, self.tmp, self.done = path, None, False
        if output_kind(path) == DIRECT:
            self.file = os.fdopen(_open_direct(path), "wb")
            self.direct = True
        else:
            target = _regular_target(Path(path))
            fd, self.tmp = tempfile.mkstemp(dir=Path(target).parent,
                                            prefix=f".{Path(target).name}.", suffix=".tmp")
            self.target, self.direct = target, False
            try:
                self.file = os.fdopen(fd, "wb")
            except BaseException:
                os.close(fd)
                os.unlink(self.tmp)
                raise
        _pending.add(self)

    @property
    def existed(self) -> bool:
        """Whether a file was there before (what a failed run leaves in place)."""
        return self.direct or os.path.exists(self.target)

    def write(self, data: str | bytes) -> None:
        self.file.write(data.encode("utf-8") if isinstance(data, str) else data)

    def flush(self) -> None:
        self.file.flush()

    def commit(self) -> None:
        """The content is complete: it takes the place of the old file."""
        if self.done:
            return
        try:
            self.file.flush()
            if not self.direct:
                os.fsync(self.file.fileno())  # a full disk may only say so here
                _keep_mode(self.tmp, self.target)
            self.file.close()
            if not self.direct:
                os.replace(self.tmp, self.target)
            self.done = True
        finally:
            self.discard()

    def discard(self) -> None:
        """Drop what was written (a device or pipe keeps what it took); idempotent."""
        _pending.discard(self)
        try:
            self.file.close()
        except OSError:  # the unwritten rest of a failed write: dropped with the file
            pass
        if self.tmp is not None:
            Path(self.tmp).unlink(missing_ok=True)
        self.done = True

    def __enter__(self) -> "Staged":
        return self

    def __exit__(self, kind, value, tb) -> None:
        if kind is None:
            self.commit()
        else:
            self.discard()


_pending: "weakref.WeakSet[Staged]" = weakref.WeakSet()


def discard_pending() -> None:
    """Drop every output still being written (a command that ended early)."""
    for staged in list(_pending):
        staged.discard()


def _open_direct(path) -> int:
    """A device or a pipe, for writing; a pipe without a reader is ENXIO, never a hang."""
    try:
        fd = os.open(path, os.O_WRONLY | os.O_NONBLOCK | os.O_NOCTTY)
    except OSError as e:
        if e.errno == errno.ENXIO:
            raise OSError(errno.ENXIO, "it is a pipe no program reads from", str(path)) from None
        raise
    os.set_blocking(fd, True)
    return fd


def _regular_target(path: Path) -> str:
    """The file a rename replaces: through symlinks (the link stays), never a device, pipe or
    folder (as root, a rename would replace /dev/null itself)."""
    if output_kind(path) != RENAMED:
        raise OSError(errno.EINVAL, "it is not a regular file", str(path))
    return os.path.realpath(path)


def _probe(folder: Path) -> None:
    fd, probe = tempfile.mkstemp(dir=folder, prefix=".probe.")
    os.close(fd)
    os.unlink(probe)


def _keep_mode(tmp: str, target: str) -> None:
    """mkstemp makes 0600; a new output is an ordinary 0644 file, a replaced one keeps its mode."""
    try:
        mode = stat.S_IMODE(os.stat(target).st_mode)
    except FileNotFoundError:
        mode = 0o644
    os.chmod(tmp, mode)


def _stage(target: str, data: Data) -> str:
    fd, tmp = tempfile.mkstemp(dir=Path(target).parent, prefix=f".{Path(target).name}.",
                               suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            if callable(data):
                data(f)
            else:
                f.write(data.encode("utf-8") if isinstance(data, str) else data)
            f.flush()
            os.fsync(f.fileno())  # a full disk may only say so here
        _keep_mode(tmp, target)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return tmp
