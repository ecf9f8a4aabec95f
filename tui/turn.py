"""One assistant turn as the UI sees it: BlockEvents → tinted text per channel, and statistics.

Pure logic (no widgets), so it is tested directly and reused to replay a saved transcript.

Provenance labels, one per committed token and then one per character of text:
``0`` none (user text, unknown), ``1..B-1`` an accepted draft token at that block position,
``LOOKUP`` an accepted token the context lookup filled in (dflash_mlx/proposal.py), ``TARGET``
the target's own token (the correction after a rejection, or the bonus token).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from dflash_mlx.generate import BlockEvent
from dflash_mlx.stats import Stats

TARGET = 16
LOOKUP = 17
THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
CHANNELS = ("thinking", "answer")

# C0/C1 controls (an ESC from a random model would reach the terminal) become visible
# symbols of the same length, so character labels stay aligned with the text.
_CONTROLS = {c: chr(0x2400 + c) for c in range(0x20) if c not in (0x09, 0x0A)}
_CONTROLS.update({0x0D: " ", 0x7F: "\u2421"})
_CONTROLS.update({c: "\ufffd" for c in range(0x80, 0xA0)})


def sanitize(text: str) -> str:
    """Replace terminal control characters one for one (tab and newline are kept)."""
    return text.translate(_CONTROLS)


def token_labels(ev: BlockEvent) -> list[int]:
    """Provenance of each committed token of one round: draft position i+1, LOOKUP or TARGET."""
    looked = ev.lookup_flags
    return [TARGET if i >= ev.accepted else LOOKUP if i < len(looked) and looked[i] else i + 1
            for i in range(len(ev.tokens))]


def char_labels(text: str, pieces: list[str], labels: list[int]) -> list[int]:
    """Spread per-token labels over the characters of the round's text.

    `pieces` are the tokens decoded one by one. When they join to `text` the mapping is exact;
    otherwise (a UTF-8 character split across tokens, a detokenizer holding text back) each
    token claims as many characters as it decoded to and the last token takes the rest.
    """
    if not text:
        return []
    if not labels:
        return [0] * len(text)
    if "".join(pieces) == text:
        return [lab for piece, lab in zip(pieces, labels) for _ in piece]
    out: list[int] = []
    for piece, lab in zip(pieces, labels):
        n = min(len(piece.replace("\ufffd", "")), len(text) - len(out))
        out.extend([lab] * n)
    out.extend([labels[-1]] * (len(text) - len(out)))
    return out


class ThinkSplitter:
    """Routes streamed text to the "thinking" or "answer" channel at <think> tags.

    A tag split across rounds is held back until it is complete. An opening tag counts only
    before any answer text; a template that opens the thinking section itself starts the
    splitter in thinking mode.
    """

    def __init__(self, thinking: bool = False):
        self.thinking = thinking
        self.seen_answer = False
        self._held = ""
        self._held_labels: list[int] = []

    def feed(self, text: str, labels: list[int]) -> list[tuple[str, str, list[int]]]:
        buf, labs = self._held + text, self._held_labels + labels
        out: list[tuple[str, str, list[int]]] = []
        while buf:
            tag = THINK_CLOSE if self.thinking else (None if self.seen_answer else THINK_OPEN)
            if tag == THINK_OPEN:
                body = buf.lstrip()
                if not (body.startswith(THINK_OPEN) or THINK_OPEN.startswith(body)):
                    tag = None  # the answer began without a thinking section
            i = buf.find(tag) if tag else -1
            if i >= 0:
                self._emit(out, buf[:i], labs[:i])
                buf, labs = buf[i + len(tag) :], labs[i + len(tag) :]
                self.thinking = not self.thinking
                continue
            keep = _partial_suffix(buf, tag) if tag else 0
            cut = len(buf) - keep
            self._emit(out, buf[:cut], labs[:cut])
            buf, labs = buf[cut:], labs[cut:]
            break
        self._held, self._held_labels = buf, labs
        return out

    @property
    def holding(self) -> bool:
        """Whether part of a tag is held back."""
        return bool(self._held)

    def flush(self) -> list[tuple[str, str, list[int]]]:
        out: list[tuple[str, str, list[int]]] = []
        self._emit(out, self._held, self._held_labels)
        self._held, self._held_labels = "", []
        return out

    def _emit(self, out: list, text: str, labels: list[int]):
        if not text:
            return
        channel = "thinking" if self.thinking else "answer"
        if channel == "answer" and text.strip():
            self.seen_answer = True
        if out and out[-1][0] == channel:
            out[-1] = (channel, out[-1][1] + text, out[-1][2] + labels)
        else:
            out.append((channel, text, labels))


def _partial_suffix(buf: str, tag: str) -> int:
    """Length of the longest end of `buf` that is a proper start of `tag`."""
    for n in range(min(len(tag) - 1, len(buf)), 0, -1):
        if buf.endswith(tag[:n]):
            return n
    return 0


@dataclass
class Turn:
    """The state of one assistant answer, fed with BlockEvents in order.

    Args:
        user: the user's message.
        decode: token id → text of that token alone (cached here).
        thinking: whether the prompt already opened a <think> section.
    """

    user: str
    decode: Callable[[int], str]
    thinking: bool = False
    stats: dict[str, Stats] = field(default_factory=lambda: {c: Stats() for c in CHANNELS})
    total: Stats = field(default_factory=Stats)
    text: dict[str, str] = field(default_factory=lambda: {c: "" for c in CHANNELS})
    blocks: list[dict] = field(default_factory=list)
    last: BlockEvent | None = None
    stopped: bool = False
    wall_s: float = 0.0
    started: float = field(default_factory=time.time)

    def __post_init__(self):
        self._splitter = ThinkSplitter(self.thinking)
        self._pieces: dict[int, str] = {}

    def _piece(self, token: int) -> str:
        piece = self._pieces.get(token)
        if piece is None:
            piece = self._pieces[token] = sanitize(self.decode(token))
        return piece

    def add(self, events: Iterable[BlockEvent]) -> list[tuple[str, str, list[int]]]:
        """Account for events; returns the new text as (channel, text, char labels) runs."""
        out: list[tuple[str, str, list[int]]] = []
        for ev in events:
            text = sanitize(ev.text)
            labels = char_labels(text, [self._piece(t) for t in ev.tokens], token_labels(ev))
            was_thinking = self._splitter.thinking
            runs = self._splitter.feed(text, labels)
            if ev.finish_reason is not None:
                runs += self._splitter.flush()
            # A round of tag tokens only (nothing visible) counts as thinking.
            tags = was_thinking or self._splitter.thinking or self._splitter.holding
            channel = _majority(runs, "thinking" if tags else "answer")
            self.stats[channel].add(ev)
            self.total.add(ev)
            self.last = ev
            self.blocks.append({**vars(ev), "channel": channel})
            for run in runs:
                self.text[run[0]] += run[1]
                if out and out[-1][0] == run[0]:
                    out[-1] = (run[0], out[-1][1] + run[1], out[-1][2] + run[2])
                else:
                    out.append(run)
        return out

    def finish(self, stopped: bool = False) -> list[tuple[str, str, list[int]]]:
        """End of the turn: flush a held partial tag."""
        self.stopped = stopped
        runs = self._splitter.flush()
        for channel, text, _ in runs:
            self.text[channel] += text
        return runs

    @property
    def finish_reason(self) -> str | None:
        return "stopped" if self.stopped else self.total.finish_reason

    def to_dict(self) -> dict:
        return {
            "user": self.user,
            "thinking": self.text["thinking"],
            "answer": self.text["answer"],
            "finish_reason": self.finish_reason,
            "thinking_open": self.thinking,
            "started": self.started,
            "wall_s": round(self.wall_s, 4),
            "stats": {
                "all": self.total.as_dict(),
                **{c: self.stats[c].as_dict() for c in CHANNELS if self.stats[c].rounds},
            },
            "blocks": self.blocks,
        }


def _majority(runs: list[tuple[str, str, list[int]]], default: str) -> str:
    """The channel that received most of a round's characters."""
    count = {c: 0 for c in CHANNELS}
    for channel, text, _ in runs:
        count[channel] += len(text)
    if not any(count.values()):
        return default
    return max(CHANNELS, key=lambda c: (count[c], c == default))


def replay_events(blocks: list[dict]) -> list[BlockEvent]:
    """BlockEvents back from a transcript's block records."""
    names = {f.name for f in dataclasses.fields(BlockEvent)}
    return [BlockEvent(**{k: v for k, v in b.items() if k in names}) for b in blocks]
