"""Chat transcripts: saved after every turn, atomically, in the user's data directory.

Layout: ``<data>/chats/<id>.json`` (the chat: messages, settings, turns with per-block
records) and, on export, ``<id>.md`` and ``<id>.jsonl`` (one line per verify round).
"""

from __future__ import annotations

import json
import os
import tempfile
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

from dflash_mlx.paths import user_dir

FORMAT_VERSION = 1


def data_dir() -> Path:
    """The project's data directory (not created).

    `$DFLASH_MLX_DATA` if set, else `~/Library/Application Support/dflash-mlx` on macOS and
    `$XDG_DATA_HOME/dflash-mlx` (default `~/.local/share/dflash-mlx`) elsewhere.
    """
    return user_dir("data")


def chats_dir() -> Path:
    return data_dir() / "chats"


def write_atomic(path: Path, text: str) -> None:
    """Write to a temporary file in the same folder, fsync, then rename over `path`."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def new_id() -> str:
    return time.strftime("%Y%m%d-%H%M%S") + "-" + uuid.uuid4().hex[:6]


@dataclass
class Transcript:
    """One chat as saved on disk."""

    id: str = field(default_factory=new_id)
    model: str = ""
    draft: str | None = None
    settings: dict = field(default_factory=dict)
    messages: list[dict] = field(default_factory=list)
    turns: list[dict] = field(default_factory=list)
    created: float = field(default_factory=time.time)
    folder: Path | None = None

    @property
    def path(self) -> Path:
        return (self.folder or chats_dir()) / f"{self.id}.json"

    def to_dict(self) -> dict:
        return {"version": FORMAT_VERSION, "id": self.id, "created": self.created,
                "updated": time.time(), "model": self.model, "draft": self.draft,
                "settings": self.settings, "messages": self.messages, "turns": self.turns}

    def save(self) -> Path:
        write_atomic(self.path, json.dumps(self.to_dict(), ensure_ascii=False, indent=1))
        return self.path

    @classmethod
    def load(cls, path: Path) -> "Transcript":
        data = json.loads(Path(path).read_text(encoding="utf-8"))
        if data.get("version") != FORMAT_VERSION:
            raise ValueError(f"{path}: unknown transcript version {data.get('version')!r}")
        return cls(id=data["id"], model=data.get("model", ""), draft=data.get("draft"),
                   settings=data.get("settings", {}), messages=data.get("messages", []),
                   turns=data.get("turns", []), created=data.get("created", 0.0),
                   folder=Path(path).parent)

    def to_markdown(self) -> str:
        lines = [f"# Chat {self.id}", "",
                 f"Model: `{self.model}` · draft: `{self.draft or 'none'}`", ""]
        system = [m["content"] for m in self.messages if m["role"] == "system"]
        if system:
            lines += ["**System:** " + system[0], ""]
        for turn in self.turns:
            lines += ["## You", "", turn["user"], "", "## Assistant", ""]
            if turn.get("thinking"):
                lines += ["<details><summary>Thinking</summary>", "", turn["thinking"], "",
                          "</details>", ""]
            lines += [turn.get("answer", ""), ""]
            s = turn.get("stats", {}).get("all", {})
            if s:
                lines += [f"*{s.get('generation_tokens', 0)} tokens · τ {s.get('tau', 0):.2f} · "
                          f"{s.get('generation_tps', 0):.1f} tok/s · "
                          f"{turn.get('finish_reason')}*", ""]
        return "\n".join(lines)

    def to_jsonl(self) -> str:
        rows = []
        for n, turn in enumerate(self.turns):
            for i, block in enumerate(turn.get("blocks", [])):
                rows.append(json.dumps({"turn": n, "block": i, **block}, ensure_ascii=False))
        return "\n".join(rows) + ("\n" if rows else "")

    def export(self) -> tuple[Path, Path]:
        """Write `<id>.md` and `<id>.jsonl` next to the transcript."""
        md, jsonl = self.path.with_suffix(".md"), self.path.with_suffix(".jsonl")
        write_atomic(md, self.to_markdown())
        write_atomic(jsonl, self.to_jsonl())
        return md, jsonl


def latest(folder: Path | None = None) -> Path | None:
    """The most recently saved transcript, if any."""
    folder = folder or chats_dir()
    if not folder.is_dir():
        return None
    files = [p for p in folder.glob("*.json") if not p.name.startswith(".")]
    return max(files, key=lambda p: p.stat().st_mtime_ns, default=None)
