"""API keys, for the server that requires one and the client that sends one.

A key travels in an HTTP header, `Authorization: Bearer KEY`, so it must be printable ASCII
without spaces: a newline would end the header (a client refuses it, or worse, a proxy splits
it), a non-ASCII character is encoded differently by different clients. Such a key is refused
in one line when it is given, never found out by a 401 (or a traceback) later. An empty key is
refused too: for a server it would silently mean "no authentication".
"""

from __future__ import annotations

from ..errors import InvalidArgumentError

ENV = "DFLASH_MLX_API_KEY"


def _describe(c: str) -> str:
    names = {"\n": "a newline", "\r": "a carriage return", "\t": "a tab", " ": "a space"}
    return names.get(c, f"the character U+{ord(c):04X}")


def check_key(key: str | None, what: str = "the API key") -> str | None:
    """`key` unchanged when it can be sent as a Bearer token (None: no key at all)."""
    if key is None:
        return None
    if not isinstance(key, str) or not key:
        raise InvalidArgumentError(f"{what} is empty: give a key, or none at all")
    bad = next((c for c in key if not 33 <= ord(c) <= 126), None)
    if bad is not None:
        raise InvalidArgumentError(
            f"{what} holds {_describe(bad)} at character {key.index(bad)}: a key must be "
            "printable ASCII without spaces (it travels in an HTTP header)")
    return key

