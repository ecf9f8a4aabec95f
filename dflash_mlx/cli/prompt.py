"""The prompt and text options as the command line gives them: argv or stdin, checked as UTF-8."""

from __future__ import annotations

import sys

from ..inputs import check_text, decode_text
from ..errors import InvalidArgumentError


def read_prompt(positional: str | None, option: str | None) -> str:
    """The prompt text: PROMPT or --prompt; `-` (or nothing, with piped stdin) reads stdin."""
    if positional is not None and option is not None:
        raise InvalidArgumentError("give the prompt once: as PROMPT or as --prompt, not both")
    text = positional if positional is not None else option
    if text is None:
        if sys.stdin is None or sys.stdin.isatty():
            raise InvalidArgumentError("no prompt: pass PROMPT, --prompt TEXT, or - to read stdin")
        text = "-"
    if text == "-":
        text = _read_stdin()
    else:  # argv: Python decoded its bytes with surrogateescape
        check_text(text, "the prompt", from_bytes=True)
    if not text.strip():
        raise InvalidArgumentError("the prompt is empty")
    return text


def _read_stdin() -> str:
    """stdin as UTF-8 whatever the locale, so a stray byte is named instead of raising."""
    buffer = getattr(sys.stdin, "buffer", None)
    if buffer is None:  # a text stream handed in by a caller (tests, embedding)
        return check_text(sys.stdin.read(), "stdin", from_bytes=True)
    return decode_text(buffer.read(), "stdin")


def check_arg_text(value: str | None, option: str) -> None:
    """A text option from argv (e.g. --system-prompt) must be UTF-8, like the prompt."""
    if value is not None:
        check_text(value, option, from_bytes=True)
