"""The `train-draft --out` folder: new, empty, or this command's own earlier output.

A run writes the draft there (config.json, model.safetensors, draft_vocab.json), its checkpoint
(trainer/) and by default its features (features/), replacing files of those names. A folder
that holds anything else (another model's weights and tokenizer, a user's files) is refused
unless forced, so a mistyped --out never overwrites a model. Ours: a folder with a checkpoint
(trainer/state.json, written with every draft), or one holding only what a run writes before
its first checkpoint.
"""

from __future__ import annotations

from pathlib import Path

from ..errors import InvalidArgumentError

STATE = Path("trainer") / "state.json"
BEFORE_CHECKPOINT = {"features", "draft_vocab.json", "trainer"}
MODEL_FILES = ("config.json", "tokenizer.json", "tokenizer_config.json", "tokenizer.model")


def check(out: Path, features: Path | None, force: bool) -> None:
    """Refuse (one line) an --out folder holding what this command did not write."""
    if force or (out / STATE).is_file():
        return
    found = foreign(out, features)
    if not found:
        return
    model = any(n in MODEL_FILES or n.endswith((".safetensors", ".gguf")) for n in found)
    what = "a model" if model else "files train-draft did not write"
    names = ", ".join(found[:3]) + (f" and {len(found) - 3} more" if len(found) > 3 else "")
    raise InvalidArgumentError(
        f"--out {out}: holds {what} ({names}), which a run there would overwrite; give an "
        "empty or new folder, or add --force to write there anyway")


def foreign(out: Path, features: Path | None) -> list[str]:
    """The names in `out` that no run of this command wrote: all of them but what a run
    writes before its first checkpoint, a --features folder inside it and the temporary
    files an interrupted write leaves."""
    if not out.is_dir():
        return []
    keep = {Path(features).resolve()} if features is not None else set()
    return sorted(p.name for p in out.iterdir() if p.name not in BEFORE_CHECKPOINT
                  and p.resolve() not in keep and not _temporary(p.name))


def _temporary(name: str) -> bool:
    return name.startswith(".probe.") or (name.startswith(".") and name.endswith(".tmp"))
