"""What a generation call accepts as text: prompts, system prompts, request bodies.

Shared by the engine, the CLI and the server, so a bad value reads the same one line wherever it
comes from, before anything is loaded or decoded. (Sampling settings check themselves:
`SamplingParams`.)

Text policy: prompts, system prompts and request bodies must be valid UTF-8 / Unicode. Text that
is not (a stray byte, a lone surrogate) is refused with its position, never replaced with U+FFFD:
a silently altered prompt gives an answer to a question nobody asked.

Special tokens: text is text. A special-token string in a raw prompt (say `<|im_end|>`) is
spelled with ordinary text tokens unless the caller asks to parse it (`special_tokens="parse"`:
a template written by hand); through the chat template, message text is always plain
(`chat.apply_template`). The CLI's and the server's `--special-tokens` choose; both default to
text, so nothing a client sends becomes a control token unless the operator allows it.
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


SPECIAL_TOKENS = ("text", "parse")


def check_special_tokens(mode: str, what: str = "--special-tokens") -> str:
    if mode not in SPECIAL_TOKENS:
        raise InvalidArgumentError(f"{what} must be text or parse, got {mode!r}")
    return mode


def _hf(tokenizer):
    """The Hugging Face tokenizer behind mlx-lm's TokenizerWrapper (or the tokenizer itself)."""
    return getattr(tokenizer, "_tokenizer", tokenizer)


def special_strings(tokenizer) -> list[str]:
    """The special tokens' texts (longest first): what plain text must not smuggle in.

    Added tokens marked non-special (Qwen's `<think>`) are ordinary vocabulary: a model's own
    answers carry them back in the history, so they stay as they are.
    """
    hf = _hf(tokenizer)
    added = getattr(hf, "added_tokens_decoder", None) or {}
    found = {t.content for t in added.values() if getattr(t, "special", False)}
    found.update(getattr(hf, "all_special_tokens", None) or [])
    return sorted((s for s in found if isinstance(s, str) and s), key=len, reverse=True)


def special_ids(tokenizer) -> set[int]:
    hf = _hf(tokenizer)
    added = getattr(hf, "added_tokens_decoder", None) or {}
    ids = {i for i, t in added.items() if getattr(t, "special", False)}
    return ids | set(getattr(hf, "all_special_ids", None) or [])


def encode_plain(tokenizer, text: str, specials: list[str] | None = None) -> list[int]:
    """`text`'s ids (no BOS) with every special-token string spelled as ordinary text tokens."""
    specials = special_strings(tokenizer) if specials is None else specials
    banned = special_ids(tokenizer)
    try:
        ids = list(tokenizer.encode(text, add_special_tokens=False, split_special_tokens=True))
    except TypeError:  # a tokenizer without the option
        ids = None
    if ids is not None and not banned.intersection(ids):
        return ids
    # A tokenizer without the option: spell each occurrence one character at a time.
    pattern = "|".join(re.escape(s) for s in specials)
    out, at = [], 0
    for m in re.finditer(pattern, text) if pattern else ():
        out += tokenizer.encode(text[at:m.start()], add_special_tokens=False)
        for ch in m.group(0):
            out += tokenizer.encode(ch, add_special_tokens=False)
        at = m.end()
    return out + tokenizer.encode(text[at:], add_special_tokens=False)


def _frame(tokenizer) -> tuple[list[int], list[int]]:
    """What the tokenizer puts before and after any text it encodes (a BOS, say)."""
    framed = list(tokenizer.encode("x"))
    bare = list(tokenizer.encode("x", add_special_tokens=False))
    for i in range(len(framed) - len(bare) + 1):
        if framed[i:i + len(bare)] == bare:
            return framed[:i], framed[i + len(bare):]
    return list(tokenizer.encode("")), []


def encode_text(tokenizer, text: str, special_tokens: str = "text") -> list[int]:
    """A raw prompt's ids, framed as the tokenizer frames text (its BOS). `special_tokens`:
    "text" spells special-token strings as ordinary text; "parse" makes them control tokens."""
    if check_special_tokens(special_tokens, "special_tokens") == "parse":
        return list(tokenizer.encode(text))
    if not any(s in text for s in special_strings(tokenizer)):
        return list(tokenizer.encode(text))  # nothing to spell: the tokenizer's own ids
    before, after = _frame(tokenizer)
    return before + encode_plain(tokenizer, text) + after


def encode_prompt(pair, prompt: str | list[int], special_tokens: str = "text") -> list[int]:
    """A prompt's ids (a string through `encode_text`), checked against the target: not empty,
    inside its context and its vocabulary."""
    if isinstance(prompt, str):
        check_text(prompt, "the prompt")
        ids = encode_text(pair.tokenizer, prompt, special_tokens) if prompt else []
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
