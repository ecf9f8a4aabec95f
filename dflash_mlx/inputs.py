"""What a generation call accepts as text: prompts, system prompts, request bodies.

Shared by the engine, the CLI and the server, so a bad value reads the same one line wherever it
comes from, before anything is loaded or decoded. (Sampling settings check themselves:
`SamplingParams`.)

Text policy: prompts, system prompts and request bodies must be valid UTF-8 / Unicode. Text that
is not (a stray byte, a lone surrogate) is refused with its position, never replaced with U+FFFD:
a silently altered prompt gives an answer to a question nobody asked.
"""

from __future__ import annotations

import re

from .errors import InvalidArgumentError


# Python keeps argv and stdin bytes that are not UTF-8 as U+DC80..U+DCFF (surrogateescape); a
# JSON "\ud800" escape gives a lone surrogate too. Paired surrogates never survive decoding.
_SURROGATE = re.compile("[\ud800-\udfff]")


def decode_text(data: bytes, what: str) -> str:
    """`data` as UTF-8 text (a leading byte-order mark dropped), or one line naming the bad byte."""
    start = 3 if data.startswith(b"\xef\xbb\xbf") else 0
    try:
        return data[start:].decode("utf-8")
    except UnicodeDecodeError as e:
        at = start + e.start
        raise InvalidArgumentError(f"{what} is not valid UTF-8 text (byte 0x{data[at]:02x} at "
                                   f"offset {at}: {e.reason})") from None


def is_text(text: str) -> bool:
    """Whether `text` is valid Unicode (no lone surrogate), i.e. encodes as UTF-8."""
    return _SURROGATE.search(text) is None


def check_text(text: str, what: str, from_bytes: bool = False) -> str:
    """`text` unchanged if it is valid Unicode; else one line naming the first bad character.

    `from_bytes`: the text was decoded with surrogateescape (argv, stdin), so U+DC80..U+DCFF
    stand for bytes that were not UTF-8 and are reported as those bytes, at their byte offset.
    """
    m = _SURROGATE.search(text)
    if m is None:
        return text
    i, c = m.start(), ord(m.group())
    if from_bytes and 0xDC80 <= c <= 0xDCFF:
        offset = len(text[:i].encode("utf-8"))
        raise InvalidArgumentError(f"{what} is not valid UTF-8 text (byte 0x{c - 0xDC00:02x} at "
                                   f"offset {offset})")
    raise InvalidArgumentError(f"{what} is not valid Unicode text (lone surrogate U+{c:04X} at "
                               f"character {i})")


def encode_prompt(pair, prompt: str | list[int]) -> list[int]:
    if isinstance(prompt, str):
        check_text(prompt, "the prompt")
        ids = pair.tokenizer.encode(prompt) if prompt else []
    else:
        ids = [int(t) for t in prompt]
    if not ids:
        raise InvalidArgumentError("the prompt is empty")
    limit = pair.target.context_length
    if limit and len(ids) >= limit:
        raise InvalidArgumentError(
            f"the prompt has {len(ids)} tokens; the target's context is {limit} tokens"
        )
    bad = [t for t in ids if not 0 <= t < pair.target.vocab_size]
    if bad:
        raise InvalidArgumentError(f"prompt token id {bad[0]} is outside the target vocabulary")
    return ids
