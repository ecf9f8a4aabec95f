"""Where files go: user paths and path-valued environment variables, expanded in one place.

`~` and `~user` expand as a shell would. What a shell would leave broken is one line instead
of a traceback or a surprising place: an unknown user, a HOME that is relative, no home at all.
An empty HOME counts as unset (the password database then says where home is), so `HOME= cmd`
never turns `~/.cache` into `/.cache`. The XDG base directories follow the spec: an unset,
empty or relative value is ignored and the default under the home is used.
"""

from __future__ import annotations

import os
import pwd
import sys
from pathlib import Path

from .errors import InvalidArgumentError

# The project's own path-valued variables (each one a path, `~` allowed).
CACHE_ENV, DATA_ENV = "DFLASH_MLX_CACHE", "DFLASH_MLX_DATA"


def _what(what: str | None, value: str) -> str:
    """`--events ~x/e` or `NAME=~x/e`: the value as the user gave it."""
    if not what:
        return value
    return what + value if what.endswith("=") else f"{what} {value}"


def home(what: str | None = None) -> Path:
    """The user's home: $HOME when it is set and absolute, else the password database's."""
    value = os.environ.get("HOME")
    if value:
        if not os.path.isabs(value):
            raise InvalidArgumentError(f"HOME={value} is not an absolute path: set HOME to "
                                       "your home folder")
        return Path(value)
    try:
        entry = pwd.getpwuid(os.getuid()).pw_dir
    except KeyError:
        entry = ""
    if not entry:
        need = f" (needed for {what})" if what else ""
        raise InvalidArgumentError(f"no home folder: HOME is not set and user id {os.getuid()} "
                                   f"has none in the password database{need}; set HOME")
    return Path(entry)


def expand(value: str | os.PathLike, what: str | None = None) -> Path:
    """`value` with a leading `~` or `~user` expanded; `what` (e.g. "--events") names it in
    the one line an unknown user or a missing home gives."""
    text = os.fspath(value)
    if not text.startswith("~"):
        return Path(text)
    user, sep, rest = text[1:].partition("/")
    if not user:
        base = home(_what(what, text))
    else:
        try:
            base = Path(pwd.getpwnam(user).pw_dir)
        except KeyError:
            raise InvalidArgumentError(
                f"{_what(what, text)}: there is no user named {user!r}") from None
    return base / rest if sep and rest else base


def env_path(name: str) -> Path | None:
    """A path-valued variable, expanded; None when it is unset or empty."""
    value = os.environ.get(name)
    return expand(value, f"{name}=") if value else None


def xdg_dir(name: str, default: str) -> Path:
    """An XDG base directory: $name when it is an absolute path, else `~/default` (the spec:
    relative values are invalid and ignored)."""
    value = os.environ.get(name)
    if value and os.path.isabs(value):
        return Path(value)
    return home(f"the default {name}") / default


def user_dir(kind: str) -> Path:
    """The project's folder of `kind` ("cache" or "data"), not created: $DFLASH_MLX_CACHE /
    $DFLASH_MLX_DATA if set, else the platform's place (macOS Library, elsewhere XDG)."""
    env, mac, xdg, default = {
        "cache": (CACHE_ENV, "Library/Caches", "XDG_CACHE_HOME", ".cache"),
        "data": (DATA_ENV, "Library/Application Support", "XDG_DATA_HOME", ".local/share"),
    }[kind]
    if (override := env_path(env)) is not None:
        return override
    if sys.platform == "darwin":
        return home(f"the {kind} folder") / mac / "dflash-mlx"
    return xdg_dir(xdg, default) / "dflash-mlx"


def hub_cache() -> Path:
    """The Hugging Face hub cache as huggingface_hub finds it: $HF_HUB_CACHE, else
    $HF_HOME/hub, else $XDG_CACHE_HOME/huggingface/hub."""
    if (hub := env_path("HF_HUB_CACHE")) is not None:
        return hub
    if (hf_home := env_path("HF_HOME")) is not None:
        return hf_home / "hub"
    return xdg_dir("XDG_CACHE_HOME", ".cache") / "huggingface" / "hub"
