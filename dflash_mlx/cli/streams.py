"""stdout and stderr that never fail silently, nor with a traceback.

- stdout that cannot take what is written (a full disk, a closed descriptor): one `error:`
  line and exit code 2, never a success;
- stdout whose reader went away (`dflash-mlx models | head -1`): a quiet exit, as Unix tools
  do (141, the code a shell reports for a tool ended by SIGPIPE);
- stderr that cannot be written: nothing can be said, but the exit code is not 0.
A descriptor closed before the start (`>&-`) is held by /dev/null, so no file the command
opens takes its number and receives what was meant for the terminal.
"""

from __future__ import annotations

import errno
import io
import os
import sys

from ..errors import DFlashError

EXIT_PIPE = 141  # 128 + SIGPIPE
EXIT_WRITE = 2


class OutputFailed(DFlashError):
    """stdout cannot be written: one line, exit code 2 (a DFlashError, so every command's
    guard reports it like bad input)."""


class ReaderGone(BaseException):
    """stdout's reader went away. A BaseException, so no `except Exception` on the way
    swallows it; `run` ends the command quietly."""


class _Guarded:
    """A text stream whose write errors become OutputFailed / ReaderGone (stdout) or are
    dropped and remembered (stderr). After a failure the stream is dead: later writes are
    dropped, its descriptor points to /dev/null so the exit's own flush does not fail again."""

    def __init__(self, stream, name: str, loud: bool):
        self._stream, self._name, self._loud = stream, name, loud
        self.failure: BaseException | None = None

    def write(self, text):
        if self.failure is not None:
            return len(text)
        if not text:  # nothing to fail on; a probe with b"" still gets the stream's TypeError
            return self._stream.write(text)
        try:
            return self._stream.write(text)
        except OSError as e:
            return self._failed(e, len(text))

    def writelines(self, lines) -> None:
        for line in lines:
            self.write(line)

    def flush(self) -> None:
        if self.failure is not None:
            return
        try:
            self._stream.flush()
        except OSError as e:
            self._failed(e, 0)

    def _failed(self, e: OSError, size: int) -> int:
        if e.errno == errno.EPIPE:
            self.failure = ReaderGone()
        else:
            self.failure = OutputFailed(f"{self._name}: cannot write ({e.strerror or e})")
        _to_devnull(self._stream)
        if self._loud:
            raise self.failure
        return size

    def __getattr__(self, name):
        return getattr(self._stream, name)


class _Closed(io.TextIOBase):
    """A standard stream whose descriptor was closed when the command started."""

    encoding, errors = "utf-8", "strict"

    def write(self, text):
        if not isinstance(text, str):
            raise TypeError("write() argument must be str")
        if text:
            raise OSError(errno.EBADF, "the descriptor is closed")
        return 0

    def isatty(self) -> bool:
        return False

    def writable(self) -> bool:
        return True


def install() -> None:
    """Guard stdout and stderr (the console entry point calls this first)."""
    closed = _hold_closed_descriptors()
    if not isinstance(sys.stdout, _Guarded):
        out = _Closed() if 1 in closed or sys.stdout is None else sys.stdout
        sys.stdout = _Guarded(out, "stdout", loud=True)
    if not isinstance(sys.stderr, _Guarded):
        err = _Closed() if 2 in closed or sys.stderr is None else sys.stderr
        sys.stderr = _Guarded(err, "stderr", loud=False)


def finish(code) -> int:
    """The exit code once the command has ended: both streams flushed (what was printed last
    may only fail here), a failure reported once, a reader gone quietly."""
    code = 0 if code is None else code
    if not isinstance(code, int):  # sys.exit("message"): printed by Python, exit 1
        return code
    out, err = sys.stdout, sys.stderr
    for stream in (out, err):
        try:
            stream.flush()
        except (OutputFailed, ReaderGone):
            pass  # recorded on the stream
    failure = getattr(out, "failure", None)
    if isinstance(failure, ReaderGone):
        return EXIT_PIPE
    if failure is not None and code == 0:  # swallowed on its way (a library's except)
        err.write(f"error: {failure}\n")
        return EXIT_WRITE
    if getattr(err, "failure", None) is not None and code == 0:
        return EXIT_WRITE
    return code


WRITE_ERRORS = {errno.ENOSPC, errno.EBADF, errno.EIO, errno.EDQUOT, errno.EFBIG}


def write_error(e: OSError) -> int:
    """An OSError that reached the entry point: a failed write is one line; anything else is
    raised again (a bug to see)."""
    if e.errno == errno.EPIPE:
        return reader_gone()
    if e.errno not in WRITE_ERRORS:
        raise e
    sys.stderr.write(f"error: cannot write ({e.strerror or e})\n")
    return EXIT_WRITE


def reader_gone() -> int:
    """The exit code after ReaderGone ended a command: quiet, stdout silenced for the exit."""
    _to_devnull(getattr(sys.stdout, "_stream", sys.stdout))
    return EXIT_PIPE


def _to_devnull(stream) -> None:
    try:
        fd = stream.fileno()
    except (OSError, ValueError, AttributeError):
        return
    null = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(null, fd)
    finally:
        os.close(null)


def _hold_closed_descriptors() -> set[int]:
    """Descriptors 0-2 that are closed, now held by /dev/null."""
    closed = set()
    for fd in (0, 1, 2):
        try:
            os.fstat(fd)
        except OSError:
            closed.add(fd)
    for fd in sorted(closed):
        null = os.open(os.devnull, os.O_RDWR)
        if null != fd:
            os.dup2(null, fd)
            os.close(null)
    return closed
